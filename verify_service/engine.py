"""The engine: the step loop, stop conditions and the Python API, with or without a draft.

    engine = Engine(target)                       # target only, one token per step
    engine = Engine(target, drafter, limits)      # EAGLE-3: verify a candidate tree per step
    engine = Engine(target, drafter, limits, AdaptivePolicy(table, limits))   # tree size chosen per step
    results = engine.generate([ids_a, ids_b], SamplingParams(max_tokens=64))
    for event in engine.stream(ids, params): print(event.text, end="")

Each step runs one batched target forward over prefill chunks, plain decodes and candidate
trees together; then commits tokens (stop checks per token), feeds the draft what became
final and asks it for the next trees (``draft_coordinator.py``). With an adaptive policy
(``adaptive.py``) the trees' size, or plain decoding, is chosen per step; the draft is then called
only when trees are wanted.
"""

from __future__ import annotations

import itertools
import secrets
import time
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from common.errors import InvalidRequestError
from common.sampling_params import SamplingParams
from common.tree_settings import TreeSettings
from link.protocol import DraftFeed, DraftProvider
from kernels.host_copy import take_rows, to_device
from runtime.step_layout import Readback, SeqChunk
from verify_service.adaptive import AdaptivePolicy
from verify_service.detokenizer import StopStringDetokenizer
from verify_service.draft_coordinator import DraftCoordinator
from verify_service.feed_buffer import FeedBuffer, StepRows
from verify_service.model_runner import StepOutput
from verify_service.replay import AcceptanceReplay
from verify_service.sampler import Sampler
from verify_service.scheduler import Scheduler
from verify_service.sequence import FinishReason, Sequence, SpeculationMetrics
from verify_service.target import Target
from verify_service.verification import TreeVerifier, padded_trees, tree_chunks

@dataclass(slots=True)
class TokenEvent:
    """New committed tokens of one sequence (and their final text, when a tokenizer exists). Not
    frozen: a step makes one per sequence, and a frozen dataclass's construction costs 1.6 us against
    0.3 (0.17 ms a step at batch 128, the host being that step's critical path); treat it as read-only."""

    seq_id: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    speculation: SpeculationMetrics | None = None  # with the final event of a speculative request


@dataclass(frozen=True, slots=True)
class GenerationResult:
    seq_id: int
    prompt_tokens: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    speculation: SpeculationMetrics | None = None


# Where no request uses the draft (every one started without it), one plain step in this many tells
# the policy its cost and rate (~7 us of a host-bound step at batch 128 each; the steps are alike).
PLAIN_COST_SAMPLE = 8
_PLACEHOLDER = np.zeros(1, dtype=np.int64)  # a decode chunk's token, written on the device instead
_ROW0 = (0,)  # its logits row


