"""Programmatic dependent launch (PDL, Hopper and later): a kernel launched dependent on the one
before may start while that one ends, and waits (``griddepcontrol.wait``) for it to complete and
its writes to land before reading what it wrote.

Switches, read once at import (speed only: none changes a result's bits):

- ``EAGLE3_PDL`` (``1``; ``0``: plain launches): the fused projections
  (``kernels/fused_linear_triton.py``) launch dependent. Measured on an H200 (README: the GPU
  engine): 8B batch-1 step at 4K 4.880 -> 4.807 ms.
- ``EAGLE3_PDL_ALL`` (``1``; ``0``: the projections alone): RoPE with the KV write, attention and
  its split merge launch dependent too, so every kernel boundary of a decode layer overlaps.
  Measured on an H200 (4aaa390, ``benchmarks/results/pdl_ab_h200_4aaa390.json``, two rounds):
  SmolLM2 batch-1 step 0.861 -> 0.783 ms, 8B batch-1 step at 4K 4.633 -> 4.563 ms.
- ``EAGLE3_PDL_SMALL`` (``1``; ``0``: plain launches): the small kernels between a step's
  forwards launch dependent too: the draft's tree levels (level inputs, top-k, expansion, the final
  ranking), its step layouts, the tree masks, greedy acceptance and the compaction's slots
  (``small_launch``).
- ``EAGLE3_PDL_EARLY=1`` (off): a projection's programs let the next kernel launch right after
  their wait instead of after their main loop. Measured no faster (8B 4.580 against 4.568 ms).

Every dependent kernel waits before any early return: if all of a kernel's programs could return
without waiting, the kernel could complete before the one it depends on, and the kernel after it
would no longer be ordered after that one. It loads nothing before the wait but what the kernel
just before it cannot have written: each kernel lets its dependent launch only after its own
wait, so when a kernel starts, every kernel but the one just before it is complete. (Attention
reads its step's metadata there: RoPE, before it, writes only q and the new keys.)
"""

from __future__ import annotations

import functools
import os

import torch

PDL = os.environ.get("EAGLE3_PDL", "1") != "0"
PDL_ALL = PDL and os.environ.get("EAGLE3_PDL_ALL", "1") != "0"
PDL_SMALL = PDL_ALL and os.environ.get("EAGLE3_PDL_SMALL", "1") != "0"
PDL_EARLY = PDL and os.environ.get("EAGLE3_PDL_EARLY", "0") == "1"


@functools.lru_cache(maxsize=None)
def _hopper_or_later(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def dependent(t: torch.Tensor, switch: bool = PDL) -> bool:
    """Launch the kernel computing on ``t``'s device dependent on the one before (``switch``: which
    of the switches above governs it)."""
    return switch and t.is_cuda and _hopper_or_later(t.device)


def launch_options(on: bool) -> dict:
    """The launch's keyword for a dependent launch (none otherwise)."""
    return {"launch_pdl": True} if on else {}


def small_launch(t: torch.Tensor) -> dict:
    """A small kernel's launch keywords (``PDL_SMALL``): its ``USE_GDC`` constant and, launched
    dependent, the launch option. The kernel waits at its very start where ``USE_GDC``."""
    on = dependent(t, PDL_SMALL)
    return {"USE_GDC": on, **launch_options(on)}
