"""Adaptive speculation: each step, the tree size (or plain decoding) that gives the batch the most
tokens per second, from measured costs and the acceptance its sequences have shown.

For B decoding sequences, S of them speculating, and trees of at most n nodes::

    tokens(n) = sum_i (1 + a_i(n)) + (B - S)        a_i(n): sequence i's expected accepted nodes
    cost(n)   = forward(B, 1 + n, ctx) + residual(B, n > 0) + draft(S, n)        (n = 0: no draft)
    choice    = argmax_n tokens(n) / cost(n); a tree must beat plain decoding by ``margin``

The costs (forward, residuals, the draft's part, chained steps, the catch-up of a backlog) are
``StepCosts``'s (``step_costs.py``).

Acceptance: the best m nodes of a tree (by draft score) are themselves the tree of size m
(``TreeSettings.capped``) and closed under ancestors, so a verified tree of n nodes shows what every
size m <= n would have accepted: under greedy verification exactly the leading nodes of the
accepted path ranking among the best m (under sampling, an estimate). Each sequence keeps its own
means per size (``Acceptance``), seeded from the global ones and pulled toward them: the global
estimate weighs as much as ``seq_shrink`` of the sequence's trees. One tree that accepted nothing is
noise, not a verdict (MT-bench at batch 1: after three trees that accepted at most one node
together, the next accepted 1.67 on average, and the largest tree still paid; unpulled, a sequence's
first tree decided alone, and the policy decoded plainly in a quarter of its steps, 0.90 of the
fixed tree's speed at batch 1 and 0.83 at batch 4 on one H100, 0.99 and 0.96 pulled). Above the
largest size a sequence has seen, its estimate follows the global one's gains up to the largest size
the global one rests on ten trees or more for; sizes above that are guessed optimistically (the last gain per node carried
on), so a larger tree is tried when it might pay; and every ``probe_every`` decisions the next size up is tried once, so
acceptance that rises is found even where the guess says no. From plain decoding the probe is the size
the global estimate would pick for the batch (where that is plain decoding too, the smallest and the
largest tree in turn): an estimate of a size moves only with trees of that size or larger, so after an unlucky
stretch at the largest tree, probes of the smallest one would never bring it back (measured at batch 1:
plain decoding in 83% of the steps where the fixed tree ran 1.47x target-only). Where that size is a
tree (the batch's trees pay), such probes come every ``probe_every / 4`` decisions and cost only their
time beyond plain decoding's for the tokens the global estimate expects of them. A decision is reused
for up to ``hold_steps`` steps while the batch, its context (to 256 tokens) and what was learned
(draft costs, a new sequence's first tree, from plain decoding a probe's tree; not the per-step
residuals, nor the acceptance of trees the decision chose) stay the same. A probe waits while
the probes' extra cost (modelled: the probe's step against the best one, and from plain decoding
the draft's catch-up of the rows the plain steps left it, learned per row) would exceed
``probe_share`` of the steps' modelled time over about the last ``probe_window`` decisions: at a
batch where trees cost far more than they bring, probing stays a few percent of the time instead of
a fixed fraction of the steps. (Counted since start, the time of a long stretch where trees were the
best choice, and no probes ran, would fund a burst of probes after the batch grew: measured, 5 to 15
tree steps per 125 at batch 16 after batches 1 and 4, 7% of the time.)

Over the model, a guard of measurements alone (``realized_rates.py``): where the steps that verified
trees delivered fewer tokens per millisecond than plain steps at a batch bucket of 8 or more (every
draft call counted as the trees' cost, the catch-up of a backlog included), trees are not chosen
there nor at any larger batch, and not probed, for ``veto_span`` decisions. The batch a choice is
made for holds the requests still prefilling or waiting to start (``DraftCoordinator._requests``).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from common.tree_settings import TreeSettings, level_cap, tree_sizes
from runtime.tree import CandidateTree
from verify_service.acceptance_estimate import Acceptance, accepted_within
from verify_service.cost_table import CostGrid, CostTable, calibrate, describe
from verify_service.learned_costs import batch_bucket
from verify_service.realized_rates import RealizedRates
from verify_service.step_costs import StepCosts

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    prior_acceptance: float = 0.6  # before any tree is seen: node at depth d accepted with p^d
    seq_weight: float = 0.1  # EWMA weight of one tree in a sequence's own estimate
    seq_shrink: float = 4.0  # ... pulled toward the global one, which weighs as much as this many of its trees
    global_weight: float = 0.02  # ... in the global estimate (the prior of new sequences)
    cost_weight: float = 0.05  # EWMA weight of one measured step in the learned costs (0: the table alone)
    margin: float = 0.02  # a tree must beat plain decoding by this fraction (noise in the estimates)
    stay_margin: float = 0.2  # on trees the global estimate picks, plain decoding must beat them by this (0: off)
    stay_global: float = 0.1  # on trees it does not pick, plain decoding must beat them by this (0: leave at once)
    probe_every: int = 32  # decisions between probes of the next size up (0: never)
    probe_share: float = 0.03  # probes may cost at most this share of the steps' (modelled) time ...
    probe_window: int = 256  # ... over about this many recent decisions (an exponential window)
    hold_steps: int = 8  # a decision is reused this many steps while nothing but step times (and, on
    #                      trees, the acceptance of the trees it chose) was learned
    draft_prior_fraction: float = 0.15  # draft cost per level before one is measured, x a decode forward
    draft_prior_geometry: int = 0  # 1: that share is an EAGLE-3 head's weights over the target's, from the cost
    #                                table's model geometry (``step_costs.head_weight_fraction``: SmolLM2 0.158,
    #                                the 8B 0.055, whose draft learned 0.27 ms a level at 32K against the
    #                                constant's 0.86); off until measured through the policy
    veto_span: int = 4096  # decisions a veto of trees, measured slower than plain decoding, lasts (0: no veto)
    detach_below: float = 0.75  # a request starting where trees are modelled below this share of plain
    #                              decoding's tokens per ms (or vetoed) runs without the draft (0: never)
    leave_from: int = 4  # from a batch of this many: where the global estimate picks plain decoding for the
    #                      whole batch, requests run without the draft, and running ones leave it (0: never)
    feed_prompt_rows: int = 0  # 1: a step of prompt chunks that asks for no tree sends the draft every
    #                            waiting row at once, rather than the first tree after plain steps
    #                            extending them (``DraftCoordinator._feed_prompts``; off until measured)


def policy_variant(text: str) -> PolicyConfig:
    """``field=value[,field=value...]``: the default PolicyConfig with those fields changed (benchmarks'
    variants). An unknown field or a value of the wrong type raises ValueError."""
    base = PolicyConfig()
    changed = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        if not sep or not hasattr(base, name):
            raise ValueError(f"{part!r}: not FIELD=VALUE with a PolicyConfig field")
        changed[name] = type(getattr(base, name))(value)
    return replace(base, **changed)


def batch_key(n: int) -> int:
    """A count of sequences as a held plain decision's key holds it: exact up to 8, then rounded up to
    a multiple of 8. The target's decode and verification graphs are captured for such batches, so
    within one a step costs the same, and plain decoding's tokens and a tree's both scale with the
    batch: what was chosen for 128 sequences holds for 121 (a batch that shrinks one sequence a step
    takes no new decision per step)."""
    return n if n <= 8 else -(-n // 8) * 8


class AdaptivePolicy:
    def __init__(self, table: CostTable, limits: TreeSettings, config: PolicyConfig = PolicyConfig(),
                 sizes: tuple[int, ...] | None = None):
        """``sizes``: the node counts it picks from (default ``tree_sizes(limits)``; a benchmark replaying
        a trace recorded for other sizes passes them: increasing, the last one the limits' budget)."""
        self.table, self.limits, self.cfg = table, limits, config
        if sizes is not None and (not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1
                                  or sizes[-1] != limits.node_budget):
            raise ValueError(f"tree sizes {sizes}: increasing from 1, ending at the budget {limits.node_budget}")
        self.sizes = tuple(sizes) if sizes is not None else tree_sizes(limits)
        self._levels = np.array([limits.capped(m).depth for m in self.sizes], dtype=np.float64)
        # sizes cut to fewer levels than nodes allow (EAGLE3_TREE_LEVELS): credited at most a node a level
        self._cut_levels = self._levels if any(level_cap(m) for m in self.sizes) else None
        p = config.prior_acceptance
        prior = np.array([sum(p ** d for d in range(1, int(lv) + 1)) for lv in self._levels])
        self._global = Acceptance(prior, config.global_weight)
        self._seq: dict[int, Acceptance] = {}
        self.costs = StepCosts(table, config, self.sizes, self._levels)
        self.decisions: Counter[int] = Counter()  # steps per choice (0: plain decoding)
        self.switches: Counter[str] = Counter()  # decisions between plain decoding and trees, and why (``_count_switch``)
        self.decided = 0  # decisions so far (the sum of ``decisions``)
        self._undecided = [0, 0]  # steps that took no decision (their requests without the draft), decided at the last
        self.realized = RealizedRates(span=config.veto_span)  # what trees delivered against plain steps
        self.vetoes = 0  # decisions taken under a veto (``RealizedRates``): plain decoding, the model not asked
        self.choice = 0
        self.probes = 0
        self._since_probe = 0  # decisions since the last probe
        self._plain_probes = 0  # probes tried where the global estimate picks plain decoding (``_probe``)
        self._period = config.probe_every  # decisions between probes, as the latest decision set it
        self._spent_ms = 0.0  # modelled cost of the chosen steps (recent ones: see _account) ...
        self._probe_ms = 0.0  # ... and what the probes added to it
        self._keep = 1.0 - 1.0 / max(config.probe_window, 1)
        self._own_version = 0  # bumped by what moves the decision much: a probe's tree, a release ...
        self._held: list = [None, 0, 0]  # (batch, context / 256, speculating, budget, version), best, uses
        self._held_ms: float | None = None
        self._quick = None  # (caller's key, version, plain step's modelled ms) while plain decoding is held
        self.last_held = False  # the latest decision was a held plain one (choose_held)

    @property
    def _version(self) -> int:
        """... and the costs' changes (a draft's cost, the first chained step): a held decision ends."""
        return self._own_version + self.costs.changes

    # The cost model's (``StepCosts``), as the coordinator and the engine use it through the policy.
    chainable = property(lambda self: self.costs.chainable, lambda self, v: setattr(self.costs, "chainable", v))
    backlog_rows = property(lambda self: self.costs.backlog_rows,
                            lambda self, v: setattr(self.costs, "backlog_rows", v))
    outliers = property(lambda self: self.costs.outliers)

    def step_ms(self, batch: int, context: float, nodes: int, speculating: int) -> float:
        return self.costs.step_ms(batch, context, nodes, speculating)

    def draft_ms(self, speculating: int, levels: float, context: float) -> float:
        return self.costs.draft_ms(speculating, levels, context)

    def backlog_ms(self) -> float:
        return self.costs.backlog_ms()

    def observe_step(self, batch: int, nodes: int, context: float, ms: float, chained: bool = False) -> None:
        self.costs.observe_step(batch, nodes, context, ms, chained)

    def observe_draft(self, speculating: int, levels: int, ms: float, backlog: int = 0) -> None:
        self.costs.observe_draft(speculating, levels, ms, backlog)

    # --- the decision ---------------------------------------------------------------------------

    def choose(self, batch: int, context: float, seq_ids: list[int], budgets: list[int], quick_key=None) -> int:
        """Nodes per tree for the next step (0: plain decoding). ``batch``: the sequences that decode
        next step; ``seq_ids``/``budgets``: those that may speculate, and the most nodes each may have.
        ``quick_key``: the caller's cheap summary of the step (see ``choose_held``)."""
        key = (batch, int(context) >> 8, len(seq_ids), min(budgets, default=0), self._version)
        if key != self._held[0] or self._held[2] >= self.cfg.hold_steps:
            self._held = [key, self.best(batch, context, seq_ids, budgets), 0]
            self._held_ms = None  # its step's modelled time, taken once per held decision (``_probe``)
        self._held[2] += 1
        before = self.choice
        self.choice = self._probe(self._held[1], batch, context, len(seq_ids))
        if (before == 0) != (self.choice == 0):
            self._count_switch(batch, context, len(seq_ids), probe=self.choice != self._held[1])
        self.decisions[self.choice] += 1
        self.decided += 1
        plain = self.step_ms(batch, context, 0, len(seq_ids)) if self.choice == 0 and quick_key is not None else None
        self._quick = None if plain is None else (quick_key, self._version, plain)
        self.last_held = False
        return self.choice

    def _count_switch(self, batch: int, context: float, speculating: int, probe: bool) -> None:
        """A decision that moved between plain decoding and trees, counted by direction, batch bucket
        and why (each switch costs: a plain step after trees is not launched ahead, a tree step after
        plain ones is not chained and pays the draft's catch-up). To trees: the model's choice or a
        probe. To plain decoding: a veto, the global estimate (it too picks plain decoding for the
        batch), or the sequences' own estimates alone."""
        if self.choice:
            why = "probe" if probe else "model"
        elif self.cfg.veto_span and self.realized.vetoed(batch, self._clock):
            why = "veto"
        else:
            why = "sequences' estimates" if self._global_pick(batch, context, speculating)[0] else "global estimate"
        to = "plain -> trees" if self.choice else "trees -> plain"
        self.switches[f"{to} b{batch_bucket(batch)}: {why}"] += 1

    def choose_held(self, quick_key) -> bool:
        """Plain decoding again, without looking at the sequences: True (and counted as a decision)
        when the latest decision was plain for the same ``quick_key`` (the caller's cheap summary:
        sequences running, sequences fed, each as ``batch_key``), nothing was learned since, it is held fewer than
        ``hold_steps`` steps and no probe is due. A plain step then costs the policy a few
        comparisons; False: call ``choose``."""
        q = self._quick
        if q is None or q[0] != quick_key or q[1] != self._version or self._held[2] >= self.cfg.hold_steps \
                or (self.cfg.probe_every and self._since_probe + 1 >= self._period):
            return False
        self._held[2] += 1
        self._since_probe += 1
        self._account(q[2])
        self.choice, self.last_held = 0, True
        self.decisions[0] += 1
        self.decided += 1
        return True

    def best(self, batch: int, context: float, seq_ids: list[int], budgets: list[int]) -> int:
        """argmax over {0} + sizes of expected tokens per ms (no probing; plain decoding where a veto holds)."""
        if not seq_ids:
            return 0
        if self.cfg.veto_span and self.realized.vetoed(batch, self._clock):  # trees measured slower here
            self.vetoes += 1
            return 0
        tokens = batch + self._accepted(seq_ids, budgets)  # [len(sizes)]
        pick = self._fastest(batch, context, len(seq_ids), tokens, self.cfg.margin)
        if pick == 0 and self.choice and (self.cfg.stay_margin or self.cfg.stay_global):
            # On trees, plain decoding must win by a margin: each switch costs a plain step not
            # launched ahead, then a tree step not chained and the draft's catch-up of the rows the
            # plain steps left it. Where the global estimate picks trees for this batch, the
            # sequences' own dip leaves them only by ``stay_margin`` (a hard passage ends); where it
            # too picks plain decoding, by ``stay_global`` (at batch 4 on an H200, where trees ran within
            # 3% of plain decoding, rounds that mixed plain stretches into trees ran 13% slower than
            # target-only's, rounds of trees alone 3% faster; most of those switches were the global
            # estimate's, which left trees at once).
            stay = self.cfg.stay_margin if self._global_pick(batch, context, len(seq_ids))[0] else self.cfg.stay_global
            if stay:
                pick = self._fastest(batch, context, len(seq_ids), tokens, -stay)
        return pick

    def _fastest(self, batch: int, context: float, speculating: int, tokens, margin: float) -> int:
        """The size whose expected ``tokens`` [len(sizes)] per ms beat plain decoding's by ``margin``
        most; 0 where none does. Leaving plain decoding, a tree also pays the draft's catch-up of the
        rows waiting for it, spread over the steps a decision holds (at the tail of a batch of 64, a
        few sequences left, trees that would gain a little each started with 5 ms of catch-up)."""
        catch_up = self.backlog_ms() / max(self.cfg.hold_steps, 1)
        rates = [t / (ms + catch_up) for t, ms in zip(tokens, self.costs.sizes_ms(batch, context, speculating))]
        i = int(np.argmax(rates))
        return self.sizes[i] if rates[i] > batch / self.step_ms(batch, context, 0, speculating) * (1 + margin) else 0

    def expected_tokens(self, batch: int, seq_ids: list[int], budgets: list[int], nodes: int) -> float:
        """tokens(n): every decoding sequence commits one, a speculating one its expected accepted too."""
        return batch + sum(self.expected_accepted(s, min(nodes, b)) for s, b in zip(seq_ids, budgets))

    def _accepted(self, seq_ids: list[int], budgets: list[int]) -> np.ndarray:
        """[len(sizes)]: sum_i a_i(min(size, budget_i)). Sequences without an estimate of their own (no
        tree verified yet: at a large batch that decodes plainly, all of them) share the global curve,
        taken once per budget: a decision costs a few operations per sequence, not an array each."""
        total = np.zeros(len(self.sizes))
        if not self._seq:  # none has an estimate of its own (a large batch decoding plainly): counted at once
            shared = Counter(budgets)  # budget -> sequences on the global curve
        else:
            shared = Counter()
            for s, b in zip(seq_ids, budgets):
                own = self._seq.get(s)
                if own is None:
                    shared[b] += 1
                else:
                    total += self._capped(own.curve(self.sizes, self._levels), b)
        if shared:
            curve = self._global.curve(self.sizes, self._levels)
            for b, k in shared.items():
                total += k * self._capped(curve, b)
        return total

    def _capped(self, curve: np.ndarray, budget: int) -> np.ndarray:
        """A curve where a request's own smaller tree caps what larger choices bring it."""
        if budget >= self.sizes[-1]:
            return curve
        return np.interp(np.minimum(self.sizes, budget), (0, *self.sizes), (0.0, *curve))

    def expected_accepted(self, seq_id: int, nodes: int) -> float:
        """a_i(n), linear between the sizes (a(0) = 0)."""
        a = self._seq.get(seq_id, self._global).curve(self.sizes, self._levels)
        return float(np.interp(nodes, (0, *self.sizes), (0.0, *a)))

    def _probe(self, best: int, batch: int, context: float, speculating: int) -> int:
        """``best``, or the next size up when a probe is due and the probes' budget allows it."""
        every = self.cfg.probe_every
        if self._held_ms is None:
            self._held_ms = self.step_ms(batch, context, best, speculating) if speculating else 0.0
        best_ms = self._held_ms
        self._since_probe += 1
        if not every or best == self.sizes[-1] or not speculating:
            self._account(best_ms)
            return best
        if best == 0 and self.cfg.veto_span and self.realized.vetoed(batch, self._clock):
            self._account(best_ms)  # trees measured slower here: no probe until the veto lapses
            return best
        if best == 0:
            # From plain decoding: the size the global estimate picks for the batch. Where that is a tree
            # (the batch's trees pay, this sequence's own estimate says no: an unlucky stretch, or a
            # hard passage), probes come four times as often, and their cost is what they take beyond
            # plain decoding's time for the tokens the global estimate expects of them (at batch 1 a
            # sequence stuck in plain decoding otherwise waited 32 steps and more for each probe while
            # the fixed tree ran 1.6x target-only).
            if len(self._held) < 4:  # taken once per held decision: a plain step's choice stays cheap
                self._held.append(self._global_pick(batch, context, speculating))
            pick, tokens = self._held[3]
            period = max(1, every // 4) if pick else every
            probe = pick or self.sizes[0]
        else:
            pick, period, probe = 0, every, self.sizes[self.sizes.index(best) + 1]
        self._period = period
        if self._since_probe < period:
            self._account(best_ms)
            return best
        if best == 0 and not pick:
            # The global estimate says plain decoding too: every other probe is the largest tree, the
            # others the smallest. A probe of the smallest tree moves no larger size's estimate, so a
            # global estimate that early unlucky trees put low would stay low: at batch 1 on an H100 the
            # policy decoded plainly through 4,800 steps (0.97x target-only where the fixed tree ran
            # 1.70x), probing one-node trees. (A probe the budget holds back counts as tried.)
            self._plain_probes += 1
            probe = self.sizes[-1] if self._plain_probes % 2 == 0 else self.sizes[0]
        probe_ms = self.step_ms(batch, context, probe, speculating)
        if pick:  # plain decoding's time for the tokens the probe is expected to commit
            extra = max(probe_ms - tokens[self.sizes.index(probe)] * best_ms / batch, 0.0)
        else:
            extra = max(probe_ms - best_ms, 0.0)
        # From plain decoding, the probe's draft first extends every row the plain steps left it: at a
        # large batch thousands (at batch 64, 5.8 ms where a step takes 1.7), no tree's cost.
        extra += self.backlog_ms() if best == 0 else 0.0
        if self._probe_ms + extra > self.cfg.probe_share * (self._spent_ms + probe_ms):
            self._account(best_ms)
            # Still due: tried again a quarter period on. (Not at the next decision: while it is due,
            # every plain step would take the whole decision, not the held one: at batch 16, 0.1 to
            # 0.2 ms of a 1.4 ms step, H200.)
            self._since_probe = period - max(1, period // 4)
            return best
        self._since_probe, self.probes = 0, self.probes + 1
        self._account(probe_ms, extra)
        return probe

    def _account(self, ms: float, probe_extra: float = 0.0) -> None:
        """A decision's modelled step time (and a probe's extra part of it), into the probes' budget:
        sums that decay by 1 / probe_window a decision, so the budget reflects the recent steps."""
        self._spent_ms = self._spent_ms * self._keep + ms
        self._probe_ms = self._probe_ms * self._keep + probe_extra

    def _global_pick(self, batch: int, context: float, speculating: int) -> tuple[int, np.ndarray]:
        """The size the global estimate picks for ``speculating`` of ``batch`` sequences (0: plain
        decoding), and the tokens it expects a step of each size to commit."""
        tokens = batch + speculating * self._global.curve(self.sizes, self._levels)
        return self._fastest(batch, context, speculating, tokens, 0.0), tokens

    def detaches(self, batch: int, context: float) -> bool:
        """Whether a request starting now, in a batch of ``batch`` decoding sequences at about ``context``
        tokens, runs without the draft: trees are vetoed at this batch (measured slower than plain
        decoding), or the best tree, at the lower bound of its cost (``StepCosts.lower_bound_ms``: the
        calibrated forward and what was measured at this batch), is modelled at less than
        ``detach_below`` of plain decoding's tokens per ms for a batch that speculates whole on the
        global acceptance estimate. (A request started without the draft stays so until the batch
        changes bucket, and none of its trees measures what they cost: priced with costs learned at
        batch 1 and scaled up, or from a machine's first few tree steps, every request of batch 1 or 4
        started without the draft on the H200, at 0.99x target-only where trees ran at 1.4-1.8x.)

        From a batch of ``leave_from`` sequences, also where the global estimate, with the full
        model's costs (``_global_pick``), picks plain decoding for the whole batch speculating: what
        the policy would choose for requests without trees of their own (at batch 16 to 128 on an
        H200, SmolLM2 and the shipped head, trees came to 0.75-1.0 of plain decoding's rate at their
        lower bound, so requests kept the draft, were decoded plainly at every decision, and the
        features and rows they kept cost 6-9% of target-only's tok/s). The same holds running
        requests off it (``DraftCoordinator.plain_ahead``, ``Detacher.leave``).

        Such a request costs nothing for a draft it would not use: no target features kept for it,
        no rows buffered, no draft state (at batch 64 and 128 the rows of plain steps cost 1-12% of
        target-only's time on the H100s measured). As the batch changes, such requests take the
        draft up again where trees pay (``trees_pay``), not merely where this says no."""
        ratio = self.cfg.detach_below
        if batch < 1:
            return False
        if (ratio or self.cfg.leave_from) and self.cfg.veto_span and self.realized.vetoed(batch, self._clock):
            return True
        if self.cfg.leave_from and batch >= self.cfg.leave_from and not self._global_pick(batch, context, batch)[0]:
            return True
        if not ratio:
            return False
        tokens = batch + batch * self._global.curve(self.sizes, self._levels)
        plain = batch / self.step_ms(batch, context, 0, batch)
        best = max(t / ms for t, ms in zip(tokens, self.costs.lower_bounds_ms(batch, context)))
        return best < ratio * plain

    def trees_pay(self, batch: int, context: float) -> bool:
        """Whether requests running without the draft take it up again at ``batch`` sequences of about
        ``context`` tokens (``Detacher.due``): no veto holds there, and the global estimate, with the
        full model's costs (``_global_pick``), picks trees for the whole batch speculating. Each such
        request recomputes every position it has for the draft, so the lower bound that lets a request
        start with it (``detaches``) is not enough: at the tail of rounds of 4 requests on an H200,
        requests took the draft up again at 3 on it, recomputed their positions and then decoded
        plainly, 5% of the round's time."""
        if self.cfg.veto_span and self.realized.vetoed(batch, self._clock):
            return False
        return self._global_pick(batch, context, batch)[0] > 0

    def settings(self, seq_settings: TreeSettings, nodes: int) -> TreeSettings:
        """A sequence's tree for a choice of ``nodes`` (> 0)."""
        return seq_settings.capped(nodes)

    # --- what was measured ------------------------------------------------------------------

    def observe_tree(self, seq_id: int, tree: CandidateTree, accepted: list[int], asked: int) -> None:
        """A verified tree asked for with at most ``asked`` nodes, and the nodes accepted along its path."""
        if not tree.num_nodes:
            return
        seen = [m for m in self.sizes if m <= asked]
        if seen:
            cut = None if self._cut_levels is None else self._cut_levels[:len(seen)]
            self.observe_accepted(seq_id, accepted_within(tree, accepted, seen, cut), tree.num_nodes)

    def observe_accepted(self, seq_id: int, acc: np.ndarray, nodes: int) -> None:
        """``acc``: what the sizes up to the tree's asked-for one would have accepted, from a verified tree
        of ``nodes`` nodes (``observe_tree``; a recorded trace's replay passes its own)."""
        own = self._seq.get(seq_id)
        if own is None:  # a sequence's own estimate starts from the global one, as its prior
            own = self._seq[seq_id] = Acceptance(self._global.curve(self.sizes, self._levels), self.cfg.seq_weight,
                                                 wider=self._global, shrink=self.cfg.seq_shrink)
            self._own_version += 1
        values = acc.tolist()
        own.update(values)
        self._global.update(values)
        if not self._held[1]:
            # Held on plain decoding (this is a probe's tree): decide again at the next step. Held on
            # trees, the decision stands out its ``hold_steps``: at batch 1 every step verifies a tree,
            # and a whole decision after each one cost the host about 80 us a step against 40 held
            # (``best`` and the curves; one CPU core), where a speculative step takes 1.4-1.8 ms.
            self._own_version += 1
        j = len(acc) - 1
        self.costs.nodes[j] += self.cfg.cost_weight * (min(nodes, self.sizes[j]) - self.costs.nodes[j])

    def observe_realized(self, batch: int, tokens: int, ms: float, draft_ms: float, trees: bool,
                         steps: int = 1) -> None:
        """A step of ``batch`` decoding sequences, no prefill: ``tokens`` committed in ``ms`` of its own
        and ``draft_ms`` of a draft call; ``trees``: it verified trees (``RealizedRates``). ``steps``:
        the steps it stands for (plain steps no request speculates in are sampled: ``Engine._observe``)."""
        u = self._undecided
        if self.decided == u[1]:  # no decision since the last step: its requests run without the draft
            u[0] += steps
        u[1] = self.decided
        self.realized.observe(batch, tokens, ms, draft_ms, trees, self._clock)

    @property
    def _clock(self) -> int:
        """What a veto's span counts: decisions, and steps that took none (requests without the draft
        decide nothing: a veto over their batch would otherwise never lapse)."""
        return self.decided + self._undecided[0]

    def release(self, seq_id: int) -> None:
        """A finished sequence. Its own estimate, if it had one, leaves the batch's sum: a held decision
        ends. One on the global curve changes nothing but the batch's size, which the keys hold (at the
        end of a batch of 128 sequences decoding plainly, one finishing every step cost each step a
        whole decision, 0.1 ms of host time)."""
        if self._seq.pop(seq_id, None) is not None:
            self._own_version += 1

    def diagnostics(self) -> dict:
        """What the policy learned and how its model compares with the steps measured (for benchmarks)."""
        return {"decisions": {str(k): v for k, v in sorted(self.decisions.items())}, "probes": self.probes,
                "switches": dict(sorted(self.switches.items())),
                "vetoes": self.vetoes, "realized": self.realized.rates(),
                "probe_share_modelled": round(float(self._probe_ms / self._spent_ms), 4) if self._spent_ms else 0.0,
                **self.costs.diagnostics()}


def policy_for(target, limits: TreeSettings, table_path: str | None = None,
               config: PolicyConfig = PolicyConfig()) -> AdaptivePolicy:
    """The policy with its cost table: read from ``table_path`` when that file exists and was measured
    with this target's device, dtype, model shape and kernels; else measured now (before any request:
    see ``calibrate``) and written there when a path is given."""
    sizes = tree_sizes(limits)
    if table_path and Path(table_path).is_file():
        table = CostTable.load(table_path)
        here = describe(target)
        if {k: table.meta.get(k) for k in here} == here:
            log.info("cost table read from %s", table_path)
            return AdaptivePolicy(table, limits, config)
        log.warning("cost table %s was measured elsewhere (%s, here %s): measuring again", table_path,
                    table.meta, here)
    grid = CostGrid.default(target.device.type, target.cfg.max_num_seqs, sizes)
    table = calibrate(target, grid)
    if table_path:
        table.save(table_path)
    return AdaptivePolicy(table, limits, config)
