"""Batched candidate-tree builders driven by the drafter's loop.

The drafter feeds the root, then one frontier per level, and hands back the draft's
log-probs at each fed node (or its logits: the top-k normalises them, ``draft_topk``)::

    frontier = builder.start(logprobs_root)            # [B, Vd] at the root
    while frontier is not None:
        logprobs = draft_step(frontier)                 # [B, F, Vd], frontier order
        frontier = builder.expand(logprobs)
    trees = builder.finish()                            # one CandidateTree per sequence

Every node the builder creates lands in a per-sequence *pool*, filled level by level
(so pool order is depth order)::

    pool index:  0 .. k-1 | k .. k+k*k-1 | ...
    depth:          1     |      2       | ...

``pool_tokens`` (target ids), ``pool_parents`` (pool index, -1 below the root),
``pool_depths`` and ``pool_scores`` (cumulative draft log-prob) are [B, P] views of the
filled part. Scores only decrease along a path: score(child) = score(parent) + log p <= score(parent).

The nodes the drafter feeds are the frontiers, level after level; ``feed_mask`` says what each
new frontier node attends to among them (its ancestors and itself), in feed order::

    feed column:  0 .. F1-1 | F1 .. F1+F2-1 | ...
    frontier:     depth 1   | depth 2       | ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from draft_service.static_tree import StaticLevel, StaticTreeSpec
from kernels import KernelSet
from runtime.tree import CandidateTree

__all__ = ["Frontier", "TreeBuilder", "DynamicTreeBuilder", "StaticTreeBuilder", "StaticTreeSpec"]


@dataclass(frozen=True, eq=False)
class Frontier:
    """Nodes the drafter feeds next (their children get proposed), same count F in every sequence."""

    pool_idx: torch.Tensor  # int64 [B, F], indices into the builder's pool
    tokens: torch.Tensor  # int64 [B, F], target ids
    parent_slot: torch.Tensor  # int64 [B, F], parent's index in the previous frontier (-1 at depth 1)
    depth: int  # of every frontier node; 1 = children of the root


class TreeBuilder(Protocol):
    def start(self, logprobs: torch.Tensor) -> Frontier | None: ...  # [B, Vd] at the root
    def expand(self, logprobs: torch.Tensor) -> Frontier | None: ...  # [B, F, Vd] at the frontier
    def finish(self) -> list[CandidateTree]: ...


class _NodePool:
    """Preallocated per-sequence node buffers [B, capacity]; ``size`` of them are filled."""

    def __init__(self, batch: int, capacity: int, device: torch.device):
        self._tokens = torch.zeros(batch, capacity, dtype=torch.int64, device=device)
        self._parents = torch.full((batch, capacity), -1, dtype=torch.int64, device=device)
        self._depths = torch.zeros(batch, capacity, dtype=torch.int64, device=device)
        self._scores = torch.full((batch, capacity), float("-inf"), dtype=torch.float32, device=device)
        self._constants: dict[tuple[int, int], tuple] = {}  # (depth, int parent) in the buffers, by index range
        self.size = 0

    tokens = property(lambda self: self._tokens[:, :self.size])
    parents = property(lambda self: self._parents[:, :self.size])
    depths = property(lambda self: self._depths[:, :self.size])
    scores = property(lambda self: self._scores[:, :self.size])

    def fits(self, batch: int, capacity: int, device: torch.device) -> bool:
        return self._tokens.shape == (batch, capacity) and self._tokens.device == device

    def reset(self) -> None:
        """Empty again, keeping the buffers (a static shape's next tree: what a graph replays)."""
        self.size = 0

    # The whole buffers [B, capacity], for kernels that write the nodes ``reserve`` made room for.
    all_tokens = property(lambda self: self._tokens)
    all_parents = property(lambda self: self._parents)
    all_scores = property(lambda self: self._scores)

    def reserve(self, n: int, depth: int, parent: int | None = None) -> int:
        """Room for one level's n nodes at ``depth`` (and, an int ``parent``, every node's parent); their
        tokens, parents and scores are the caller's to write from the returned first pool index on.

        Pool order is level order, so a range of pool indices has the same depth in every tree a
        builder grows (and an int parent, the same parent): a reused pool writes those constants once,
        and a graph captured after that never writes them."""
        lo, hi = self.size, self.size + n
        assert hi <= self._tokens.shape[1], "pool capacity exceeded"
        if self._constants.get((lo, hi)) != (depth, parent):
            self._depths[:, lo:hi] = depth
            if parent is not None:
                self._parents[:, lo:hi] = parent
            self._constants[lo, hi] = (depth, parent)
        self.size = hi
        return lo

    def append(self, tokens: torch.Tensor, parents: torch.Tensor | int, depth: int,
               scores: torch.Tensor | None) -> int:
        """Add one level's n nodes (``reserve``, then write them): tokens, parents and scores [B, n], or
        [B, F, k] with n = F * k (broadcast views are written as they are); an int ``parents``: every
        node's; ``scores`` None: written by the caller. Returns the first new pool index."""
        shape = tokens.shape
        lo = self.reserve(shape[1:].numel(), depth, parents if isinstance(parents, int) else None)
        hi = self.size
        self._tokens[:, lo:hi].view(shape).copy_(tokens)
        if isinstance(parents, torch.Tensor):
            self._parents[:, lo:hi].view(shape).copy_(parents)
        if scores is not None:
            self._scores[:, lo:hi].view(shape).copy_(scores)
        return lo


class _PoolBuilder:
    """Shared pool plumbing: the ``pool_*`` views, the draft top-k, and the feed masks."""

    _pool: _NodePool | None = None
    _frontier: Frontier | None = None

    def __init__(self, d2t: torch.Tensor, kernels: KernelSet):
        self._d2t, self._kernels = d2t, kernels
        self._fed_mask: torch.Tensor | None = None  # bool [B, 1 + fed, fed]: the root's row, then each fed node's
        self._last_fed = 0  # feed column of the previous frontier's first node

    pool_tokens = property(lambda self: self._filled().tokens)  # int64 [B, P], target ids
    pool_parents = property(lambda self: self._filled().parents)  # int64 [B, P], -1 = root
    pool_depths = property(lambda self: self._filled().depths)  # int64 [B, P]
    pool_scores = property(lambda self: self._filled().scores)  # float32 [B, P], cumulative log-prob

    def feed_mask(self, frontier: Frontier) -> torch.Tensor:
        """bool [B, F, fed + F]: what each node of ``frontier`` sees among the nodes fed so far and
        itself (feed columns): its ancestors and itself. Call once per frontier, in order.

        Every ancestor of a frontier node was itself in an earlier frontier, hence already fed;
        the parent of node j sits at column (previous frontier's first column) + parent_slot[j].
        So a new node's row is its parent's row plus its own column: one gather a level, with
        the fed nodes' rows kept from level to level.
        """
        b, f = frontier.tokens.shape
        dev = frontier.tokens.device
        if self._fed_mask is None:
            self._fed_mask = torch.zeros(b, 1, 0, dtype=torch.bool, device=dev)  # row 0: the root, sees none
        fed = self._fed_mask.shape[2]
        row = torch.where(frontier.parent_slot >= 0, 1 + self._last_fed + frontier.parent_slot, 0).to(dev)  # (B, F)
        self._last_fed = fed
        inherited = torch.gather(self._fed_mask, 1, row[..., None].expand(b, f, fed))  # (B, F, fed)
        own = torch.eye(f, dtype=torch.bool, device=dev).expand(b, f, f)
        rows = torch.cat([inherited, own], dim=2)  # (B, F, fed + F)
        self._fed_mask = torch.cat([torch.nn.functional.pad(self._fed_mask, (0, f)), rows], dim=1)
        return rows

    def _filled(self) -> _NodePool:
        assert self._pool is not None, "start() first"
        return self._pool

    def _new_pool(self, logprobs: torch.Tensor, capacity: int) -> None:
        """An empty pool: this builder's last one while the shape is the same (no allocations)."""
        b, dev = logprobs.shape[0], logprobs.device
        if self._pool is not None and self._pool.fits(b, capacity, dev):
            self._pool.reset()
        else:
            self._pool = _NodePool(b, capacity, dev)
        self._d2t = self._d2t.to(logprobs.device)
        self._fed_mask, self._last_fed = None, 0

    def _level_topk(self, logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k children of every fed node: (target ids, log-probs), each [B, F, k]."""
        lead = logprobs.shape[:-1]
        # (Log-probs clamped to at most 0 by the top-k: scores monotone along paths, so the best-by-score
        # set is closed under ancestors.)
        ids, lp = self._kernels.draft_topk(logprobs.reshape(-1, logprobs.shape[-1]), k, self._d2t)
        return ids.view(*lead, k), lp.view(*lead, k)


class DynamicTreeBuilder(_PoolBuilder):
    """EAGLE-2 dynamic tree: expand the top-k frontier by top-k children, keep the best nodes.

    start: the root's top-k -> k nodes at depth 1, the first frontier.
    expand: each of the k frontier nodes proposes its top-k children (k*k candidates, score =
    parent score + child log-prob); all enter the pool; the global top-k is the next frontier.
    finish: the best ``max_nodes`` pool nodes by score (ties: lower depth, then earlier pool
    index), ordered by depth then score, so siblings appear in the draft's rank order.
    """

    def __init__(self, top_k: int, depth: int, max_nodes: int, d2t: torch.Tensor, kernels: KernelSet):
        assert top_k >= 1 and depth >= 1 and max_nodes >= 1, (top_k, depth, max_nodes)
        super().__init__(d2t, kernels)
        self.top_k, self.depth, self.max_nodes = top_k, depth, max_nodes
        self._capacity = top_k + (depth - 1) * top_k * top_k
        self._frontier_scores: torch.Tensor | None = None  # (B, k): the frontier's cumulative scores

    def frontier_widths(self) -> list[int]:
        """F of every frontier ``start`` and ``expand`` return, in order."""
        return [self.top_k] * (self.depth - 1)

    def start(self, logprobs: torch.Tensor) -> Frontier | None:
        self._new_pool(logprobs, self._capacity)
        tokens, scores = self._level_topk(logprobs, self.top_k)  # (B, k)
        lo = self._pool.append(tokens, -1, 1, scores)
        idx = torch.arange(lo, lo + self.top_k, device=tokens.device).expand_as(tokens)
        self._frontier = Frontier(idx, tokens, torch.full_like(tokens, -1), 1)
        self._frontier_scores = scores
        return self._next()

    def expand(self, logprobs: torch.Tensor) -> Frontier | None:
        f = self._frontier
        assert f is not None and f.depth < self.depth, "no level left to expand"
        nf, k = logprobs.shape[1], self.top_k
        assert nf == f.pool_idx.shape[1], "log-probs must follow the frontier"
        tokens, lp = self._level_topk(logprobs, k)  # (B, F, k): candidate c = (c // k)-th parent
        # Every candidate (score = parent's score + log p) into the pool; the global top-k, equal scores
        # to the earlier candidate, is the next frontier.
        pool = self._pool
        lo = pool.reserve(nf * k, f.depth + 1)
        idx, best_tokens, slots, self._frontier_scores = self._kernels.expand_frontier(
            self._frontier_scores, lp, tokens, f.pool_idx, pool.all_tokens, pool.all_parents, pool.all_scores, lo, k)
        self._frontier = Frontier(idx, best_tokens, slots, f.depth + 1)
        return self._next()

    def finish(self) -> list[CandidateTree]:
        tokens, parents, depths, scores = (t.cpu().numpy() for t in self.finish_tensors())
        return [CandidateTree(tokens[i], parents[i], depths[i], scores[i]) for i in range(tokens.shape[0])]

    def finish_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``finish`` on the device: tokens, parents, depths, scores [B, n] (no host copy). The best
        ``max_nodes`` by score, equal scores to the earlier pool index, i.e. the lower depth first: a
        child never outscores its parent (log p <= 0) and on a tie the parent wins, so the best are
        closed under taking ancestors; then parents first (``kernels.best_nodes``)."""
        pool = self._filled()
        return self._kernels.best_nodes(pool.tokens, pool.parents, pool.depths, pool.scores,
                                        min(self.max_nodes, pool.size))

    def _next(self) -> Frontier | None:
        return self._frontier if self._frontier.depth < self.depth else None


class StaticTreeBuilder(_PoolBuilder):
    """A fixed tree shape (EAGLE/Medusa "choices"): node (r1, .., rd) is the rd-th best child of
    node (r1, .., rd-1). The pool holds the spec's nodes in spec order; the frontier at depth d
    is the depth-d nodes that have children in the spec (F varies by level, not by sequence)."""

    def __init__(self, spec: StaticTreeSpec, d2t: torch.Tensor, kernels: KernelSet):
        super().__init__(d2t, kernels)
        self.spec = spec
        self._levels: dict[int, tuple[torch.Tensor, ...]] = {}

    def _level_tensors(self, level: StaticLevel, device: torch.device) -> tuple[torch.Tensor, ...]:
        """A level's index tensors on the device, made once per builder (a CUDA graph captured
        from this builder replays them: a capture cannot copy from the host): each node's candidate
        among the fed nodes' top-k (parent slot * k + rank) and its parent's pool index, the
        frontier's candidates (its nodes are this level's: pool indices from ``lo``) and its
        parents' slots."""
        if level.depth not in self._levels:
            pick = [max(s, 0) * level.top_k + r for s, r in zip(level.parent_slot, level.rank)]
            lo = sum(len(lv.rank) for lv in self.spec.levels[:level.depth - 1])
            self._levels[level.depth] = tuple(torch.tensor(x, device=device, dtype=torch.int64) for x in (
                pick, level.parent, [pick[i - lo] for i in level.frontier], level.frontier,
                level.frontier_parent_slot))
        return self._levels[level.depth]

    def frontier_widths(self) -> list[int]:
        """F of every frontier ``start`` and ``expand`` return, in order."""
        return [len(level.frontier) for level in self.spec.levels if level.frontier]

    def start(self, logprobs: torch.Tensor) -> Frontier | None:
        self.spec.check_vocab(logprobs.shape[-1])
        self._new_pool(logprobs, len(self.spec.paths))
        self._frontier = None
        return self._grow(logprobs[:, None, :], self.spec.levels[0])  # the root is a 1-node frontier

    def expand(self, logprobs: torch.Tensor) -> Frontier | None:
        f = self._frontier
        assert f is not None, "no level left to expand"
        assert logprobs.shape[1] == f.pool_idx.shape[1], "log-probs must follow the frontier"
        return self._grow(logprobs, self.spec.levels[f.depth])

    def finish(self) -> list[CandidateTree]:
        # (copies: the pool's views would change with the builder's next tree)
        tokens, parents, depths, scores = (t.to("cpu", copy=True).numpy() for t in self.finish_tensors())
        return [CandidateTree(tokens[i], parents[i], depths[i], scores[i]) for i in range(tokens.shape[0])]

    def finish_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pool as it is: spec order is the trees' order (parents first, siblings by rank), so a
        node's pool index is its tree index and its parent's too (-1: the root). Views of the pool."""
        pool = self._filled()
        return pool.tokens, pool.parents, pool.depths, pool.scores

    def _grow(self, logprobs: torch.Tensor, level: StaticLevel) -> Frontier | None:
        """Create ``level``'s nodes from the draft at the fed nodes (logprobs [B, F, Vd]): each the
        rank-th child of its parent, scored its log-prob plus its parent's score (``static_level``)."""
        b = logprobs.shape[0]
        pick, parent, frontier_pick, frontier, frontier_slot = self._level_tensors(level, logprobs.device)
        ids, lp = self._level_topk(logprobs, level.top_k)  # (B, F, k)
        pool = self._pool
        lo = pool.reserve(len(level.rank), level.depth)
        tokens = self._kernels.static_level(ids, lp, pick, parent, pool.all_tokens, pool.all_parents, pool.all_scores,
                                            lo, frontier_pick)
        if not level.frontier:
            self._frontier = None
            return None
        self._frontier = Frontier(frontier.expand(b, -1), tokens, frontier_slot.expand(b, -1), level.depth)
        return self._frontier
