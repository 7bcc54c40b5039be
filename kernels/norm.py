"""RMSNorm with the residual add folded in, and the SiLU-gated activation: the per-layer
elementwise work between the matmuls."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, h) with h = x + residual (rounded to x.dtype; h = x without a residual) and
    normed = h * rsqrt(mean(h^2) + eps) * weight, computed in float32, returned in x.dtype.

    ``x``, ``residual``: [T, hidden]; ``weight``: [hidden]. ``h`` is the next residual stream.
    """
    h = x if residual is None else x + residual
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype), h


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for ``gate_up`` [T, 2 * inter] = [gate | up] -> [T, inter]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
