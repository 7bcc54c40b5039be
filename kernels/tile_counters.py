"""Counters for kernels whose programs share a tile's work across a launch (a split K, split keys):
each program of a tile adds one when its part is stored, and the tile's last program, the one that
counts the total, finishes the tile and sets its counter back to zero for the next launch.

One int32 buffer per call site: the tensor the launch reads that no other call site reads (a
projection's weight, a layer's KV cache) and the tile count. One call site's launches never overlap:
they follow one another on a stream, and a dependent launch counts only after the launch before it
has completed; no two streams run one model's forward at once. A buffer is made on the warm-up's
eager run, which precedes every graph capture of the same shapes.
"""

from __future__ import annotations

import torch

COUNTERS: dict[tuple, torch.Tensor] = {}


def tile_counters(owner: torch.Tensor, tiles: int) -> torch.Tensor:
    """The zeroed counters [tiles] of the call site that ``owner`` stands for."""
    key = (owner.device, owner.data_ptr(), tiles)
    if key not in COUNTERS:
        COUNTERS[key] = torch.zeros(tiles, dtype=torch.int32, device=owner.device)
    return COUNTERS[key]
