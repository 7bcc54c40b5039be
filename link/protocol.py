"""The boundary between the verify side and the draft side, as typed hand-off objects.

Each step the verify side tells the draft what became final (``DraftFeed``: the target's
features of committed positions, each paired with the token that follows it) and asks for
new candidate trees. In one process the draft is called directly; across services the same
objects travel as gRPC metadata plus shared-buffer offsets.

Alignment (EAGLE-3): draft row i pairs the target feature of position i with token i + 1,
sits at RoPE position i, and predicts token i + 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from common.tree_settings import TreeSettings
from runtime.tree import CandidateTree


@dataclass(frozen=True, slots=True)
class DraftFeed:
    """Committed rows of one sequence: features of positions start.., and the tokens after them."""

    seq_id: int
    start: int  # position of the first feature (= draft row index)
    features: torch.Tensor  # [n, k * target_hidden], on the draft's device
    next_tokens: np.ndarray  # int64 [n]


@dataclass(frozen=True, slots=True)
class ProposeRequest:
    seq_id: int
    max_depth: int  # the tree may not go deeper (end of context or of max_tokens)
    settings: TreeSettings | None = None  # None: the draft's configured tree


class DraftProvider(Protocol):
    capture_layers: tuple[int, ...]  # target layers whose input features the draft consumes

    def step(self, feeds: list[DraftFeed], proposals: list[ProposeRequest]) -> dict[int, CandidateTree]:
        """Extend the draft's cache with ``feeds``, then propose a tree for each request.

        A proposal for a sequence is made from the last row fed for it.
        """

    def release(self, seq_id: int) -> None:
        """Forget a finished or cancelled sequence and free its draft KV."""

    def tree_rejected(self, seq_id: int, reason: str) -> None:
        """The verify side refused this sequence's tree (it decoded one plain token instead)."""
