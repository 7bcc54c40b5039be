"""What an allocation will need, checked against what the device has, before allocating.

A 100,000,000-token context should be refused with the numbers, not die inside ``torch.empty``.
"""

from __future__ import annotations

import os

import torch

from common.errors import CapacityError

_GIB = 2**30


def available_bytes(device: torch.device) -> int:
    """Free memory on ``device``: the GPU's free memory, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):  # not Linux: free physical pages
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def rope_table_bytes(head_dim: int, max_positions: int) -> int:
    """Peak bytes while the RoPE tables are built: float64 angles, cos and sin, then the float32 tables."""
    return max_positions * (head_dim // 2) * (3 * 8 + 2 * 4)


def check_fits(what: str, need: int, device: torch.device) -> None:
    """Raise CapacityError naming ``what`` and both sizes when ``need`` bytes exceed what is free."""
    free = available_bytes(device)
    if need > free:
        raise CapacityError(f"{what}: {need / _GIB:.1f} GiB needed, {free / _GIB:.1f} GiB available on {device}")
