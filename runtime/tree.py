"""Candidate trees: what the draft proposes and the target verifies, for one sequence.

A tree hangs below the *root*, the sequence's newest committed token (not yet in the
target's KV cache). Nodes are numbered 0..N-1 with parents before children::

    root ─┬─ 0 "Paris" ─┬─ 2 "."      parents = [-1, -1, 0, 0, 1]
          │             └─ 3 ","      depths  = [ 1,  1, 2, 2, 2]
          └─ 1 "the" ───── 4 "city"

When verified, node i sits at RoPE position root_position + depths[i] and attends to the
sequence's prefix, the root, its ancestors and itself (the mask: ``kernels/tree.py``). Siblings are listed in the order the
draft ranks them (acceptance tries children in that order).
"""

from __future__ import annotations

import numpy as np

from common.errors import InvalidRequestError


class InvalidTreeError(InvalidRequestError):
    """A candidate tree breaks an invariant (order, depth, vocabulary, size)."""

    def __init__(self, message: str):
        super().__init__("tree", message)


class CandidateTree:
    """One sequence's tree. Not a frozen dataclass: a step makes one per sequence (1.6 us each frozen
    against 0.4, the host being a batch-64 step's critical path); treat it as read-only.
    ``deepest``: its depth, when the maker knows it (``max_depth`` computes it otherwise)."""

    __slots__ = ("tokens", "parents", "depths", "log_probs", "_deepest")

    def __init__(self, tokens: np.ndarray, parents: np.ndarray, depths: np.ndarray, log_probs: np.ndarray,
                 deepest: int | None = None):
        self.tokens = tokens  # int64 [N], target-vocabulary ids
        self.parents = parents  # int64 [N], -1 for children of the root, else an earlier node index
        self.depths = depths  # int64 [N], 1 for children of the root
        self.log_probs = log_probs  # float32 [N], cumulative draft log-probability of the path to the node
        self._deepest = deepest

    def __repr__(self) -> str:
        return f"CandidateTree(tokens={self.tokens!r}, parents={self.parents!r}, depths={self.depths!r})"

    @classmethod
    def from_lists(cls, tokens, parents, depths=None, log_probs=None) -> "CandidateTree":
        parents = np.asarray(parents, dtype=np.int64).reshape(-1)
        if depths is None:
            depths = _depths_from_parents(parents)
        n = parents.shape[0]
        lp = np.zeros(n, dtype=np.float32) if log_probs is None else np.asarray(log_probs, dtype=np.float32)
        return cls(np.asarray(tokens, dtype=np.int64).reshape(-1), parents,
                   np.asarray(depths, dtype=np.int64).reshape(-1), lp.reshape(-1))

    @classmethod
    def chain(cls, tokens, log_probs=None) -> "CandidateTree":
        """A single path: node i is the child of node i - 1."""
        n = len(tokens)
        return cls.from_lists(tokens, np.arange(n) - 1, np.arange(1, n + 1), log_probs)

    @classmethod
    def empty(cls) -> "CandidateTree":
        return cls.from_lists([], [])

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def max_depth(self) -> int:
        if self._deepest is None:
            self._deepest = int(self.depths.max()) if self.num_nodes else 0
        return self._deepest

    def validate(self, vocab_size: int, max_nodes: int | None = None, max_depth: int | None = None) -> None:
        """Raise InvalidTreeError unless every invariant holds."""
        n = self.num_nodes
        arrays = {"parents": self.parents, "depths": self.depths, "log_probs": self.log_probs}
        if self.tokens.ndim != 1 or any(a.ndim != 1 or a.shape[0] != n for a in arrays.values()):
            raise InvalidTreeError("tokens, parents, depths and log_probs must be 1-D arrays of one length")
        if max_nodes is not None and n > max_nodes:
            raise InvalidTreeError(f"{n} nodes exceed the limit of {max_nodes}")
        if n == 0:
            return
        if ((self.tokens < 0) | (self.tokens >= vocab_size)).any():
            raise InvalidTreeError(f"token ids must be in [0, {vocab_size})")
        idx = np.arange(n)
        if ((self.parents < -1) | (self.parents >= idx)).any():
            bad = int(idx[(self.parents < -1) | (self.parents >= idx)][0])
            raise InvalidTreeError(f"node {bad} has parent {int(self.parents[bad])}: parents must come before children")
        if not np.array_equal(self.depths, _depths_from_parents(self.parents)):
            raise InvalidTreeError("depths must equal the parent's depth + 1 (1 below the root)")
        if max_depth is not None and self.max_depth > max_depth:
            raise InvalidTreeError(f"depth {self.max_depth} exceeds the limit of {max_depth}")
        pairs = np.stack([self.parents, self.tokens], axis=1)
        if np.unique(pairs, axis=0).shape[0] != n:
            raise InvalidTreeError("siblings must carry distinct tokens")

    def prune_depth(self, max_depth: int) -> "CandidateTree":
        """The subtree of nodes at depth <= max_depth (e.g. near the end of the context)."""
        if self.max_depth <= max_depth:
            return self
        keep = np.nonzero(self.depths <= max_depth)[0]
        remap = np.full(self.num_nodes, -1, dtype=np.int64)
        remap[keep] = np.arange(keep.shape[0])
        parents = np.where(self.parents[keep] >= 0, remap[np.maximum(self.parents[keep], 0)], -1)
        return CandidateTree(self.tokens[keep], parents, self.depths[keep], self.log_probs[keep])


