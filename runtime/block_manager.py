"""KV block accounting: which cache blocks each sequence owns.

Pure host-side bookkeeping (no tensors): a free list and per-sequence block tables. A
sequence holding ``n`` KV entries owns ``ceil(n / block_size)`` blocks.
"""

from __future__ import annotations

from common.errors import CapacityError


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._tables: dict[int, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def block_table(self, seq_id: int) -> list[int]:
        return self._tables.get(seq_id, [])

    def ensure_capacity(self, seq_id: int, num_tokens: int) -> list[int]:
        """Grow ``seq_id``'s table to hold ``num_tokens`` KV entries; returns the table.

        Raises CapacityError, allocating nothing, when the free blocks do not suffice.
        """
        table = self._tables.get(seq_id)
        if table is None:
            table = self._tables[seq_id] = []
        needed = -(-num_tokens // self.block_size) - len(table)  # (blocks_for, inline: called per sequence per step)
        if needed <= 0:
            return table
        if needed > len(self._free):
            raise CapacityError(
                f"KV cache exhausted: sequence {seq_id} needs {needed} more blocks of "
                f"{self.block_size} tokens, {len(self._free)} of {self.num_blocks} are free")
        for _ in range(needed):
            table.append(self._free.pop())
        return table

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Release the blocks past the first ``num_tokens`` KV entries (rewind)."""
        table = self._tables.get(seq_id)
        keep = -(-num_tokens // self.block_size)
        if table is None or len(table) <= keep:
            return
        while len(table) > keep:
            self._free.append(table.pop())

    def free(self, seq_id: int) -> None:
        """Return every block of ``seq_id``; freeing an unknown sequence is a no-op."""
        self._free.extend(reversed(self._tables.pop(seq_id, [])))
