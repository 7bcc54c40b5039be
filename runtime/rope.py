"""Rotary position tables, with Llama 3 and linear rescaling; applied by ``kernels/rope.py``.

The cos/sin table is sized from the *runtime* context length, never from a checkpoint's
``max_position_embeddings`` (drafts ship 2048 there; sizing from it breaks long prompts).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from common.config import RopeScaling


def rope_tables(head_dim: int, theta: float, scaling: RopeScaling, max_positions: int,
                device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, head_dim/2] in float32 for a model's RoPE settings."""
    return rope_table(rope_inv_freq(head_dim, theta, scaling), max_positions, device)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], float64, after the configured rescaling."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths (> old_ctx / low_freq_factor) are slowed down by `factor`, short ones
    # (< old_ctx / high_freq_factor) kept, and the band between blended linearly in 1/wavelen.
    wavelen = 2 * math.pi / inv_freq
    old_ctx = s.original_max_position_embeddings
    low_wavelen, high_wavelen = old_ctx / s.low_freq_factor, old_ctx / s.high_freq_factor
    smooth = (old_ctx / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, out)


def rope_table(inv_freq: torch.Tensor, max_positions: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [max_positions, head_dim/2] in float32, computed by numpy on this thread.

    Not by torch's CPU ops: they split a table over the intra-op thread pool, and on a 2-core
    machine, in about one run of three of tests/test_exact_kernels.py, the pool's worker gave the
    second half of a 2,400-angle cos table other values (90 of 1,200 elements an ulp off in float32)
    than the same call gave before and after in the same process. numpy's float64 cos and sin gave
    torch's float32 tables bit for bit where they agree (SmolLM2's and the 8B's geometries)."""
    angles = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq.numpy())
    return (torch.from_numpy(np.cos(angles)).float().to(device), torch.from_numpy(np.sin(angles)).float().to(device))
