"""The boundary between the verify side and the draft side, as typed hand-off objects.

Each step the verify side tells the draft what became final (``DraftFeed``: the target's
features of committed positions, each paired with the token that follows it) and asks for
new candidate trees. In one process the draft is called directly; across services one step
is a ``StepCall`` (metadata and offsets into the shared buffers) answered by a ``StepReply``,
on the Session stream (link/convert.py) or the unix step socket (link/step_frames.py), where a
step of trees alone may also be a ``ChainCall`` answered by a ``ChainReply`` (its rows and
trees stay on the device: verify_service/draft_link.py).

Alignment (EAGLE-3): draft row i pairs the target feature of position i with token i + 1,
sits at RoPE position i, and predicts token i + 2.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
    # Optional, False when absent: True only for a provider in this process whose trees are valid by
    # construction (the verify side then skips its structural checks of them).
    trusted_trees: bool
    # Optional too: ``step_on_device`` and ``settle`` (``EagleDrafter``; ``RemoteDraft`` across the link,
    # with ``chainable``), a provider that takes a step's feeds still on the device, chained behind
    # acceptance (``DraftCoordinator.chains``); the draft service also reads its ``rows`` (committed
    # rows per sequence) to check a chained step's starts.

    def step(self, feeds: list[DraftFeed], proposals: list[ProposeRequest]) -> dict[int, CandidateTree]:
        """Extend the draft's cache with ``feeds``, then propose a tree for each request.

        A proposal for a sequence is made from the last row fed for it.
        """

    def release(self, seq_id: int) -> None:
        """Forget a finished or cancelled sequence and free its draft KV."""

    def tree_rejected(self, seq_id: int, reason: str) -> None:
        """The verify side refused this sequence's tree (it decoded one plain token instead)."""


@dataclass(frozen=True, slots=True)
class FeedRows:
    """``DraftFeed`` across processes: its features are rows buffer_row .. buffer_row + n - 1 of
    the shared features buffer (n = len(next_tokens))."""

    seq_id: int
    start: int
    buffer_row: int
    next_tokens: np.ndarray  # int64 [n]


@dataclass(frozen=True, slots=True)
class StepCall:
    """One step, verify -> draft. ``proposals[i]``'s tree goes to slot i of the tree buffers."""

    step_id: int
    feeds: list[FeedRows]
    proposals: list[ProposeRequest]
    finished: list[int]  # sequences whose draft state to free
    rejections: list[tuple[int, str]]  # (seq_id, reason): trees the verify side refused, earlier steps
    # (seq_id, rows): the committed rows of sequences an earlier chained step fed, known on the host
    # since (the draft's ``settle``); applied before anything else in the step.
    settled: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ChainedSeq:
    """One sequence of a chained step: its committed rows ``start`` (the draft's rows so far), and at
    most ``most`` rows fed this step (its tree's nodes + 1)."""

    seq_id: int
    start: int
    most: int


@dataclass(frozen=True, slots=True)
class ChainCall:
    """A chained step, verify -> draft (step socket only): sequence i's fed rows are on the device,
    ``chain_feeds[i, 0]`` of them (at most ``width``), its features in rows ``i * width ..`` of the
    features buffer and the tokens that follow them in ``chain_feeds[i, 1:1 + width]``; a full-depth
    tree of ``settings`` is asked for each, written to ``chain_trees[:, i]``."""

    step_id: int
    seqs: list[ChainedSeq]
    width: int
    settings: TreeSettings
    finished: list[int]
    rejections: list[tuple[int, str]]
    settled: list[tuple[int, int]]


@dataclass(frozen=True, slots=True)
class ChainReply:
    """The draft queued chained step ``step_id``'s work (not done: the verify side's stream waits for
    it): ``num_trees`` trees of ``num_nodes`` nodes each in ``chain_trees``. ``draft_compute_ns``: the
    draft's host time on the step."""

    step_id: int
    num_trees: int
    num_nodes: int
    draft_compute_ns: int


@dataclass(frozen=True, slots=True)
class TreeRef:
    """A tree the draft wrote: tree buffers [tree_slot, :num_nodes]."""

    seq_id: int
    tree_slot: int
    num_nodes: int


@dataclass(frozen=True, slots=True)
class StepReply:
    """The draft's answer to ``StepCall`` step_id; ``draft_compute_ns`` is its own time on the step."""

    step_id: int
    trees: list[TreeRef]
    draft_compute_ns: int
