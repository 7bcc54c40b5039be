"""RoPE application (rotate-half convention). The cos/sin tables are built in ``runtime/rope.py``."""

from __future__ import annotations

import torch

from kernels.attention import write_kv_ref


def apply_rope_ref(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, head_dim] by ``positions`` [T]; rotate-half pairs (i, i + d/2).

    out1 = x1*cos - x2*sin ; out2 = x2*cos + x1*sin   (math in float32, result in x.dtype)
    """
    c = cos[positions].unsqueeze(1)  # (T, 1, d/2)
    s = sin[positions].unsqueeze(1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def rope_write_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> torch.Tensor:
    """RoPE on q [T, heads, d] and k [T, kv_heads, d], then rotated k and v into the paged cache at
    ``slot_mapping`` [T] (a negative slot: a padding token, not written). Returns rotated q.
    q, k and v may be strided views of one fused projection."""
    q = apply_rope_ref(q, positions, cos, sin)
    k = apply_rope_ref(k, positions, cos, sin)
    write_kv_ref(k_cache, v_cache, k, v, slot_mapping)
    return q
