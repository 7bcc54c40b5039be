"""What a sequence's trees accept, by tree size: the estimates adaptive speculation chooses with.

The best m nodes of a tree (by draft score) are themselves the tree of size m and closed under
ancestors, so one verified tree of n nodes shows what every size m <= n would have accepted
(``accepted_within``); ``Acceptance`` keeps a running mean per size, and guesses above the largest
size it has seen.
"""

from __future__ import annotations

import numpy as np

from runtime.tree import CandidateTree


def path_ranks(tree: CandidateTree, accepted: list[int]) -> np.ndarray:
    """The accepted path's nodes (node indices, root excluded, in path order) by their rank in the
    tree, best first, as a running maximum along the path: the tree's best m nodes hold the path's
    first j nodes exactly when entry j - 1 is below m.

    Best = highest cumulative draft log-prob; ties to the shallower, then the earlier node (the
    dynamic builder's order)."""
    n = tree.num_nodes
    order = np.lexsort((np.arange(n), tree.depths, -tree.log_probs))  # last key is the primary one
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    return np.maximum.accumulate(rank[np.asarray(accepted, dtype=np.int64)])


def accepted_within(tree: CandidateTree, accepted: list[int], sizes, levels=None) -> np.ndarray:
    """For each size m: nodes of the accepted path the tree's best min(m, N) nodes hold, i.e. what
    the tree of size m would have accepted (``path_ranks``: a path stops at its first node outside
    the best m); with ``levels`` (each size's levels, ``TreeSettings.capped``), no more than them
    (a lower bound where a size grows fewer levels than this tree: ``EAGLE3_TREE_LEVELS``)."""
    if not accepted:  # (no order needed: 22% of the trees at batch 1 on MT-bench, the shipped head)
        return np.zeros(len(sizes))
    worst = path_ranks(tree, accepted)
    counts = (worst[None, :] < np.minimum(sizes, tree.num_nodes)[:, None]).sum(axis=1).astype(np.float64)
    return counts if levels is None else np.minimum(counts, levels)


class Acceptance:
    """Expected accepted nodes for each tree size, from the trees seen: an exponentially weighted
    mean per size (bias-corrected, so the first tree of a size counts fully; a prior only while no
    tree was seen), for a sequence (``shrink`` > 0) pulled toward the batch's estimate. Above the
    largest size seen, the last gain per node is carried on: acceptance grows concavely with the
    size, so the guess is optimistic, the policy tries a larger tree when the guess says it pays,
    and that tree corrects it. A tree holds every smaller one (the best m nodes), so the curve never
    decreases."""

    def __init__(self, prior: np.ndarray, weight: float, wider: Acceptance | None = None, shrink: float = 0.0):
        self.prior, self.weight = prior, weight
        self.wider = wider  # a sequence's: the global estimate, whose gains carry it above its own sizes
        self.shrink = shrink  # a sequence's: the global estimate weighs as much as this many of its trees
        # Per size, as lists: an update is a few float operations per size, where numpy's cost per call
        # made it 8 us (two updates per verified tree, on the host's critical path).
        self._sum = [0.0] * len(prior)  # EWMA from zero ...
        self._mass = [0.0] * len(prior)  # ... and the weight it has gathered: mean = sum / mass
        self._trees = [0] * len(prior)  # trees seen per size
        self.seen = -1  # index of the largest size seen
        self.updates = 0
        self._curve: tuple | None = None  # (the wider one's updates, curve), until the next update

    def update(self, acc: list[float]) -> None:
        """``acc``: what sizes 0..len(acc)-1 would have accepted in one tree."""
        w, total, mass, trees = self.weight, self._sum, self._mass, self._trees
        for k, a in enumerate(acc):
            total[k] += w * (a - total[k])
            mass[k] += w * (1.0 - mass[k])
            trees[k] += 1
        self.seen = max(self.seen, len(acc) - 1)
        self.updates += 1
        self._curve = None

    def trusted_reach(self, trees: int = 10) -> int:
        """Index of the largest size whose estimate holds at least the weight of ``trees`` trees (-1:
        none). The weight per size never grows with the size: every tree updates a prefix of sizes."""
        floor = 1.0 - (1.0 - self.weight) ** trees
        return sum(m >= floor for m in self._mass) - 1

    def curve(self, sizes, levels: np.ndarray) -> np.ndarray:
        """[len(sizes)] expected accepted nodes, the guess above the largest size seen included."""
        stamp = self.wider.updates if self.wider is not None else 0
        if self._curve is None or self._curve[0] != stamp:
            self._curve = (stamp, self._estimate(np.asarray(sizes, dtype=np.float64), levels))
        return self._curve[1]

    def _estimate(self, s: np.ndarray, levels: np.ndarray) -> np.ndarray:
        top = self.seen
        if top < 0:
            return self.prior.copy()
        v = np.zeros_like(self.prior)
        v[:top + 1] = np.maximum.accumulate(np.array(self._sum[:top + 1]) / np.array(self._mass[:top + 1]))
        wider = self.wider
        if self.shrink and wider is not None:
            # Shrunk toward the batch's estimate, which weighs as much as ``shrink`` of this sequence's
            # trees (a running mean holds about (2 - w) / w trees' worth): one tree that accepted
            # nothing does not say a sequence accepts nothing (MT-bench, batch 1: after three trees
            # that accepted at most one node together, the next accepted 1.67 on average).
            n = np.minimum(np.array(self._trees[:top + 1], dtype=np.float64), (2.0 - self.weight) / self.weight)
            g = wider.curve(s, levels)[:top + 1]
            v[:top + 1] = np.maximum.accumulate((n * v[:top + 1] + self.shrink * g) / (n + self.shrink))
        reach = wider.trusted_reach() if wider is not None else -1
        if reach > top:
            # Sizes the batch's trees reached and this sequence's did not: its own estimate at its
            # largest size plus the gain the global estimate measured from there, up to the largest size
            # it rests on enough trees for (a sequence that only saw small trees would otherwise carry
            # its early, steep gain per node on to the largest tree: at a large batch, where only small
            # trees were tried, that guess started large trees that cost far more than they brought).
            # Above that, the optimistic guess: one unlucky early tree must not stop the exploring.
            g = wider.curve(s, levels)
            v[top + 1:reach + 1] = v[top] + np.maximum(g[top + 1:reach + 1] - g[top], 0.0)
            top = reach
        slope = v[0] / s[0] if top == 0 else (v[top] - v[top - 1]) / (s[top] - s[top - 1])
        v[top + 1:] = np.maximum(v[top] + slope * (s[top + 1:] - s[top]), v[top])
        return np.minimum(v, levels)
