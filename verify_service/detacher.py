"""Which requests use the draft, with adaptive speculation (``AdaptivePolicy.detaches``).

A request whose first chunk starts where trees would not pay at the batch it joins runs without the
draft, as target-only decoding runs: no features kept for it, no rows buffered, no draft state, no
per-step decision. From a batch of ``PolicyConfig.leave_from`` sequences, running requests leave the
draft too, at a decision for plain decoding where trees would not pay (``leave``). When the batch
changes bucket (``batch_key``) the policy looks again; where trees now pay, such a request takes the
draft up again: its next step recomputes every position it has (``Sequence.catch_up``,
``SeqChunk.write_from``: the draft's features, the KV left as it is).
"""

from __future__ import annotations

from verify_service.adaptive import AdaptivePolicy, batch_key
from verify_service.scheduler import Scheduler

# A request without the draft takes it up again only with at least this many tokens left to it: its
# catch-up recomputes every position it has (a step of that many tokens) and the draft extends them.
REATTACH_MIN_TOKENS = 32


class Detacher:
    def __init__(self, policy: AdaptivePolicy, scheduler: Scheduler):
        self.policy, self.scheduler = policy, scheduler
        self.detached_requests = 0  # started where trees did not pay at their batch
        self.left_requests = 0  # left the draft while running (``leave``)
        self.reattached_requests = 0  # of those, took the draft up again once the batch shrank
        self.detached = 0  # running ones still without it
        self._look: tuple[int, bool] | None = None  # (batch key, trees pay there) of the last look
        self._look_batch = -1  # the batch size ``due`` last answered for from ``_look`` (-1: none)
        # False once no request without the draft had the tokens left to take it up again: tokens left
        # only shrink, so it stays False until a request leaves or starts without the draft.
        self._reattachable = True

    def released(self) -> None:
        """A request without the draft finished or was cancelled."""
        self.detached -= 1

    def starting(self, plan) -> None:
        """Requests whose first chunk runs now, where trees would not pay at the batch they join (the
        running and waiting requests, at their mean length: ``AdaptivePolicy.detaches``), run without
        the draft, and so do those admitted or waiting that have not started, which join the same
        batch: a wave of prompts admitted over several steps takes one decision. (Priced at the new
        requests' own prompts, such a wave was split: the steps of short prompts kept the draft,
        those of long ones left it. Decided step by step, each of its prompt steps paid the policy's
        look and the draft's bookkeeping for the requests still waiting: at batch 128 on an H200,
        0.2 ms a prompt step, 0.6% of target-only's tok/s.)"""
        new = [s for s, _ in plan if s.num_cached == 0 and s.speculate]
        if not new:
            return
        sched = self.scheduler
        batch = len(sched.running) + len(sched.waiting)
        context = (sum(s.num_tokens for s in sched.running) + sum(s.num_tokens for s in sched.waiting)) / batch
        if self.policy.detaches(batch, context):
            # the plan's new ones (running now), those admitted but not yet started, and the waiting: no
            # draft state yet
            new = [s for s in sched.running if s.num_cached == 0 and s.speculate]
            new += [s for s in sched.waiting if s.speculate]
            for s in new:
                s.speculate, s.detached = False, True
            self.detached_requests += len(new)
            self.detached += len(new)
            self._reattachable = True
            # This batch's look (``due``) is taken as done: they just left it where trees do not pay
            # (its first plain step would look again, a synchronous prompt step's tens of microseconds).
            self._look, self._look_batch = (batch_key(batch), False), -1

    def leaves(self, batch: int, context: float) -> bool:
        """Whether the running requests leave the draft now, plain decoding just chosen (a whole
        decision, not a held one) for ``batch`` sequences at about ``context`` tokens: from a batch of
        ``leave_from``, where a request starting now would run without it (``AdaptivePolicy.detaches``)."""
        start = self.policy.cfg.leave_from
        return bool(start) and batch >= start and self.policy.detaches(batch, context)

    def leave(self, seqs: list, batch: int) -> None:
        """``seqs`` (running, decoding, no tree of theirs pending; their draft state released by the
        caller) run without the draft from now on, as requests started without it do. The batch's
        look (``due``) is taken as done: no request takes the draft up again until the bucket changes."""
        for s in seqs:
            s.speculate, s.detached = False, True
        self.detached += len(seqs)
        self.left_requests += len(seqs)
        self._reattachable = True
        self._look, self._look_batch = (batch_key(batch), False), -1

    def due(self) -> bool:
        """Whether requests without the draft run where trees now pay: looked at once per batch
        bucket (``batch_key``; at batch 128 a look is a few tens of microseconds), so that a plain
        step is launched ahead (``Engine._decode_ahead``) unless they may take the draft up again."""
        if not self.detached:
            return False
        sched = self.scheduler
        batch = len(sched.running) + len(sched.waiting)
        if batch == self._look_batch:  # (asked every plain step: the same batch, the same answer)
            return self._look[1]
        key = batch_key(batch)
        look = self._look
        if look is None or look[0] != key:
            pays = False  # (no request could take the draft up again, as at the tail of a batch whose
            #                requests end together: no look at the policy, tens of microseconds a key)
            if self._could_reattach():
                decoding = [s.num_tokens for s in sched.running if not s.prefilling]
                context = sum(decoding) / len(decoding) if decoding else 0.0
                pays = self.policy.trees_pay(batch, context)
            look = self._look = (key, pays)
        self._look_batch = batch
        return look[1]

    def _could_reattach(self) -> bool:
        """Whether a running request without the draft has the tokens left to take it up again."""
        if self._reattachable:
            self._reattachable = any(s.detached and s.max_new_tokens - len(s.output_ids) >= REATTACH_MIN_TOKENS
                                     for s in self.scheduler.running)
        return self._reattachable

    def reattach(self, max_tokens: int) -> int:
        """Where trees now pay (``due``), requests without the draft take it up again: each
        recomputes every position in its next step (``Sequence.catch_up``: the target's features of
        them all for the draft, only its newest token's KV written), if at least
        ``REATTACH_MIN_TOKENS`` tokens are left to it, as many as ``max_tokens`` recomputed positions
        allow this step (the others at the next). Returns the positions to recompute."""
        if not self.due():
            return 0
        tokens, left = 0, False
        for s in self.scheduler.running:
            if not s.detached or s.prefilling or s.finished or \
                    s.max_new_tokens - len(s.output_ids) < REATTACH_MIN_TOKENS:
                continue
            if tokens + s.num_cached + 1 > max_tokens:
                left = left or s.num_cached + 1 <= max_tokens  # fits a later step
                continue
            s.detached, s.speculate, s.catch_up = False, True, True
            tokens += s.num_cached + 1
            self.detached -= 1
            self.reattached_requests += 1
        if not left:  # none left that could: plain steps go ahead again until the batch changes
            self._look, self._look_batch = (self._look[0], False), -1
        return tokens
