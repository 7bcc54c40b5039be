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


class Attention(nn.Module):
    """Grouped-query attention over the paged cache: q/k/v read ``in_features``, o_proj writes
    ``out_features``. ``qk_norm_eps``: Qwen3's per-head RMSNorm on q and k, before RoPE."""

    def __init__(self, in_features: int, out_features: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 layer_idx: int, bias: bool = False, qk_norm_eps: float | None = None):
        super().__init__()
        self.layer_idx = layer_idx  # this layer's slice of the model's paged cache
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(in_features, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(in_features, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(in_features, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, out_features, bias=False)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        self.scale = head_dim ** -0.5

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)  # (T, h, d)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)  # (T, kvh, d)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        return self.o_proj(paged_attend(q, k, v, ctx, self.layer_idx, self.scale))


class MLP(nn.Module):
    """SiLU-gated MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