def pack_trees(trees: list[CandidateTree]) -> np.ndarray:
    """Trees of one size as the device proposal lays them out: int64 [4, B, n], tokens | parents |
    depths | the float32 bits of the draft scores (``unpack_trees`` is its inverse)."""
    return np.stack([np.stack([t.tokens, t.parents, t.depths, t.log_probs.astype(np.float32).view(np.int32)])
                     for t in trees], axis=1).astype(np.int64)


def unpack_trees(packed: np.ndarray) -> list[CandidateTree]:
    """The trees of ``pack_trees``' layout (views of ``packed``), one per column of its batch."""
    scores = packed[3].astype(np.int32).view(np.float32)
    return [CandidateTree(packed[0, j], packed[1, j], packed[2, j], scores[j]) for j in range(packed.shape[1])]


def invalid_trees(trees: list[CandidateTree], vocab_size: int, max_nodes: list[int],
                  max_depths: list[int]) -> list[int]:
    """Indices of the trees that break an invariant ``CandidateTree.validate`` checks (with that
    tree's ``max_nodes`` and ``max_depth``), checked together in a few array passes: a batch of
    well-formed trees costs no per-tree Python. Call ``validate`` on a reported tree for its error."""
    bad = set()
    shaped = []
    for i, t in enumerate(trees):
        shape = t.tokens.shape  # every array 1-D of one length: its shape (n,)
        if len(shape) != 1 or t.parents.shape != shape or t.depths.shape != shape or t.log_probs.shape != shape \
                or shape[0] > max_nodes[i]:
            bad.add(i)
        elif shape[0]:
            shaped.append(i)
    if shaped:
        tokens, parents, depths, sizes = pad_trees([trees[i] for i in shaped])
        width = tokens.shape[1]
        real = np.arange(width)[None, :] < sizes[:, None]
        idx = np.arange(width)[None, :]
        wrong = ((tokens < 0) | (tokens >= vocab_size) | (parents < -1) | (parents >= idx)) & real
        ok_parents = ~wrong.any(axis=1)
        # Depths: each node's is its parent's claimed depth + 1 (1 below the root). With parents before
        # children, that local check makes every claimed depth the true one, by induction from the root.
        safe = np.where(real & (parents >= 0) & (parents < idx), parents, -1)
        parent_depth = np.take_along_axis(depths, np.maximum(safe, 0), axis=1)
        wrong_depth = ((np.where(safe >= 0, parent_depth + 1, 1) != depths) & real).any(axis=1)
        too_deep = (np.where(real, depths, 0).max(axis=1) > np.array([max_depths[i] for i in shaped]))
        # Siblings distinct: sort each row's (parent, token) keys; equal neighbours among real nodes.
        keys = np.where(real, (parents + 1) * (vocab_size + 1) + tokens, -1 - idx)  # padding: unique negatives
        keys.sort(axis=1)
        dup = (keys[:, 1:] == keys[:, :-1]) & (keys[:, 1:] >= 0)
        failed = ~ok_parents | wrong_depth | too_deep | dup.any(axis=1)
        bad.update(shaped[r] for r in np.nonzero(failed)[0])
    return sorted(bad)


def _depths_from_parents(parents: np.ndarray) -> np.ndarray:
    """Depth of every node of one tree (``depths_of_rows`` of its one row)."""
    return depths_of_rows(parents.reshape(1, -1))[0]


