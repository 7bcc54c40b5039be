"""Layers both models are built from: the target decoder and the EAGLE-3 draft head.

Module attribute names are checkpoint names (``gate_proj``, ``weight``), so either model
loads name by name. Attention layers call ``paged_attend`` with an explicit ``StepContext``
(no hidden globals): the step's metadata, the model's own paged cache, RoPE tables, kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels import KernelSet
from kernels.metadata import AttentionMetadata
from runtime.kv_cache import PagedKVCache


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * w, computed in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


@dataclass(frozen=True, slots=True)
class StepContext:
    """Everything a layer needs besides its input: metadata, cache, RoPE tables, kernels."""

    meta: AttentionMetadata
    kv_cache: PagedKVCache
    cos: torch.Tensor
    sin: torch.Tensor
    kernels: KernelSet


def paged_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext, layer: int,
                 scale: float) -> torch.Tensor:
    """RoPE on q/k, K/V into the paged cache, attention over it: [T, h, d] -> [T, h * d]."""
    q = ctx.kernels.apply_rope(q, ctx.meta.positions, ctx.cos, ctx.sin)
    k = ctx.kernels.apply_rope(k, ctx.meta.positions, ctx.cos, ctx.sin)
    k_cache, v_cache = ctx.kv_cache.layer(layer)
    ctx.kernels.write_kv(k_cache, v_cache, k, v, ctx.meta.slot_mapping)
    out = ctx.kernels.paged_attention(q, k_cache, v_cache, ctx.meta, scale)
    return out.reshape(q.shape[0], -1)


class MLP(nn.Module):
    """SiLU-gated MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
