"""Costs adaptive speculation learns as steps run, per power-of-two batch bucket: how a cost seen at
one bucket is read at another, and the draft call's cost against its tree levels.
"""

from __future__ import annotations

import math

import numpy as np


def batch_bucket(batch: int) -> int:
    """Learned costs are kept per power-of-two batch bucket."""
    return 1 << max(0, int(batch) - 1).bit_length()


def nearest_bucket(buckets, bucket: int) -> tuple[int, float] | None:
    """The learned bucket to read a cost at ``bucket`` from, and the factor to scale it by: itself
    (1), else the nearest seen one, scaled up with the square root of the batch when ``bucket`` is
    larger (a cost that grows with the sequences: taken flat, a larger batch would look as cheap as
    a smaller one and start a tree it cannot afford; but not in proportion: measured on an H100,
    the draft's call 1.0-1.4 ms at batch 1, 1.4-1.6 at 4, 2.0 at 16, 3.0 at 64, and scaled in
    proportion batch 1's costs priced batch 4's first tree out for good); None when none was seen."""
    if bucket in buckets:
        return bucket, 1.0
    if not buckets:
        return None
    near = min(buckets, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), -b))
    return near, math.sqrt(bucket / near) if bucket > near else 1.0


def learned_at(by_bucket: dict[int, float], bucket: int, scaled: bool = True) -> float | None:
    """A cost learned per batch bucket, at ``bucket`` (``_nearest``; a negative one is not scaled, nor
    any when not ``scaled``)."""
    near = nearest_bucket(by_bucket, bucket)
    if near is None:
        return None
    value = by_bucket[near[0]]
    return value * near[1] if value > 0 and scaled else value


class DraftCost:
    """A draft call's milliseconds against its levels: fixed + per_level x levels, from exponentially
    weighted means of the observations (levels, ms) and their products (the first observation
    counts fully)."""

    def __init__(self, weight: float):
        self.weight = weight
        self._means: np.ndarray | None = None  # E[L], E[ms], E[L^2], E[L ms]
        self._fitted: tuple[float, tuple[float, float]] | None = None  # (prior, fit) since the last update

    def update(self, levels: float, ms: float) -> None:
        x = np.array([levels, ms, levels * levels, levels * ms])
        self._means = x if self._means is None else self._means + self.weight * (x - self._means)
        self._fitted = None

    def fit(self, prior_per_level: float) -> tuple[float, float]:
        """(fixed, per_level): the least-squares line where the levels seen differ, else the prior's
        slope through the mean; neither part negative. (Memoised: a decision asks it once per size.)"""
        if self._fitted is not None and self._fitted[0] == prior_per_level:
            return self._fitted[1]
        level, ms, level_sq, level_ms = self._means.tolist()
        var = level_sq - level * level
        per_level = (level_ms - level * ms) / var if var > 0.25 else prior_per_level
        per_level = min(max(per_level, 0.0), ms / level)  # a fixed part of zero at most: all per level
        self._fitted = (prior_per_level, (ms - per_level * level, per_level))
        return self._fitted[1]

    def predict(self, levels: float, prior_per_level: float) -> float:
        fixed, per_level = self.fit(prior_per_level)
        return fixed + per_level * levels
