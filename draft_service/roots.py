"""Each sequence's tree root in the draft: the draft's output [H] and log-probs [Vd] at its newest
committed row, which its next proposal grows from.

A root is either the sequence's own pair of tensors (what an extend left, copied out), or row j of a
chained step's buffers (``ChainedProposal.last`` and ``logp``, a graph's outputs that its next replay
rewrites). A chained step holds its whole batch's roots as one record, the buffers and the
sequences in row order: no per-sequence tensor work in the step (64 views and dict entries were
~0.1 ms of a batch-64 step's host time). Before a replay rewrites the buffers, ``release_rows``
copies out the held roots of the sequences it does not feed (a batch that changed).
"""

from __future__ import annotations

import torch


class Roots:
    def __init__(self):
        self._own: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._last: torch.Tensor | None = None  # [B, H]: the holder's outputs ...
        self._logp: torch.Tensor | None = None  # [B, Vd]: ... and log-probs
        self._held: dict[int, int] = {}  # seq_id -> its row there

    def set(self, seq_id: int, out: torch.Tensor, logp: torch.Tensor) -> None:
        """``seq_id``'s own root (tensors that nothing rewrites)."""
        self._held.pop(seq_id, None)
        self._own[seq_id] = (out, logp)

    def release_rows(self, seq_ids: list[int]) -> None:
        """A replay that writes the roots of ``seq_ids`` is about to be queued: the held roots of every
        other sequence are copied out first (queued before it, so they read the values before it)."""
        if not self._held:
            return
        gone = self._held.keys() - set(seq_ids)
        if gone:
            gone = sorted(gone)
            idx = torch.tensor([self._held[i] for i in gone], device=self._last.device)
            outs, logps = self._last.index_select(0, idx), self._logp.index_select(0, idx)
            for j, i in enumerate(gone):
                self.set(i, outs[j], logps[j])
        self._held = {}

    def hold(self, last: torch.Tensor, logp: torch.Tensor, seq_ids: list[int]) -> None:
        """The roots of ``seq_ids`` are rows 0.. of ``last`` [>= n, H] and ``logp`` [>= n, Vd] (after
        ``release_rows(seq_ids)`` and the launch that writes them)."""
        self._last, self._logp = last, logp
        self._held = dict(zip(seq_ids, range(len(seq_ids))))

    def get(self, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        j = self._held.get(seq_id)
        if j is not None:
            return self._last[j], self._logp[j]
        return self._own[seq_id]

    def stack(self, seq_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The roots of ``seq_ids``: outputs [n, H] and log-probs [n, Vd] (views of the holder's
        buffers where it holds exactly these sequences in this order)."""
        n, held = len(seq_ids), self._held
        if n and len(held) == n and all(held.get(i) == j for j, i in enumerate(seq_ids)):
            return self._last[:n], self._logp[:n]
        pairs = [self.get(i) for i in seq_ids]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._held or seq_id in self._own

    def ids(self) -> list[int]:
        return list(self._held.keys() | self._own.keys())

    def drop(self, seq_id: int) -> None:
        self._held.pop(seq_id, None)
        self._own.pop(seq_id, None)
