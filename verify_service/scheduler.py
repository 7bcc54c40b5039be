"""Admission and per-step batch composition for the target-only loop.

Admission reserves KV blocks for a request's whole lifetime (prompt + max new tokens), so
a running sequence never runs out of cache mid-generation and no work is ever preempted
or lost; a request that does not fit waits. Each step decodes every running sequence
(one token each) and fills the remaining token budget with prefill chunks, oldest first.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from common.errors import CapacityError
from runtime.block_manager import BlockManager, blocks_for
from verify_service.sequence import Sequence


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_batch_tokens: int, extra_kv: int = 0):
        """``extra_kv``: KV entries a sequence may hold beyond its own tokens (a candidate tree)."""
        self.blocks = blocks
        self.extra_kv = extra_kv
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._reserved = 0  # blocks promised to running sequences, allocated or not

    def _blocks_needed(self, seq: Sequence) -> int:
        return blocks_for(seq.max_kv_len + self.extra_kv, self.blocks.block_size)

    def add(self, seq: Sequence) -> None:
        need = self._blocks_needed(seq)
        if need > self.blocks.num_blocks:
            raise CapacityError(
                f"request needs {need} KV blocks ({seq.max_kv_len + self.extra_kv} tokens) but the cache holds "
                f"{self.blocks.num_blocks}; lower max_tokens or raise the KV cache size")
        self.waiting.append(seq)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            need = self._blocks_needed(self.waiting[0])
            if self._reserved + need > self.blocks.num_blocks:
                return  # first come, first served: later requests wait behind the head
            self._reserved += need
            self.running.append(self.waiting.popleft())

    def schedule(self, decode_tokens: Callable[[Sequence], int] = lambda s: 1,
                 extra_tokens: int = 0) -> list[tuple[Sequence, int]]:
        """Sequences to run this step with their number of new tokens.

        A decoding sequence runs ``decode_tokens(seq)`` tokens (1, or 1 + its tree's nodes).
        ``extra_tokens``: tokens the step runs beside (recomputed ones): prompt chunks get fewer.
        """
        self._admit()
        plan = [(s, decode_tokens(s)) for s in self.running if not s.prefilling]
        budget = self.max_batch_tokens - sum(n for _, n in plan) - extra_tokens
        for seq in self.running:
            if seq.prefilling and budget > 0:
                n = min(len(seq.prompt_ids) - seq.num_cached, budget)
                plan.append((seq, n))
                budget -= n
        for seq, n in plan:
            self.blocks.ensure_capacity(seq.seq_id, seq.num_cached + n)
        return plan

    def release(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
            self._reserved -= self._blocks_needed(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.seq_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
