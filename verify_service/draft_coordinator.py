"""The engine's side of speculation: what the draft is fed, which trees it is asked for, and the
trees it sends back.

Each step the engine hands over the rows that became final (its prefill chunks and plain decodes in
one record, ``StepRows``: a position's captured target features paired with the token that follows
it) and calls ``draft``: the rows go to the
draft (through the feed buffer, which holds them while adaptive speculation decodes plainly), the
draft is asked for a tree per decoding sequence that speculates, capped to the policy's choice and
to what the context and ``max_tokens`` leave, and the trees that come back are checked (all at
once; a broken one costs its sequence one plain step, never a wrong token) and attached to their
sequences for the next step's verification.
"""

from __future__ import annotations

import logging
import time


from link.protocol import DraftFeed, DraftProvider, ProposeRequest
from runtime.tree import CandidateTree, InvalidTreeError, invalid_trees
from verify_service.adaptive import AdaptivePolicy, batch_key
from verify_service.detacher import Detacher
from verify_service.feed_buffer import FEED_BUFFER_BYTES, FeedBuffer, FeedRows
from verify_service.scheduler import Scheduler
from verify_service.sequence import Sequence
from verify_service.verification import PendingVerification, Verified

log = logging.getLogger(__name__)


class DraftCoordinator:
    def __init__(self, drafter: DraftProvider, policy: AdaptivePolicy | None, scheduler: Scheduler,
                 sequences: dict[int, Sequence], vocab_size: int, max_model_len: int, feature_rows: int,
                 feature_bytes: int):
        """``sequences``: the engine's live sequences (shared, not copied). ``feature_rows``: the most
        rows one draft call may carry; ``feature_bytes``: the size of one row's features (the feed
        buffer holds ``FEED_BUFFER_BYTES`` of them while speculation decodes plainly)."""
        self.drafter, self.policy = drafter, policy
        self.scheduler, self.sequences = scheduler, sequences
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.feed_buffer = FeedBuffer(feature_rows, FEED_BUFFER_BYTES // feature_bytes if policy else None)
        self._asked: dict[int, int] = {}  # seq_id -> node cap its pending tree was asked with (0: pruned)
        self.draft_errors = 0  # invalid trees refused (each fell back to one plain step)
        self.chain = True  # chain the draft after acceptance where it can (``chains``); False: tests' A/B
        self.chained_steps = 0  # steps whose draft work went in behind acceptance (``draft_on_device``)
        self._decided: int | None = None  # the policy's choice for the next step, taken early (``plain_ahead``)
        self._early: tuple[list[int], int] | None = None  # (sequences, choice) taken by ``choose_ahead``
        self.early_choices = 0  # chained steps whose choice was taken while the device ran the forward
        if policy is not None:  # the largest trees are chained where the drafter can (``chains``)
            policy.chainable = hasattr(drafter, "step_on_device")
        # With a policy: the requests that start without the draft, and take it up again.
        self.detacher = Detacher(policy, scheduler) if policy is not None else None
        self._wanting = 0  # live requests that asked for the draft (those running without it included)

    @property
    def speculating(self) -> int:
        """Live requests that use the draft now: those that asked for it, less those running without it
        (``Detacher``). At 0 every step is plain, as target-only decoding's, and the engine skips the
        draft's bookkeeping (at batch 128, tens of microseconds of a host-bound step)."""
        return self._wanting - (self.detacher.detached if self.detacher is not None else 0)

    def admit(self, seq: Sequence) -> None:
        """A new request (``release`` follows once it finishes or is cancelled)."""
        self._wanting += seq.speculate

    def release(self, seq: Sequence) -> None:
        """A finished or cancelled sequence: its waiting rows, its draft state, its policy estimates."""
        self._wanting -= seq.speculate or seq.detached
        if seq.speculate:
            self.feed_buffer.drop(seq.seq_id)
            self.drafter.release(seq.seq_id)
        elif seq.detached:
            self.detacher.released()
        if self.policy is not None:
            self.policy.release(seq.seq_id)
        self._asked.pop(seq.seq_id, None)

    def plain_ahead(self, seqs: list[Sequence]) -> bool:
        """Whether the next step of these sequences (the whole batch, each decoding one token) is plain
        decoding, decided now, before this step's tokens are read, so that the engine may launch it
        at once: when no live request uses the draft (with a policy or without), or with a policy and
        no sequence with a tree. The policy's choice is taken here, as
        ``draft`` would take it (the batch's context one token short), and ``draft`` then follows it:
        plain, no trees; a tree size, trees of that size."""
        if not self.speculating:  # plain decoding, no look at the sequences (a policy or none: no tree is asked)
            self._decided = 0
            return True
        if self.policy is None:
            return False
        speculating = 0  # (one pass: asked every plain step, at batch 128 each pass is ~10 us)
        for s in seqs:
            if s.tree is not None:
                return False
            speculating += s.speculate
        quick = (batch_key(len(self.scheduler.running)), batch_key(speculating))  # as ``_requests`` keys it
        self.policy.backlog_rows = self.feed_buffer.rows
        if not speculating or self.policy.choose_held(quick):  # (no sequence that speculates: plain decoding)
            self._decided = 0
        else:
            ready = [s for s in seqs if s.speculate]
            context = sum(s.num_tokens for s in seqs) / len(seqs)
            self._decided = self.policy.choose(len(seqs), context, [s.seq_id for s in ready],
                                               [s.tree_settings.node_budget for s in ready], quick)
            if self._decided == 0 and self.detacher.leaves(len(seqs), context):
                self._leave(ready, len(seqs))
        return self._decided == 0

    def _leave(self, seqs: list[Sequence], batch: int) -> None:
        """Running ``seqs`` leave the draft (``Detacher.leave``): their waiting rows, draft state and
        estimates go, as a finished sequence's do; they stay live requests that asked for it."""
        for s in seqs:
            self.feed_buffer.drop(s.seq_id)
            self.drafter.release(s.seq_id)
            self.policy.release(s.seq_id)
            self._asked.pop(s.seq_id, None)
        self.detacher.leave(seqs, batch)

    def draft(self, feeds: dict[int, DraftFeed], rows: FeedRows | None = None, prompt_rows: int = 0) -> float:
        """Send the draft what became final (``feeds`` per sequence, ``rows`` for many; of live
        sequences only); ask for trees for every decoding sequence, of the size the policy picks when
        there is one (plain decoding: the rows wait in the feed buffer and the draft is not called).
        ``prompt_rows``: how many of ``rows`` are prompt chunks' (the draft's catch-up, as the rows of
        earlier plain steps are: no tree's cost). Returns the seconds the call for trees took (0: none
        was made)."""
        prompt = prompt_rows > 0
        decided, self._decided = self._decided, None
        if not feeds and rows is None and not self.speculating:  # no request uses the draft: nothing to do
            policy = self.policy  # (the backlog told only when it changed: a host-bound plain step's microseconds)
            if policy is not None and policy.backlog_rows != self.feed_buffer.rows:
                policy.backlog_rows = self.feed_buffer.rows
            return 0.0
        live: list[DraftFeed | FeedRows] = [f for f in feeds.values() if f.seq_id in self.sequences]
        if rows is not None and len(rows):
            live.append(rows)
        overflow = self.feed_buffer.add(live)
        if overflow:
            self._send(overflow, [])
        backlog = self.feed_buffer.rows - sum(len(f.next_tokens) for f in live)  # rows of earlier steps wait
        if self.policy is not None:
            self.policy.backlog_rows = backlog
        if decided == 0 and self.policy is not None:  # plain decoding, decided already: the rows wait
            self._feed_prompts(prompt)
            return 0.0
        fed = set(feeds)
        if rows is not None and len(rows):
            fed.update(rows.seq_ids if type(rows.seq_ids) is list else rows.seq_ids.tolist())
        requests = self._requests(fed, decided) if getattr(self.drafter, "connected", True) else []
        if not requests and (self.policy is not None or not self.feed_buffer.rows):
            self._feed_prompts(prompt)
            return 0.0
        start = time.perf_counter()
        trees = self._send(self.feed_buffer.take(), requests)
        seconds = time.perf_counter() - start  # the trees are on the host: the draft's work is done
        if self.policy is not None and requests:  # a backlog's extend is no tree's cost: counted apart
            levels = max(r.settings.depth for r in requests)
            self.policy.observe_draft(len(requests), levels, seconds * 1e3, backlog + prompt_rows)
        proposed = [(req, trees[req.seq_id]) for req in requests if trees.get(req.seq_id) is not None
                    and trees[req.seq_id].num_nodes]
        vocab = self.vocab_size
        # Checked all at once; a flagged tree gets its own check, which names the broken invariant. A
        # provider whose trees are valid by construction (the in-process drafter) is not checked.
        flagged = set() if getattr(self.drafter, "trusted_trees", False) else \
            set(invalid_trees([t for _, t in proposed], vocab, [r.settings.node_budget for r, _ in proposed],
                              [r.max_depth for r, _ in proposed]))
        for j, (req, tree) in enumerate(proposed):
            try:
                if j in flagged:
                    tree.validate(vocab, req.settings.node_budget, req.max_depth)
            except InvalidTreeError as exc:  # this step decodes plainly; the output stays exact
                log.warning("sequence %d: draft proposed an invalid tree (%s); decoding one token", req.seq_id, exc)
                self.draft_errors += 1
                self.drafter.tree_rejected(req.seq_id, str(exc))
                continue
            self.sequences[req.seq_id].tree = tree
            self._asked[req.seq_id] = req.settings.node_budget if req.max_depth >= req.settings.depth else 0
        return seconds

    # --- the draft chained after acceptance, on the device ---------------------------------

    def chains(self, seqs: list[Sequence]) -> bool:
        """Whether a step of these tree sequences alone may hand the draft its rows before the step
        waits for the device (``draft_on_device``): a drafter that takes them there (in this process,
        or a draft service whose session takes chained steps for all of them: ``chainable``), nothing
        waiting in the feed buffer, one tree shape, every sequence speculating; with a policy, its
        choice for the next step (``choose_ahead``, or taken now; before this step's acceptance is
        read, as ``plain_ahead`` takes it) is the requests' own trees. Another choice is kept for
        ``draft``."""
        early, self._early = self._early, None
        ids = [s.seq_id for s in seqs]
        early = early[1] if early is not None and early[0] == ids else None
        chainable = getattr(self.drafter, "chainable", None)
        if not (self._chain_shape(seqs) and (chainable is None or chainable(ids))):
            self._decided = early  # (``draft`` asks for what was chosen, or chooses)
            return False
        if self.policy is None:
            return True
        decided = early if early is not None else self._choose_next(seqs, ids)
        if decided < seqs[0].tree_settings.node_budget:
            self._decided = decided
            return False
        self.early_choices += early is not None
        return True

    def choose_ahead(self, seqs: list[Sequence]) -> None:
        """With a policy, take the next step's choice for a step of these tree sequences alone now,
        while the device runs the step's forward: ``chains`` needs it between acceptance and the
        draft's launch, where the device would wait for it (and ``draft`` takes it when the step
        does not chain)."""
        if self.policy is not None and seqs and self._chain_shape(seqs):
            ids = [s.seq_id for s in seqs]
            self._early = (ids, self._choose_next(seqs, ids))

    def _chain_shape(self, seqs: list[Sequence]) -> bool:
        return (self.chain and hasattr(self.drafter, "step_on_device") and not self.feed_buffer.rows
                and len({s.tree_settings for s in seqs}) == 1 and all(s.speculate for s in seqs))

    def _choose_next(self, seqs: list[Sequence], ids: list[int]) -> int:
        budget = seqs[0].tree_settings.node_budget
        self.policy.backlog_rows = 0
        return self.policy.choose(len(seqs), sum(s.num_tokens for s in seqs) / len(seqs), ids, [budget] * len(seqs))

    def draft_on_device(self, pending: PendingVerification):
        """Feed the draft what acceptance chose, still on the device, and grow every sequence's next
        tree (its full depth): the draft's work queues behind the target's with no wait between
        them. Returns the trees on their way to the host (``collect()``: the drafter's
        ``PendingTrees``). ``settle`` follows once the step's tokens are committed, ``attach`` once
        the trees are collected."""
        counts, tokens = pending.feeds_on_device()
        seqs = pending.seqs
        self.chained_steps += 1
        return self.drafter.step_on_device([s.seq_id for s in seqs], [s.num_cached for s in seqs],
                                           pending.most, counts, tokens, pending.features,
                                           seqs[0].tree_settings)

    def settle(self, verified: list[Verified]) -> None:
        """The draft's committed rows of the sequences ``draft_on_device`` fed, before any of them
        finishes (a finished one's draft state is then freed as usual)."""
        self.drafter.settle({v.seq.seq_id: v.start + len(v.tokens) for v in verified})

    def trees_fit(self, seq_ids: list[int]) -> bool:
        """Whether the chained trees of these sequences may be verified whole, from the device: every
        one still running (or finished: its tree is left out) has the context room for its tree. (Past
        ``max_tokens`` a tree may reach: the tokens it commits beyond are cut as a plain step's would
        be, and the KV its rows take is within what the sequence reserved; ``attach`` cuts the host's
        copies.)"""
        sequences, longest = self.sequences, self.max_model_len
        for seq_id in seq_ids:
            seq = sequences.get(seq_id)
            if seq is not None and not seq.finished and \
                    len(seq.prompt_ids) + len(seq.output_ids) + seq.tree_settings.depth > longest:
                return False
        return True

    def attach(self, trees: dict[int, CandidateTree], whole: bool = False) -> None:
        """Give the live sequences their chained trees, cut to the depth their context and
        ``max_tokens`` now leave (none where they leave none). ``whole``: trees the step verified from
        the device (``trees_fit``), cut by nothing (the host's copy is the tree verified)."""
        sequences = self.sequences
        for seq_id, tree in trees.items():
            seq = sequences.get(seq_id)
            if seq is None or seq.finished or not tree.num_nodes:
                continue
            depth = seq.tree_settings.depth if whole else self._max_depth(seq)
            if depth <= 0:
                continue
            seq.tree = tree if whole else tree.prune_depth(depth)
            self._asked[seq_id] = seq.tree_settings.node_budget if depth >= seq.tree_settings.depth else 0

    def _feed_prompts(self, prompt: bool) -> None:
        """With the policy's ``feed_prompt_rows``: a step with prompt chunks (``prompt``) that asks for no
        tree sends the draft every waiting row now, without a tree request, rather than letting the
        prompt's rows wait for the next tree: a long prompt's last chunk would otherwise make the first
        tree after plain steps pay its extend (8,254 rows, 358 ms at 32K on the 8B, after which the
        learned catch-up cost priced trees out). A no-op where off, where nothing waits, or while the
        draft is not connected (its rows keep waiting, as for a tree)."""
        policy = self.policy
        if prompt and policy is not None and policy.cfg.feed_prompt_rows and self.feed_buffer.rows and \
                getattr(self.drafter, "connected", True):
            self._send(self.feed_buffer.take(), [])
            policy.backlog_rows = 0

    def _send(self, feeds: list[DraftFeed], requests: list[ProposeRequest]) -> dict:
        """Feed the draft (in calls of at most the feed buffer's ``max_rows``), then ask for trees with
        the last call."""
        calls = self.feed_buffer.split(feeds) or [[]]
        for call in calls[:-1]:
            self.drafter.step(call, [])
        return self.drafter.step(calls[-1], requests)

    def _requests(self, fed: set[int], decided: int | None = None) -> list[ProposeRequest]:
        """A tree request per decoding sequence that speculates and was fed this step, capped to the
        policy's choice (``decided``: taken already, by ``plain_ahead``); none for a sequence whose
        context or ``max_tokens`` leaves no room."""
        if decided == 0:
            return []
        running = self.scheduler.running
        quick = (batch_key(len(running)), batch_key(len(fed)))
        if decided is None and self.policy is not None and self.policy.choose_held(quick):  # held: no look at each
            return []
        ready, decoding, context, joining = [], 0, 0, len(self.scheduler.waiting)  # one pass over the sequences
        for seq in running:
            if seq.prefilling or seq.finished:
                joining += seq.prefilling
                continue
            decoding, context = decoding + 1, context + seq.num_tokens
            if seq.speculate and seq.seq_id in fed:
                ready.append(seq)
        if not ready:
            return []
        if self.policy is None:
            trees = [seq.tree_settings for seq in ready]
        else:  # sequences at their last token count as candidates: the choice comes first (plain: done)
            # The batch chosen for holds the requests still prefilling or waiting: they decode with
            # these within a few steps, and trees chosen for the first ones admitted would take the
            # step's token budget from the prompts (measured at batch 64, H100: 38 mixed steps of
            # 37 ms instead of 4 prompt steps, 0.25x target-only).
            nodes = decided if decided is not None else self.policy.choose(
                decoding + joining, context / decoding, [s.seq_id for s in ready],
                [s.tree_settings.node_budget for s in ready], quick)
            if nodes == 0:
                return []
            trees = [self.policy.settings(seq.tree_settings, nodes) for seq in ready]
        requests = []
        for seq, tree in zip(ready, trees):
            depth = self._max_depth(seq)
            if depth > 0:
                requests.append(ProposeRequest(seq.seq_id, min(depth, tree.depth), tree))
        return requests

    def _max_depth(self, seq: Sequence) -> int:
        """Deepest useful tree: within its settings, the context and the tokens still allowed."""
        room = self.max_model_len - seq.num_tokens  # node at depth d sits at num_tokens - 1 + d
        return min(seq.tree_settings.depth, room, seq.max_new_tokens - len(seq.output_ids) - 1)

    def observe(self, v) -> None:
        """Tell the policy what a verified tree accepted (a tree cut short by the context or max_tokens
        says nothing about its size)."""
        asked = self._asked.pop(v.seq.seq_id, 0)
        if self.policy is not None and asked:
            self.policy.observe_tree(v.seq.seq_id, v.tree, v.accepted, asked)