def depths_of_rows(parents: np.ndarray) -> np.ndarray:
    """[S, W] depths of trees given as rows of parent indices (-1: a child of the root): every node's
    ancestor chain walked for every node of every row at once, one step per level. Bounded by W steps,
    so rows that are not trees (cycles, a parent past the row: malformed input) end too, with depths
    that ``validate`` then refuses. A row's entries past a tree's own nodes are never read by them."""
    s, w = parents.shape
    depths = np.ones((s, w), dtype=np.int64)
    if not w:
        return depths
    rows = np.arange(s)[:, None]
    anc = np.where((parents >= 0) & (parents < w), parents, -1)
    for _ in range(w):
        live = anc >= 0
        if not live.any():
            break
        depths += live
        anc = np.where(live, parents[rows, np.maximum(anc, 0)], -1)
        anc = np.where((anc >= 0) & (anc < w), anc, -1)
    return depths


def pad_trees(trees: list[CandidateTree], root_column: bool = False
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The trees as int64 [B, W] arrays (tokens, parents, depths) and their node counts [B]: node i
    of tree b at [b, i], padding 0, -1, 0. ``root_column``: the kernels' layout instead, node i at
    column i + 1 and parents as columns (the root's column 0; the root and padding -1), column 0
    left to the caller. Values cast as a per-row assignment casts them (element by element).

    A slice per tree for a few trees; for more, one concatenate and one scatter per field through
    the mask of real nodes (row-major order lists every tree's nodes in turn): cheaper past ~8."""
    lead = int(root_column)
    sizes = [t.tokens.shape[0] for t in trees]
    shape = (len(trees), lead + max(sizes, default=0))
    # Parents shifted by ``lead`` at the end: padding starts at -1 - lead.
    tokens, parents, depths = (np.zeros(shape, dtype=np.int64), np.full(shape, -1 - lead, dtype=np.int64),
                               np.zeros(shape, dtype=np.int64))
    if len(trees) <= 8:
        for r, (t, n) in enumerate(zip(trees, sizes)):
            cols = slice(lead, lead + n)
            tokens[r, cols], parents[r, cols], depths[r, cols] = t.tokens, t.parents, t.depths
    else:
        real = np.zeros(shape, dtype=bool)
        real[:, lead:] = np.arange(shape[1] - lead)[None, :] < np.array(sizes)[:, None]
        for a, field in ((tokens, "tokens"), (parents, "parents"), (depths, "depths")):
            a[real] = np.concatenate([getattr(t, field) for t in trees], dtype=np.int64, casting="unsafe")
    if lead:
        parents += lead
    return tokens, parents, depths, np.array(sizes, dtype=np.int64)


def ancestor_masks(parents: np.ndarray, num_nodes: np.ndarray, max_depth: int | None = None) -> np.ndarray:
    """bool [B, N+1, N+1] on the host, as ``kernels.tree.tree_mask_ref`` computes it on a device:
    row i sees column j iff j == i, j is the root (slot 0), or j is an ancestor of i; padding
    nodes (index >= num_nodes) see only themselves and the root.

    For validated trees (every parent before its child): every slot of every tree walks up its
    ancestor chain together, one step per level, marking each step's ancestors with one scatter
    into the flat mask; the cost grows with the depth, not the node count. ``max_depth``, when the
    caller knows the trees' deepest node, fixes the step count (else each step checks for the end).
    """
    b, n = parents.shape
    m = n + 1
    real = np.arange(n)[None, :] < np.asarray(num_nodes)[:, None]
    base = np.arange(b)[:, None] * m  # (B, 1): flat index of each tree's root slot
    up = np.repeat(base, m, axis=1)  # (B, N+1): a slot's parent's flat slot; root and padding: the root
    up[:, 1:] += np.where(real, parents + 1, 0)
    up = up.reshape(-1)
    here = np.arange(b * m)  # flat slot (b, i) -> b * m + i; walks up to its ancestors
    rows = (here - np.repeat(base.reshape(-1), m)) + here * (m - 1)  # flat (b, i, 0) = (b m + i) m - b m
    mask = np.zeros(b * m * m, dtype=bool)
    for _ in range(m if max_depth is None else max_depth + 1):  # a chain of N nodes: N + 1 steps
        mask[rows + here] = True  # (b, i, j) for j = the ancestor ``here`` holds (flat j + b m)
        above = up[here]
        if max_depth is None and np.array_equal(above, here):  # every walk sits at its root
            break
        here = above
    mask = mask.reshape(b, m, m)
    mask[:, :, 0] = True
    return mask
