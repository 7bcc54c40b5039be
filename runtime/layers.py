"""Layers both models are built from: the target decoder and the EAGLE-3 draft head.

Module attribute names are checkpoint names (``gate_proj``, ``weight``), so either model
loads name by name. Attention layers take an explicit ``StepContext`` (no hidden globals):
the step's metadata, the model's own paged cache, RoPE tables, kernels. For serving, the
projections that read the same input fuse into one matmul (``fuse_projections``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels import KernelSet
from kernels.fused_linear import rope_epilogue_fits
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
        self.qkv_weight: torch.Tensor | None = None  # set by fuse_projections
        self.qkv_bias: torch.Tensor | None = None

    def fuse_projections(self) -> None:
        """One [q; k; v] matmul instead of three (inference only): the three weights become views
        of the fused one, so loading and memory stay as they were."""
        self.qkv_weight, self.qkv_bias = _fuse(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """q/k/v projections, ``attend``, o_proj: [T, in] -> [T, out]."""
        if self.qkv_weight is not None:
            qkv = ctx.kernels.linear(x, self.qkv_weight, self.qkv_bias)
        else:
            qkv = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)
        return ctx.kernels.linear(self.attend(qkv, ctx), self.o_proj.weight)

    def attend(self, qkv: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """RoPE on q/k, K/V into the paged cache, attention over it: qkv [T, (h + 2 kvh) d] (the fused
        projection's output) -> [T, h d], o_proj's input."""
        T, h, kvh, d = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
        q, k, v = q.view(T, h, d), k.view(T, kvh, d), v.view(T, kvh, d)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        k_cache, v_cache = ctx.kv_cache.layer(self.layer_idx)
        q = ctx.kernels.rope_write_kv(q, k, v, ctx.meta.positions, ctx.cos, ctx.sin, k_cache, v_cache,
                                      ctx.meta.slot_mapping)
        return ctx.kernels.paged_attention(q, k_cache, v_cache, ctx.meta, self.scale).reshape(T, -1)

    @property
    def rope_in_projection(self) -> bool:
        """Whether the fused projection can rotate q and k and write the KV itself (``project_attend``):
        no per-head q/k norm between the projection and RoPE, and heads its column tiles split whole."""
        return not hasattr(self, "q_norm") and rope_epilogue_fits(self.head_dim)

    def project_attend(self, hn: torch.Tensor, ss: torch.Tensor | None, eps: float, ctx: StepContext) -> torch.Tensor:
        """A few-row step's fused q/k/v projection of ``hn`` (scaled by ``ss``: ``scaled_linear``) and
        ``attend``: with the kernel set's ``scaled_qkv_rope`` where it applies, one kernel projects,
        rotates and writes the KV (no RoPE launch of its own), and attention reads its q."""
        k = ctx.kernels
        if k.scaled_qkv_rope is None or not self.rope_in_projection:
            return self.attend(k.scaled_linear(hn, ss, eps, self.qkv_weight, self.qkv_bias), ctx)
        k_cache, v_cache = ctx.kv_cache.layer(self.layer_idx)
        q = k.scaled_qkv_rope(hn, ss, eps, self.qkv_weight, self.qkv_bias, ctx.meta.positions, ctx.cos, ctx.sin,
                              k_cache, v_cache, ctx.meta.slot_mapping, self.num_heads, self.num_kv_heads, self.head_dim)
        return k.paged_attention(q, k_cache, v_cache, ctx.meta, self.scale).reshape(q.shape[0], -1)


class MLP(nn.Module):
    """SiLU-gated MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up_weight: torch.Tensor | None = None  # set by fuse_projections

    def fuse_projections(self) -> None:
        """One [gate; up] matmul instead of two (inference only), as ``Attention.fuse_projections``."""
        self.gate_up_weight, _ = _fuse(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor, kernels: KernelSet | None = None) -> torch.Tensor:
        if self.gate_up_weight is not None and kernels is not None:
            return kernels.linear(kernels.silu_mul(kernels.linear(x, self.gate_up_weight)), self.down_proj.weight)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _fuse(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the linears' weights (and biases) along the output axis; each linear's own
    parameters become views of the result, so no memory is held twice."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    bias = torch.cat([lin.bias.detach() for lin in linears]) if linears[0].bias is not None else None
    rows = [lin.weight.shape[0] for lin in linears]
    for lin, w in zip(linears, weight.split(rows)):
        lin.weight = nn.Parameter(w, requires_grad=False)
    if bias is not None:
        for lin, b in zip(linears, bias.split(rows)):
            lin.bias = nn.Parameter(b, requires_grad=False)
    return weight, bias
