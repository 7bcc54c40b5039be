"""Target-only generation: the step loop, stop conditions and the Python API.

    gen = TargetGenerator(engine)
    results = gen.generate([ids_a, ids_b], SamplingParams(max_tokens=64))
    for event in gen.stream(ids, params): print(event.text, end="")
"""

from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass
from typing import Iterator

from common.errors import InvalidRequestError
from common.sampling_params import SamplingParams
from verify_service.detokenizer import StopStringDetokenizer
from verify_service.engine import TargetEngine
from verify_service.model_runner import SeqChunk
from verify_service.sampler import Sampler
from verify_service.scheduler import Scheduler
from verify_service.sequence import FinishReason, Sequence


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """New committed tokens of one sequence (and their final text, when a tokenizer exists)."""

    seq_id: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None


@dataclass(frozen=True, slots=True)
class GenerationResult:
    seq_id: int
    prompt_tokens: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason


class TargetGenerator:
    def __init__(self, engine: TargetEngine):
        self.engine = engine
        self.scheduler = Scheduler(engine.blocks, engine.cfg.max_num_seqs, engine.cfg.max_batch_tokens)
        self.sampler = Sampler(engine.runner.kernels, engine.device)
        self._ids = itertools.count()
        self.sequences: dict[int, Sequence] = {}

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Validate and queue a request; returns its sequence id."""
        eng = self.engine
        eng.validate_prompt(prompt_ids)
        vocab = eng.model_config.vocab_size
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", f"ids must be in [0, {vocab})")
        if params.stop and eng.tokenizer is None:
            raise InvalidRequestError("stop", "stop strings need a tokenizer; this model has none")
        detok = StopStringDetokenizer(eng.tokenizer, prompt_ids, params.stop) if eng.tokenizer else None
        seq = Sequence(next(self._ids), list(prompt_ids), params,
                       seed=params.seed if params.seed is not None else secrets.randbits(63),
                       max_new_tokens=min(params.max_tokens, eng.max_model_len - len(prompt_ids)),
                       detokenizer=detok)
        self.scheduler.add(seq)
        self.sequences[seq.seq_id] = seq
        return seq.seq_id

    def abort(self, seq_id: int) -> None:
        """Cancel a request; its KV blocks are freed at once."""
        seq = self.sequences.pop(seq_id, None)
        if seq is not None:
            seq.finish_reason = seq.finish_reason or FinishReason.ABORT
            self.scheduler.release(seq)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[TokenEvent]:
        """Run one batched forward; returns the tokens committed by it."""
        plan = self.scheduler.schedule()
        if not plan:
            return []
        chunks = [self._chunk(seq, n) for seq, n in plan]
        out = self.engine.runner.step(chunks)
        for seq, n in plan:
            seq.num_cached += n
        sampled = [seq for seq, n in plan if not seq.prefilling]
        tokens = self.sampler(out.logits, sampled) if sampled else []
        return [self._commit(seq, tok) for seq, tok in zip(sampled, tokens)]

    def _chunk(self, seq: Sequence, n: int) -> SeqChunk:
        start = seq.num_cached
        completes = start + n >= seq.num_tokens  # logits only where a token is drawn next
        return SeqChunk(seq.token_slice(start, start + n), start, self.engine.blocks.block_table(seq.seq_id),
                        logits_rows=(n - 1,) if completes else ())

    def _commit(self, seq: Sequence, token: int) -> TokenEvent:
        seq.output_ids.append(token)
        text = seq.detokenizer.add_tokens([token]) if seq.detokenizer else ""
        seq.finish_reason = self._finish_reason(seq, token)
        if seq.finished:
            text += seq.detokenizer.finish() if seq.detokenizer else ""
            self.scheduler.release(seq)
            self.sequences.pop(seq.seq_id, None)
        return TokenEvent(seq.seq_id, [token], text, seq.finish_reason)

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        eos = () if p.ignore_eos else self.engine.model_config.eos_token_ids
        if token in p.stop_token_ids or token in eos or (seq.detokenizer and seq.detokenizer.stopped):
            return FinishReason.STOP
        if len(seq.output_ids) >= seq.max_new_tokens:
            return FinishReason.LENGTH
        return None

    def run_until_done(self) -> Iterator[TokenEvent]:
        while self.has_work:
            yield from self.step()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[GenerationResult]:
        """Generate for a batch of prompts (token ids) together; results in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        toks = {i: [] for i in ids}
        texts = {i: [] for i in ids}
        reasons = {}
        for ev in self.run_until_done():
            toks[ev.seq_id] += ev.token_ids
            texts[ev.seq_id].append(ev.text)
            if ev.finish_reason is not None:
                reasons[ev.seq_id] = ev.finish_reason
        return [GenerationResult(i, len(p), toks[i], "".join(texts[i]), reasons[i]) for i, p in zip(ids, prompts)]

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[TokenEvent]:
        """Generate for one prompt alone, yielding each committed token as it comes."""
        seq_id = self.add_request(prompt_ids, params)
        try:
            for ev in self.run_until_done():
                if ev.seq_id == seq_id:
                    yield ev
        finally:
            self.abort(seq_id)
