"""KV compaction after verification: keep only the accepted path, contiguous after the prefix.

Verification writes column c of sequence b (root c = 0, tree node i at c = i + 1) at KV index
prefix_lens[b] + c. Acceptance keeps path[b, 0..num_accepted[b]], whose j-th element must end
up at KV index prefix_lens[b] + j; the rejected nodes' entries are simply left behind::

    KV index      p    p+1  p+2  p+3  p+4  p+5          path = [0, 2, 5]
    before      root   n0   n1   n2   n3   n4
    after       root   n1   n4   ..   ..   ..           moves: p+2 -> p+1, p+5 -> p+2

Since path[j] >= j, the root and any leading run with path[j] == j are already in place.
"""

from __future__ import annotations

import torch


def _slots(idx: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat cache slots [B, K] of per-sequence KV indices idx [B, K]."""
    block = block_tables.gather(1, torch.div(idx, block_size, rounding_mode="floor"))
    return block * block_size + idx % block_size


def compaction_slots_ref(path: torch.Tensor, num_accepted: torch.Tensor, prefix_lens: torch.Tensor,
                         block_tables: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(src_slots, dst_slots), int64 [B * (D+1)] each: the moves that compact every path.

    Fixed size, so no host sync: entries that need no move are written as a copy of the
    sequence's root slot onto itself (the root never moves and no real move targets it, so
    these duplicate writes carry identical values). Real destinations are distinct.
    """
    j = torch.arange(path.shape[1], device=path.device)[None, :]  # (1, D+1)
    move = (j <= num_accepted[:, None]) & (path != j)  # (B, D+1); path is -1 past num_accepted
    src_idx = prefix_lens[:, None] + path.clamp(min=0)  # (B, D+1)
    dst_idx = prefix_lens[:, None] + j  # (B, D+1)
    last = block_tables.shape[1] * block_size - 1  # clamp keeps masked-out padding in range
    src = _slots(src_idx.clamp(max=last), block_tables, block_size)
    dst = _slots(dst_idx.clamp(max=last), block_tables, block_size)
    root = _slots(prefix_lens[:, None].clamp(max=last), block_tables, block_size)  # (B, 1)
    return torch.where(move, src, root).flatten(), torch.where(move, dst, root).flatten()


def compact_kv_ref(kv_data: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Copy every layer's K and V from ``src_slots`` to ``dst_slots`` [M]. Mutates ``kv_data``.

    kv_data: [L, 2, num_blocks, block_size, kv_heads, head_dim] (``PagedKVCache.data``).
    All sources are gathered before any destination is written, so a slot that is both the
    destination of one move and the source of another is read before it is overwritten.
    """
    layers, kv, num_blocks, block_size = kv_data.shape[:4]
    flat = kv_data.view(layers, kv, num_blocks * block_size, *kv_data.shape[4:])  # (L, 2, S, kvh, d)
    moved = flat.index_select(2, src_slots)  # (L, 2, M, kvh, d), a copy
    flat.index_copy_(2, dst_slots, moved)
