"""REPLAYED ACCEPTANCE, for benchmarks only (``benchmarks/replay_gates.py``): never in a server.

A model with random weights accepts nothing, so it cannot show what speculation buys at a scale
whose trained weights are not at hand. ``AcceptanceReplay`` takes the acceptance from a trace
recorded with a real target and head (``benchmarks/record_acceptance.py``) instead: the verifier,
given one, skips the token comparison and, per sequence per step, accepts as many nodes as the
trace's next entry says. Every cost stays real (the draft's trees, the verify forward over every
node, KV compaction of the accepted nodes, the commit, the draft extend over them); the OUTPUT IS
MEANINGLESS (the accepted tokens are the draft's guesses).

The accepted nodes are the tree's first-child path (each node's best-ranked child) as deep as it
goes; where the recorded length is longer than that path (a random head's tree is shallow and
wide), the next nodes in tree order stand in for the rest, so the compaction and the extend move
the recorded number of rows.

A tree smaller than the recorded one (the adaptive policy's sizes) accepts what that size accepted
at the same recorded step: from the accepted path's ranks in the tree (``ranks``: a tree of n nodes,
its best n, accepts the path's nodes up to the first ranked n or lower; any n), or from per-size
counts (``sizes``: the largest recorded size it holds); both ``record_acceptance.py``'s. Without
them a tree of n nodes accepts min(count, n): exact for a chain (its acceptance is a prefix), but it
credits a smaller dynamic tree with nodes it lacks, so ``replay_gates.py`` runs a policy only on
traces with per-size counts or ranks.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from common.tree_settings import level_cap
from kernels.acceptance import AcceptResult
from runtime.step_layout import Staging


class AcceptanceReplay:
    def __init__(self, traces: list[list], sizes: list[int] | None = None, ranks: bool = False):
        """``traces``: accepted-node counts per verification step, one list per recorded sequence; with
        ``sizes`` each step is a list, what each of those tree sizes accepted there; with ``ranks``, the
        accepted path's ranks (``acceptance_estimate.path_ranks``).

        Every recorded step goes into one pool, in a fixed pseudo-random order (seed 0), so that a short
        run or a single sequence replays a sample of all the steps of all the prompts: its mean
        acceptance is the trace's, not that of the first prompt or of the first steps of each answer
        (both run low). Sequence j of a run starts at its own offset in the pool (spread evenly, one per
        trace) and walks it, wrapping around."""
        assert traces and all(traces), "a replay needs non-empty traces"
        assert not (sizes and ranks), "per-size counts or ranks, not both"
        self.traces, self.sizes, self.ranks = traces, sizes, ranks
        steps = [step for t in traces for step in t]
        if sizes is not None:
            assert all(len(step) == len(sizes) for step in steps), "a count per size at every step"
        self.pool = [steps[i] for i in np.random.default_rng(0).permutation(len(steps))]
        self._next_seq = itertools.count()
        self._cursor: dict[int, int] = {}  # seq_id -> position in the pool
        self.replayed_steps = 0
        self._staging: Staging | None = None  # pinned: the real acceptance's inputs make no sync either

    @classmethod
    def of_config(cls, entry: dict) -> "AcceptanceReplay":
        """The replay of one config of a ``record_acceptance.py`` trace: by ranks, per-size counts or
        counts alone, whichever it holds (in that order)."""
        if "path_ranks" in entry:
            return cls(entry["path_ranks"], ranks=True)
        if "per_size" in entry:
            return cls(entry["per_size"]["traces"], entry["per_size"]["sizes"])
        return cls(entry["traces"])

    def start_of(self, j: int) -> int:
        """Where the j-th sequence of a run starts in the pool."""
        n = len(self.traces)
        return (j % n) * len(self.pool) // n + j // n

    def next_accepted(self, seq_id: int, nodes: int | None = None) -> int:
        """The sequence's next recorded step, for a tree of ``nodes`` nodes (None: the recorded tree)."""
        if seq_id not in self._cursor:
            self._cursor[seq_id] = self.start_of(next(self._next_seq))
        pos = self._cursor[seq_id]
        self._cursor[seq_id] = pos + 1
        step = self.pool[pos % len(self.pool)]
        if self.ranks:  # (a size that grows fewer levels, ``EAGLE3_TREE_LEVELS``: at most one node a level)
            return len(step) if nodes is None else min(sum(r < nodes for r in step), level_cap(nodes) or nodes)
        if self.sizes is None:
            return step
        if nodes is None:
            return step[-1]
        i = int(np.searchsorted(self.sizes, nodes, side="right")) - 1  # the largest recorded size it holds
        if i < 0:
            raise ValueError(f"a tree of {nodes} nodes: the trace starts at {self.sizes[0]}")
        return step[i]

    def accept(self, seq_ids: list[int], parents: np.ndarray, num_nodes: np.ndarray,
               logits: torch.Tensor) -> AcceptResult:
        """``parents`` [B, N+1] (root in column 0, kernel convention), ``num_nodes`` [B] (root included),
        ``logits`` [B, N+1, V]: the target's, for the bonus token after the last accepted node."""
        paths = [self._path(parents[i], int(num_nodes[i]), self.next_accepted(s, int(num_nodes[i]) - 1))
                 for i, s in enumerate(seq_ids)]
        width = max(len(p) for p in paths)
        path = np.full((len(paths), width), -1, dtype=np.int64)
        for i, p in enumerate(paths):
            path[i, :len(p)] = p
        if self._staging is None:
            self._staging = Staging(logits.device)
        lengths = np.fromiter((len(p) for p in paths), dtype=np.int64, count=len(paths))
        path_t, last, accepted = self._staging.upload([path, path[np.arange(len(paths)), lengths - 1], lengths - 1])
        bonus = logits[torch.arange(len(paths), device=logits.device), last].argmax(dim=-1)
        self.replayed_steps += 1
        return AcceptResult(path_t, accepted, bonus)

    @staticmethod
    def _path(parents: np.ndarray, size: int, k: int) -> list[int]:
        """Columns: the root, then k nodes (first-child path, then tree order)."""
        path, cur = [0], 0
        while len(path) <= k:
            children = np.nonzero(parents[1:size] == cur)[0]
            if not len(children):
                break
            cur = int(children[0]) + 1
            path.append(cur)
        rest = (c for c in range(1, size) if c not in path)
        path += list(itertools.islice(rest, max(0, k + 1 - len(path))))
        return path
