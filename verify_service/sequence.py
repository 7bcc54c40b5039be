"""One generation request's state inside the verify service."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from common.sampling_params import SamplingParams
from common.tree_settings import TreeSettings
from runtime.tree import CandidateTree
from verify_service.detokenizer import StopStringDetokenizer


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, a stop token id, or a stop string
    LENGTH = "length"  # max_tokens, or the context is full
    ABORT = "abort"  # cancelled by the client


@dataclass
class SpeculationMetrics:
    """Per-request speculation counters. tau = tokens committed per verify step (bonus included)."""

    steps: int = 0  # verification steps that carried a tree
    draft_tokens: int = 0  # tree nodes verified
    accepted_tokens: int = 0  # tree nodes accepted
    rewound_tokens: int = 0  # tree nodes whose target KV was written, then released
    accepted_per_depth: list[int] = field(default_factory=list)  # [d]: steps accepting a node at depth d+1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tau(self) -> float:
        return (self.accepted_tokens + self.steps) / self.steps if self.steps else 0.0

    def record(self, draft_tokens: int, accepted: int) -> None:
        self.steps += 1
        self.draft_tokens += draft_tokens
        self.accepted_tokens += accepted
        self.rewound_tokens += draft_tokens - accepted
        while len(self.accepted_per_depth) < accepted:
            self.accepted_per_depth.append(0)
        for d in range(accepted):
            self.accepted_per_depth[d] += 1

    def merge(self, other: SpeculationMetrics) -> None:
        """Add ``other``'s counters to these (totals over many requests)."""
        self.steps += other.steps
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        self.rewound_tokens += other.rewound_tokens
        self.accepted_per_depth.extend([0] * (len(other.accepted_per_depth) - len(self.accepted_per_depth)))
        for d, n in enumerate(other.accepted_per_depth):
            self.accepted_per_depth[d] += n


@dataclass(eq=False)
class Sequence:
    """Token ids and KV progress of one request.

    ``num_cached`` counts the KV entries written; every id before it is in the cache. While
    decoding, the newest sampled token is the one id not yet cached.
    """

    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    max_new_tokens: int  # max_tokens clipped to what the context still holds
    detokenizer: StopStringDetokenizer | None = None
    output_ids: list[int] = field(default_factory=list)
    num_cached: int = 0
    finish_reason: FinishReason | None = None
    speculate: bool = False  # a draft proposes trees for this sequence
    detached: bool = False  # asked to speculate, started where trees did not pay: runs without the draft
    catch_up: bool = False  # taking the draft up again: its next step recomputes every position for it
    tree_settings: TreeSettings | None = None  # the shape of its trees
    tree: CandidateTree | None = None  # proposed for the next step, below the newest token
    speculation: SpeculationMetrics = field(default_factory=SpeculationMetrics)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilling(self) -> bool:
        return self.num_cached < len(self.prompt_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``start:end`` of prompt + output, in O(end - start): asked for every sequence every
        step, it must not copy a long context."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n:end - n]
        return self.prompt_ids[start:] + self.output_ids[:end - n]

    @property
    def max_kv_len(self) -> int:
        """KV entries this sequence can ever need: the last sampled token is never cached."""
        return len(self.prompt_ids) + self.max_new_tokens - 1