class Engine:
    def __init__(self, target: Target, drafter: DraftProvider | None = None, limits: TreeSettings | None = None,
                 policy: AdaptivePolicy | None = None, replay: AcceptanceReplay | None = None):
        """``limits``: with a drafter, the default tree and the most a request may ask for. ``policy``:
        picks each step's tree size (None: always the requests' own trees). ``replay``: BENCHMARKS
        ONLY, acceptance from a recorded trace instead of the target's choice (``replay.py``)."""
        assert (drafter is None) == (limits is None), "a drafter needs tree limits"
        self.target = target
        self._eos = target.model_config.eos_token_ids
        self.drafter, self.limits, self.policy = drafter, limits, policy
        if drafter is not None:
            target.runner.set_capture_layers(drafter.capture_layers)
        extra = limits.tree_kv_slots if limits else 0
        self.scheduler = Scheduler(target.blocks, target.cfg.max_num_seqs, target.cfg.max_batch_tokens, extra)
        self.sampler = Sampler(target.runner.kernels, target.device)
        self.verifier = TreeVerifier(target, self.sampler, replay)
        self._ids = itertools.count()
        self.sequences: dict[int, Sequence] = {}
        cfg = target.cfg
        self.speculation = None if drafter is None else DraftCoordinator(
            drafter, policy, self.scheduler, self.sequences, target.model_config.vocab_size,
            target.max_model_len, limits.feature_rows(cfg.max_batch_tokens, cfg.max_num_seqs),
            len(drafter.capture_layers) * target.model_config.hidden_size * target.dtype.itemsize)
        self.last_step_verified_trees = False
        self.released_speculation = SpeculationMetrics()  # totals over finished and aborted sequences
        self._readback = Readback(target.device)  # a chained step's acceptance, read while the draft runs
        self._chained = None  # the trees the draft grows behind the last step's acceptance (``attach_trees``)
        self.steps_ahead = 0  # steps verified from the chained trees on the device (``_verify_ahead``)
        # Plain decoding (target-only; with a draft attached, plain steps a policy chooses, or any step
        # while no live request uses the draft): the next decode step is launched before this one's
        # tokens reach the host (``_launch_decode``), its token ids taken from the sampled ones on the
        # device (``DraftCoordinator.plain_ahead`` says when, with a draft).
        self.decode_ahead = True
        self._ahead_decode = None  # (plan, first logits rows, output, None, 0) of the step so launched
        self.decode_steps_ahead = 0
        self._unused_steps = 0  # plain steps where no request used the draft (``PLAIN_COST_SAMPLE``)

    def add_request(self, prompt_ids: list[int], params: SamplingParams, speculate: bool = True,
                    tree: TreeSettings | None = None) -> int:
        """Validate and queue a request; returns its sequence id.

        ``tree``: this request's tree shape (within the configured limits); default: the config's.
        """
        eng = self.target
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
                       detokenizer=detok, speculate=speculate and self.drafter is not None,
                       tree_settings=tree or self.limits)
        self.scheduler.add(seq)
        self.sequences[seq.seq_id] = seq
        if self.speculation is not None:
            self.speculation.admit(seq)
        return seq.seq_id

    def abort(self, seq_id: int) -> None:
        """Cancel a request; its KV blocks (target and draft) are freed at once."""
        seq = self.sequences.pop(seq_id, None)
        if seq is not None:
            seq.finish_reason = seq.finish_reason or FinishReason.ABORT
            self._release(seq)

    def _release(self, seq: Sequence) -> None:
        self.released_speculation.merge(seq.speculation)
        self.scheduler.release(seq)
        if self.speculation is not None:
            self.speculation.release(seq)

    @property
    def feed_buffer(self) -> FeedBuffer | None:
        return self.speculation.feed_buffer if self.speculation else None

    @property
    def draft_errors(self) -> int:
        """Invalid trees refused (each fell back to one plain step)."""
        return self.speculation.draft_errors if self.speculation else 0

    def speculation_totals(self) -> SpeculationMetrics:
        """Speculation counters over every request since start: released ones and those in flight."""
        total = SpeculationMetrics()
        for m in (self.released_speculation, *(seq.speculation for seq in self.sequences.values())):
            total.merge(m)
        return total

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def attach_trees(self) -> None:
        """Give the sequences the trees the draft grew behind the last step's acceptance (waiting for
        what is left of their copy). The next step does it anyway; until then a chained step's
        sequences show no tree. The next step may still verify them from the device."""
        if self._chained is not None:
            self.speculation.attach(self._chained.collect())

    def step(self) -> list[TokenEvent]:
        """Run one batched forward; returns the tokens committed by it."""
        t0 = time.perf_counter()
        chained, self._chained = self._chained, None
        from_chain = chained is not None  # the draft's device time for this step's trees is in the step
        launched_ahead = self._ahead_decode is not None  # a plain step as plain stretches run them
        plan, ahead, deferred = None, None, None
        if self._ahead_decode is not None:  # launched by the last step: its sequences that finished since are skipped
            plan, *ahead = self._ahead_decode
            self._ahead_decode = None
        elif chained is not None:
            # The last step's draft grew these trees behind its acceptance: verified straight from
            # the device where the step holds them alone (their host copies are attached once this
            # step's acceptance and next draft are queued), else laid out once they reach the host.
            plan, ahead = self._verify_ahead(chained)
            if ahead is None:
                self.speculation.attach(chained.collect())
            else:
                deferred = chained
        catch_up = 0  # positions recomputed this step for requests taking the draft up again
        if ahead is None:
            detacher = self.speculation.detacher if self.speculation else None
            if detacher is not None:
                catch_up = detacher.reattach(self.target.cfg.max_batch_tokens // 4)
            plan = self.scheduler.schedule(lambda s: 1 + s.tree.num_nodes if s.tree else 1, catch_up)
            if detacher is not None and self.speculation.speculating:  # (none: no request to start with it)
                detacher.starting(plan)
        if not plan:
            return []
        # What the policy learns from: a step of decodes and trees only, and its trees' size.
        decode_only = not any(s.prefilling for s, _ in plan)
        # (trees verified from the device reach the host after the step: their size is the chain's)
        tree_nodes = ahead[3] if ahead is not None and deferred is not None else \
            max((s.tree.num_nodes for s, _ in plan if s.tree), default=0)
        with_tree = [s for s, _ in plan if s.tree]
        on_device = None  # the trees the step verified from the device, in plan order
        if ahead is None:
            padded = padded_trees(with_tree) if with_tree else None  # for the layout and the acceptance
            chunks = self._chunks(plan, with_tree, padded)
            # (no sequence that feeds the draft: no features kept, as target-only decoding keeps none)
            out = self.target.runner.step(chunks, capture=self._feeds_draft(s for s, _ in plan), eager=catch_up > 0)
            logits_at = np.concatenate(([0], np.cumsum([len(c.logits_rows) for c in chunks])))
        else:
            padded, (logits_at, out, on_device, _) = None, ahead
        if self.policy is not None and (deferred is not None or len(with_tree) == len(plan)):
            # A step of trees alone: the policy's choice for the next step while the device runs this one.
            self.speculation.choose_ahead([s for s, _ in plan])
        plain, trees = [], []
        for i, (seq, n) in enumerate(plan):
            if seq.seq_id in self.sequences:  # (a step launched ahead may hold sequences finished since)
                (trees if seq.tree or deferred is not None else plain).append((i, seq, n))
        feeds: dict[int, DraftFeed] = {}  # the verified trees' rows, per sequence
        # the plain chunks' rows, together (none where no request uses the draft: ``speculating``)
        rows = StepRows() if self.speculation is not None and self.speculation.speculating else None
        self.last_step_verified_trees = bool(trees)
        due, cached = self._advance_plain(plain, rows)
        # Device work for every sequence first (sampling, acceptance, compaction), then the
        # step's ONE device-to-host copy: the plain tokens and what acceptance chose, together.
        first_rows = logits_at.tolist()  # (per-element numpy indexing and starred unpacking cost a step at
        # batch 128 ~40 us of host time, the host being that step's critical path)
        sampled = None
        if due:
            at = [first_rows[d[0]] for d in due]  # (increasing: the plan's chunks in order, each with a row)
            sampled = self.sampler.sample(take_rows(out.logits, at, increasing=True), [d[1] for d in due],
                                          None if out.greedy is None else take_rows(out.greedy, at, increasing=True))
        # A sequence of the plan finished since, or a replayed acceptance (it reads the trees' host
        # copies): the host layout.
        if len(trees) < len(plan) or self.verifier.replay is not None:
            on_device = deferred = self._attach(deferred)
        pending = self.verifier.accept([seq for _, seq, _ in trees], [first_rows[i] for i, _, _ in trees],
                                       [out.query_start_loc[i] for i, _, _ in trees], out, padded,
                                       on_device) if trees else None
        parts = [t for t in (sampled, pending.device_values() if pending else None) if t is not None]
        chained = None
        if pending and not plain and self.speculation.chains(pending.seqs):
            # A step of trees alone queues the draft's extend and next trees behind acceptance on the
            # device, then waits for acceptance alone: the host commits while the draft runs, and
            # the next step collects the trees once it has queued their verification and acceptance.
            ticket = self._readback.start(parts[0])
            if deferred is not None and not deferred.outlives_next_draft:  # its copy's buffer is the next draft's
                deferred = self._attach(deferred)
            chained = self.speculation.draft_on_device(pending)
            deferred = self._attach(deferred)
            host = self._readback.wait(ticket).tolist()
        elif sampled is not None and not trees and len(due) == len(plain) and (going := self._decode_ahead(due)):
            # The copy of this step's tokens goes first: the next step, queued behind it, is not waited for.
            ticket = self._readback.start(sampled)
            every = len(going) == len(due)
            self._ahead_decode = self._launch_decode(due if every else [due[j] for j in going],
                                                     sampled if every else take_rows(sampled, going, increasing=True))
            host = self._readback.wait(ticket).tolist()
        else:
            deferred = self._attach(deferred)
            host = (torch.cat(parts) if len(parts) > 1 else parts[0]).tolist() if parts else []
        events = self._commit_decodes(due, host, rows)
        if pending:
            self._commit_trees(pending, host[len(due):], chained is not None, feeds, events)
        self._chained = chained
        draft_s = 0.0
        if self.speculation and chained is None:
            fed = rows.build(out.captured, out.query_start_loc) if rows is not None else None
            prompt_rows = sum(len(t) for *_, t in rows.chunked) if rows is not None else 0
            draft_s = self.speculation.draft(feeds, fed, prompt_rows)
        if self.policy is not None and decode_only:
            steps = 1
            if not tree_nodes and not self.speculation.speculating:  # no request uses the draft: one step in
                self._unused_steps += 1                                # PLAIN_COST_SAMPLE tells, for them all
                steps = 0 if self._unused_steps % PLAIN_COST_SAMPLE else PLAIN_COST_SAMPLE
            if steps:
                self._observe(plan, cached if len(plain) == len(plan) else None, events, bool(trees), tree_nodes,
                              (time.perf_counter() - t0 - draft_s) * 1e3, draft_s * 1e3, launched_ahead, from_chain,
                              steps)
        return events

    def _commit_decodes(self, due, host: list[int], rows: StepRows | None) -> list[TokenEvent]:
        """Commit each due sequence's sampled token (``host``, in ``due`` order); returns the events. The
        draft's rows of those that speculate and go on go into ``rows`` (a finished sequence's are not
        sent): a prefill's last chunk, each position before the token after it, the last one before
        the sampled token."""
        events, commit = [], self._commit
        one = rows.ones.append if rows is not None else None
        for (i, seq, start, n), token in zip(due, host):
            events.append(commit(seq, [token]))
            if seq.speculate and seq.finish_reason is None:
                if n == 1:
                    one((i, seq.seq_id, start, token))
                else:
                    rows.add(i, seq.seq_id, start, seq.token_slice(start + 1, start + n) + [token])
        return events

    def _commit_trees(self, pending, host: list[int], chained: bool, feeds: dict[int, DraftFeed],
                      events: list[TokenEvent]) -> None:
        """Commit what acceptance chose (``host``: its values); the draft's feeds of the verified trees
        (none where the step ``chained`` the draft: fed on the device, its committed rows settled)."""
        verified = self.verifier.finish(pending, host)
        if chained:
            self.speculation.settle(verified)
        for v in verified:
            self.speculation.observe(v)
            if not chained:
                feeds[v.seq.seq_id] = v.feed
            events.append(self._commit(v.seq, v.tokens))

    def _observe(self, plan, cached: int | None, events: list[TokenEvent], trees: bool, tree_nodes: int, ms: float,
                 draft_ms: float, launched_ahead: bool, from_chain: bool, steps: int) -> None:
        """What a step of decodes and trees only (no prefill) tells the policy: its tokens against its
        time (``ms``, the draft call's ``draft_ms`` apart), and its cost by kind. ``cached``: the plan's
        cached positions summed, where the step counted them (None: counted here). ``steps``: the steps
        it stands for (a sampled plain step stands for those skipped: the policy's clock counts them)."""
        committed = sum(len(e.token_ids) for e in events) if trees else len(events)  # (plain: one each)
        self.policy.observe_realized(len(plan), committed, ms, draft_ms, trees, steps)
        if tree_nodes or launched_ahead and not self.policy.last_held:
            # Plain steps are measured when they were launched ahead (as a plain stretch runs them: the
            # first one after trees waits for its tokens, and one after a chained draft whose trees the
            # sequences' limits cut holds that draft's time) and the policy looks (a few per hold).
            context = (cached if cached is not None else sum(s.num_cached for s, _ in plan)) / len(plan)
            self.policy.observe_step(len(plan), tree_nodes, context, ms, chained=from_chain)

    def _attach(self, deferred) -> None:
        """Give the sequences the trees of ``deferred`` (chained trees the step verified from the
        device), once they reach the host; returns None (what the caller holds then)."""
        if deferred is not None:
            self.speculation.attach(deferred.collect(), whole=True)

    def _decode_ahead(self, due) -> list[int]:
        """Which of ``due`` (positions in it, increasing) the next step, launched now before this decode
        step's tokens are read, decodes: each sequence that this step's token does not bring to its
        length limit (the next step's KV stays within what it reserved; one that its token finishes
        otherwise, at a stop token, computes one row for nothing). None (an empty list) unless every
        sequence decodes one token, no request waits to start, and the next step decodes plainly too
        (no draft, or the policy chooses plain decoding: ``plain_ahead``, last, as it takes the
        policy's decision)."""
        if not self.decode_ahead or self.scheduler.waiting:
            return []
        going = []  # (one pass: at batch 128 the host bounds the step)
        for j, (_, seq, _, n) in enumerate(due):
            if n != 1:
                return []
            if len(seq.output_ids) + 1 < seq.max_new_tokens:
                going.append(j)
        spec = self.speculation
        if not going or spec is not None and (spec.detacher and spec.detacher.due() or not spec.plain_ahead(
                [due[j][1] for j in going] if spec.speculating else [])):
            return []
        return going

    def _feeds_draft(self, seqs) -> bool:
        """Whether any of ``seqs`` (an iterable, read only when some request uses the draft) feeds the
        draft: the step then keeps the target's captured features."""
        return self.speculation is not None and self.speculation.speculating > 0 and any(s.speculate for s in seqs)

    def _launch_decode(self, due, sampled: torch.Tensor) -> tuple:
        """The next decode step of ``due``'s sequences, queued now: each sequence's token sampled this
        step (still on the device) at its next KV index. A sequence this step's token finishes
        computes one row for nothing; the step that takes this one skips it."""
        ensure = self.target.blocks.ensure_capacity  # (returns the table)
        plan, chunks = [], []
        for _, seq, _, _ in due:
            plan.append((seq, 1))
            chunks.append(SeqChunk(_PLACEHOLDER, seq.num_cached, ensure(seq.seq_id, seq.num_cached + 1), _ROW0))
        self.decode_steps_ahead += 1
        out = self.target.runner.step(chunks, ids=sampled, capture=self._feeds_draft(seq for _, seq, _, _ in due))
        return plan, np.arange(len(chunks) + 1), out, None, 0  # (one logits row each; no tree)

    def _verify_ahead(self, chained) -> tuple[list, tuple[np.ndarray, StepOutput, torch.Tensor] | None]:
        """Schedule the step and, when it is the chained trees' sequences (those of them still running,
        none waiting to start, none whose context cuts its tree), launch their verification from the
        trees on the device, before their copy reaches the host: the trees of sequences that finished
        since are left out on the device (at batch 64 a sequence finishes every few steps; each one
        sent the whole batch down the host's layout). The step's layout goes to the device before the
        trees are asked for: through the link, while the draft service answers. Returns the plan and
        (each sequence's first logits row and the end, the output, its trees on the device, their nodes), or
        (None, None) for the usual path."""
        n = chained.nodes_hint
        if n is None:  # the first of its shape through the link: the answer says
            trees = chained.on_device
            n = None if trees is None else trees.shape[2]
        if n is None or not self.target.runner.cuda_graphs or not self.speculation.trees_fit(chained.seq_ids):
            return None, None
        ids = set(chained.seq_ids)
        plan = self.scheduler.schedule(lambda s: n + 1 if s.seq_id in ids else 1 + s.tree.num_nodes if s.tree else 1)
        seqs = [s for s, _ in plan]
        if len(seqs) == len(chained.seq_ids):
            if [s.seq_id for s in seqs] != chained.seq_ids:
                return None, None
            keep = None
        else:  # finished ones left out (their rows on the device: not read)
            at = {i: j for j, i in enumerate(chained.seq_ids)}
            keep = [at.get(s.seq_id, -1) for s in seqs]
            if not seqs or min(keep) < 0:
                return None, None
        if any(s.prefilling for s in seqs):
            return None, None
        # Each sequence's root (its newest token) at its KV index, the nodes' rows come from the device:
        # laid out for the whole batch at once (``fill_roots``).
        table = self.target.blocks.block_table
        starts = np.fromiter((s.num_cached for s in seqs), dtype=np.int64, count=len(seqs))
        roots = np.fromiter((s.output_ids[-1] for s in seqs), dtype=np.int64, count=len(seqs))
        picked = []

        def trees() -> torch.Tensor | None:
            t = chained.on_device
            if t is not None and keep is not None:
                t = t.index_select(1, to_device(np.asarray(keep, dtype=np.int64), torch.int64, t.device))
            picked.append(t)
            return t

        out = self.target.runner.step_trees_on_device(starts, roots, [table(s.seq_id) for s in seqs], n, trees)
        if out is None:
            return None, None
        self.steps_ahead += 1
        return plan, (np.arange(len(seqs) + 1) * (n + 1), out, picked[0], n)

    def _chunks(self, plan: list[tuple[Sequence, int]], with_tree: list[Sequence], padded) -> list[SeqChunk]:
        """The step's inputs in plan order: tree chunks (``with_tree``, the plan's sequences with a
        tree, built together from their ``padded`` arrays) and plain chunks."""
        tables = self.target.blocks.block_table
        trees = iter(tree_chunks(with_tree, [tables(s.seq_id) for s in with_tree], padded) if with_tree else ())
        return [next(trees) if s.tree else self._chunk(s, n) for s, n in plan]

    def _chunk(self, seq: Sequence, n: int) -> SeqChunk:
        start = seq.num_cached
        if seq.catch_up:  # every position again, for the draft's features; only the newest token's KV is written
            return SeqChunk(seq.token_slice(0, start + 1), 0, self.target.blocks.block_table(seq.seq_id),
                            logits_rows=(start,), write_from=start)
        completes = start + n >= seq.num_tokens  # logits only where a token is drawn next
        return SeqChunk(seq.token_slice(start, start + n), start, self.target.blocks.block_table(seq.seq_id),
                        logits_rows=(n - 1,) if completes else ())

    def _advance_plain(self, plain, rows: StepRows | None) -> tuple[list[tuple[int, Sequence, int, int]], int]:
        """Prefill chunks and one-token decodes ran: advance their caches; returns those that draw a
        token now, and the positions now cached summed (what the policy's context is; counted here,
        where a plain step visits each sequence anyway). A chunk that leaves more of the prompt gives
        the draft its rows at once (into ``rows``): the token after its last position is the prompt's next."""
        due, cached = [], 0
        for i, seq, n in plain:
            start = seq.num_cached
            seq.num_cached += n
            cached += start + n
            if seq.catch_up:  # its one new token, after every position recomputed from 0: all the draft's rows
                seq.catch_up = False
                due.append((i, seq, 0, start + 1))
            elif not seq.prefilling:
                due.append((i, seq, start, n))
            elif seq.speculate:
                rows.add(i, seq.seq_id, start, seq.token_slice(start + 1, start + n + 1))
        return due, cached

    def _commit(self, seq: Sequence, tokens: list[int]) -> TokenEvent:
        """Append tokens one by one until one of them finishes the sequence."""
        detok = seq.detokenizer
        if len(tokens) == 1:  # a plain decode's (a step commits one per sequence: kept lean)
            token = tokens[0]
            kept = [token]
            seq.output_ids.append(token)
            text = detok.add_tokens(kept) if detok else ""
            reason = seq.finish_reason = self._finish_reason(seq, token)
        else:
            kept, text, reason = [], "", None
            for token in tokens:
                seq.output_ids.append(token)
                kept.append(token)
                text += detok.add_tokens([token]) if detok else ""
                reason = seq.finish_reason = self._finish_reason(seq, token)
                if reason is not None:
                    break
        if reason is None:
            return TokenEvent(seq.seq_id, kept, text)
        text += detok.finish() if detok else ""
        self._release(seq)
        self.sequences.pop(seq.seq_id, None)
        metrics = seq.speculation if seq.speculate or seq.detached else None
        return TokenEvent(seq.seq_id, kept, text, reason, metrics)

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        if token in p.stop_token_ids or (token in self._eos and not p.ignore_eos) or \
                (seq.detokenizer and seq.detokenizer.stopped):
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
        final: dict[int, TokenEvent] = {}
        for ev in self.run_until_done():
            toks[ev.seq_id] += ev.token_ids
            texts[ev.seq_id].append(ev.text)
            if ev.finish_reason is not None:
                final[ev.seq_id] = ev
        return [GenerationResult(i, len(p), toks[i], "".join(texts[i]), final[i].finish_reason,
                                 final[i].speculation)
                for i, p in zip(ids, prompts)]

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[TokenEvent]:
        """Generate for one prompt alone, yielding each commit as it comes."""
        seq_id = self.add_request(prompt_ids, params)
        try:
            for ev in self.run_until_done():
                if ev.seq_id == seq_id:
                    yield ev
        finally:
            self.abort(seq_id)

