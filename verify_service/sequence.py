"""One generation request's state inside the verify service."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from common.sampling_params import SamplingParams
from verify_service.detokenizer import StopStringDetokenizer


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, a stop token id, or a stop string
    LENGTH = "length"  # max_tokens, or the context is full
    ABORT = "abort"  # cancelled by the client


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
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        return (self.prompt_ids + self.output_ids)[start:end]

    @property
    def max_kv_len(self) -> int:
        """KV entries this sequence can ever need: the last sampled token is never cached."""
        return len(self.prompt_ids) + self.max_new_tokens - 1
