"""Few-row projections with a decode layer's elementwise work folded into them: the references.

A decode layer per row is ``norm -> qkv -> attention -> o_proj -> add, norm -> gate_up -> silu *
up -> down -> add``. With a few rows each projection is a stream of its weight, and every
elementwise kernel between them a launch and a ramp of its own. RMSNorm's row scale factors out
of the matmul that follows it:

    rms_norm(h) @ w.T = rsqrt(mean(h^2) + eps) * ((h * norm_w) @ w.T)

so a projection's epilogue, which owns only some columns of h, can do everything the next one
needs but the scale: form h = out + residual, write it and ``hn = h * norm_w``, and add up its
columns' h^2. The next projection streams ``hn`` like any input and scales its accumulator by
the row's rsqrt at the end. The entries (``ss`` holds partial sums of h^2, [P, rows]: summed over
P in order, they are the row's sum; the references give P = 1):

    linear_add_norm(x, w, residual, norm_w)   -> (h, hn, ss)       h = x @ w.T + residual
                                                                   (norm_w None: h alone)
    scaled_linear(hn, ss, eps, w, bias)        = rsqrt(sum(ss) / K + eps) * (hn @ w.T) + bias
    scaled_gate_up_silu(hn, ss, eps, w)        = silu(gate) * up of scaled_linear(hn, ss, eps, w)
    scaled_qkv_rope(hn, ss, eps, w, bias, ...) = scaled_linear of the fused [q; k; v] weight, then
                                                 RoPE on q and k and k, v into the paged cache
                                                 (``rope_write_kv``): returns rotated q

``ss=None`` leaves the input unscaled (an input already normed). ``kernels/fused_linear_triton.py``
runs each as one kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.norm import silu_mul_ref
from kernels.rope import rope_write_kv_ref


def rope_epilogue_fits(head_dim: int) -> bool:
    """Whether ``scaled_qkv_rope`` takes heads of ``head_dim`` in one kernel: a column tile (at least
    16, ``tl.dot``'s smallest) must hold whole rotation pairs (i, i + d/2) of one head."""
    return head_dim % 16 == 0


def no_fused_rows(hidden: int) -> int:
    """The reference and batch-invariant sets' ``fused_rows``: every step runs the separate kernels."""
    return 0


def linear_add_norm_ref(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                        norm_weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(h, hn, ss): h = x @ weight.T + residual (the product and the sum each rounded to x.dtype,
    as ``linear`` then ``rms_norm`` round them), hn = h * norm_weight rounded once, ss [1, rows] =
    sum(h^2) in float32; without a ``norm_weight``, (h, None, None)."""
    h = F.linear(x, weight) + residual
    if norm_weight is None:
        return h, None, None
    hf = h.float()
    return h, (hf * norm_weight.float()).to(x.dtype), hf.pow(2).sum(-1)[None, :]


def scaled_linear_ref(x: torch.Tensor, ss: torch.Tensor | None, eps: float, weight: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """rsqrt(sum(ss) / K + eps) * (x @ weight.T) + bias, in float32, rounded once to x.dtype; with
    ``ss`` None, ``F.linear(x, weight, bias)``."""
    if ss is None:
        return F.linear(x, weight, bias)
    out = F.linear(x.float(), weight.float()) * torch.rsqrt(ss.sum(0) / x.shape[-1] + eps)[:, None]
    return (out if bias is None else out + bias.float()).to(x.dtype)


def scaled_gate_up_silu_ref(x: torch.Tensor, ss: torch.Tensor | None, eps: float,
                            weight: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for ``scaled_linear(x, ss, eps, weight)`` = [gate | up]: [rows, N / 2]."""
    return silu_mul_ref(scaled_linear_ref(x, ss, eps, weight))


def scaled_qkv_rope_ref(x: torch.Tensor, ss: torch.Tensor | None, eps: float, weight: torch.Tensor,
                        bias: torch.Tensor | None, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """``scaled_linear`` of the fused [q; k; v] ``weight`` (its output rounded to x.dtype), then
    ``rope_write_kv``: RoPE on q [rows, heads, head_dim] and k, k and v into the paged cache at
    ``slot_mapping`` (a negative slot: not written). Returns rotated q [rows, heads, head_dim]."""
    qkv = scaled_linear_ref(x, ss, eps, weight, bias)
    T = qkv.shape[0]
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return rope_write_kv_ref(q.view(T, heads, head_dim), k.view(T, kv_heads, head_dim),
                             v.view(T, kv_heads, head_dim), positions, cos, sin, k_cache, v_cache, slot_mapping)
