"""Adaptive speculation: each step, the tree size (or plain decoding) that gives the batch the most
tokens per second, from measured costs and the acceptance its sequences have shown.

For B decoding sequences, S of them speculating, and trees of at most n nodes::

    tokens(n) = sum_i (1 + a_i(n)) + (B - S)        a_i(n): sequence i's expected accepted nodes
    cost(n)   = forward(B, 1 + n, ctx) + residual(B, n > 0) + draft(S, n)        (n = 0: no draft)
    choice    = argmax_n tokens(n) / cost(n); a tree must beat plain decoding by ``margin``

forward: the calibrated ``CostTable``. residual: what a step costs beyond the forward (sampling,
acceptance, compaction, commit), learned online per batch bucket for plain and tree steps apart.
draft: the draft's part (extend + tree growth, the link's round trip included), learned online
per batch bucket as a fixed part plus a part per level (levels = 1 + tree depth), by weighted
least squares: a draft call has a fixed cost (launches, the copy back, the link) that a
proportional model would charge a deep tree many times over. Until two depths were seen the
per-level part is the prior's and the fixed part takes the rest. A bucket not measured yet takes
the nearest measured one's residual and draft cost, scaled with the batch when larger.

Acceptance: the best m nodes of a tree (by draft score) are themselves the tree of size m
(``TreeSettings.capped``) and closed under ancestors, so a verified tree of n nodes shows what every
size m <= n would have accepted: under greedy verification exactly the leading nodes of the
accepted path ranking among the best m (under sampling, an estimate). Each sequence keeps its own
means per size (``Acceptance``), seeded from the global ones. Above the largest size a sequence
has seen, its estimate follows the global one's gains up to the largest size the global one rests on
ten trees or more for; sizes above that are guessed optimistically (the last gain per node carried
on), so a larger tree is tried when it might pay; and every ``probe_every`` decisions the next size up is tried once, so
acceptance that rises is found even where the guess says no. From plain decoding the probe is the size
the global estimate would pick for the batch (the smallest tree where that is plain decoding too): a
sequence's own estimate of a size moves only with trees of that size or larger, so after an unlucky
stretch at the largest tree, probes of the smallest one would never bring it back (measured at batch 1:
plain decoding in 83% of the steps where the fixed tree ran 1.47x target-only). A decision is reused
for up to ``hold_steps`` steps while the batch, its context (to 256 tokens) and what was learned
(acceptance, draft costs; not the per-step residuals) stay the same. A probe waits while
the probes' extra cost (modelled: the probe's step against the best one) would exceed
``probe_share`` of the steps' modelled time over about the last ``probe_window`` decisions: at a
batch where trees cost far more than they bring, probing stays a few percent of the time instead of
a fixed fraction of the steps. (Counted since start, the time of a long stretch where trees were the
best choice, and no probes ran, would fund a burst of probes after the batch grew: measured, 5 to 15
tree steps per 125 at batch 16 after batches 1 and 4, 7% of the time.)
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.tree_settings import TreeSettings, tree_sizes
from runtime.tree import CandidateTree
from verify_service.cost_table import CostGrid, CostTable, calibrate, describe

log = logging.getLogger(__name__)


OUTLIER_FACTOR = 10.0  # a draft call this many times its expected cost is a stall, not its cost ...
OUTLIER_RUN = 3  # ... unless this many come in a row


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    prior_acceptance: float = 0.6  # before any tree is seen: node at depth d accepted with p^d
    seq_weight: float = 0.2  # EWMA weight of one tree in a sequence's own estimate
    global_weight: float = 0.02  # ... in the global estimate (the prior of new sequences)
    cost_weight: float = 0.05  # EWMA weight of one measured step in the learned costs (0: the table alone)
    margin: float = 0.02  # a tree must beat plain decoding by this fraction (noise in the estimates)
    probe_every: int = 32  # decisions between probes of the next size up (0: never)
    probe_share: float = 0.03  # probes may cost at most this share of the steps' (modelled) time ...
    probe_window: int = 256  # ... over about this many recent decisions (an exponential window)
    hold_steps: int = 8  # a decision is reused this many steps while nothing but step times was learned
    draft_prior_fraction: float = 0.15  # draft cost per level before one is measured, x a decode forward


def accepted_within(tree: CandidateTree, accepted: list[int], sizes) -> np.ndarray:
    """For each size m: nodes of the accepted path (node indices, root excluded, in path order) the
    tree's best min(m, N) nodes hold, i.e. what the tree of size m would have accepted.

    Best = highest cumulative draft log-prob; ties to the shallower, then the earlier node (the
    dynamic builder's order). A path stops at its first node outside the best m."""
    n = tree.num_nodes
    order = np.lexsort((np.arange(n), tree.depths, -tree.log_probs))  # last key is the primary one
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    worst = np.maximum.accumulate(rank[np.asarray(accepted, dtype=np.int64)]) if accepted else np.zeros(0)
    return (worst[None, :] < np.minimum(sizes, n)[:, None]).sum(axis=1).astype(np.float64)


class Acceptance:
    """Expected accepted nodes for each tree size, from the trees seen: an exponentially weighted
    mean per size (bias-corrected, so the first tree of a size counts fully; a prior only while no
    tree was seen). Above the largest size seen, the last gain per node is carried on: acceptance
    grows concavely with the size, so the guess is optimistic, the policy tries a larger tree when
    the guess says it pays, and that tree corrects it. A tree holds every smaller one (the best m
    nodes), so the curve never decreases."""

    def __init__(self, prior: np.ndarray, weight: float, wider: Acceptance | None = None):
        self.prior, self.weight = prior, weight
        self.wider = wider  # a sequence's: the global estimate, whose gains carry it above its own sizes
        self._sum = np.zeros_like(prior)  # EWMA from zero ...
        self._mass = np.zeros_like(prior)  # ... and the weight it has gathered: mean = sum / mass
        self.seen = -1  # index of the largest size seen
        self.updates = 0
        self._curve: tuple | None = None  # (the wider one's updates, curve), until the next update

    def update(self, acc: np.ndarray) -> None:
        """``acc``: what sizes 0..len(acc)-1 would have accepted in one tree."""
        j, w = len(acc), self.weight
        self._sum[:j] += w * (acc - self._sum[:j])
        self._mass[:j] += w * (1.0 - self._mass[:j])
        self.seen = max(self.seen, j - 1)
        self.updates += 1
        self._curve = None

    def trusted_reach(self, trees: int = 10) -> int:
        """Index of the largest size whose estimate holds at least the weight of ``trees`` trees (-1:
        none). The weight per size never grows with the size: every tree updates a prefix of sizes."""
        return int(np.count_nonzero(self._mass >= 1.0 - (1.0 - self.weight) ** trees)) - 1

    def curve(self, sizes, levels: np.ndarray) -> np.ndarray:
        """[len(sizes)] expected accepted nodes, the guess above the largest size seen included."""
        stamp = self.wider.updates if self.wider is not None else 0
        if self._curve is None or self._curve[0] != stamp:
            self._curve = (stamp, self._estimate(np.asarray(sizes, dtype=np.float64), levels))
        return self._curve[1]

    def _estimate(self, s: np.ndarray, levels: np.ndarray) -> np.ndarray:
        top = self.seen
        if top < 0:
            return self.prior.copy()
        v = np.zeros_like(self.prior)
        v[:top + 1] = np.maximum.accumulate(self._sum[:top + 1] / self._mass[:top + 1])
        wider = self.wider
        reach = wider.trusted_reach() if wider is not None else -1
        if reach > top:
            # Sizes the batch's trees reached and this sequence's did not: its own estimate at its
            # largest size plus the gain the global estimate measured from there, up to the largest size
            # it rests on enough trees for (a sequence that only saw small trees would otherwise carry
            # its early, steep gain per node on to the largest tree: at a large batch, where only small
            # trees were tried, that guess started large trees that cost far more than they brought).
            # Above that, the optimistic guess: one unlucky early tree must not stop the exploring.
            g = wider.curve(s, levels)
            v[top + 1:reach + 1] = v[top] + np.maximum(g[top + 1:reach + 1] - g[top], 0.0)
            top = reach
        slope = v[0] / s[0] if top == 0 else (v[top] - v[top - 1]) / (s[top] - s[top - 1])
        v[top + 1:] = np.maximum(v[top] + slope * (s[top + 1:] - s[top]), v[top])
        return np.minimum(v, levels)


def _bucket(batch: int) -> int:
    """Learned costs are kept per power-of-two batch bucket."""
    return 1 << max(0, int(batch) - 1).bit_length()


def _nearest(buckets, bucket: int) -> tuple[int, float] | None:
    """The learned bucket to read a cost at ``bucket`` from, and the factor to scale it by: itself
    (1), else the nearest seen one, scaled up with the batch when ``bucket`` is larger (a cost that
    grows with the sequences: taking it flat would let a larger batch look as cheap as a smaller one
    and start a tree it cannot afford); None when no bucket was seen."""
    if bucket in buckets:
        return bucket, 1.0
    if not buckets:
        return None
    near = min(buckets, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), -b))
    return near, bucket / near if bucket > near else 1.0


def _learned(by_bucket: dict[int, float], bucket: int) -> float | None:
    """A cost learned per batch bucket, at ``bucket`` (``_nearest``; a negative one is not scaled)."""
    near = _nearest(by_bucket, bucket)
    if near is None:
        return None
    value = by_bucket[near[0]]
    return value * near[1] if value > 0 else value


class DraftCost:
    """A draft call's milliseconds against its levels: fixed + per_level x levels, from exponentially
    weighted means of the observations (levels, ms) and their products (the first observation
    counts fully)."""

    def __init__(self, weight: float):
        self.weight = weight
        self._means: np.ndarray | None = None  # E[L], E[ms], E[L^2], E[L ms]

    def update(self, levels: float, ms: float) -> None:
        x = np.array([levels, ms, levels * levels, levels * ms])
        self._means = x if self._means is None else self._means + self.weight * (x - self._means)

    def fit(self, prior_per_level: float) -> tuple[float, float]:
        """(fixed, per_level): the least-squares line where the levels seen differ, else the prior's
        slope through the mean; neither part negative."""
        level, ms, level_sq, level_ms = self._means
        var = level_sq - level * level
        per_level = (level_ms - level * ms) / var if var > 0.25 else prior_per_level
        per_level = min(max(per_level, 0.0), ms / level)  # a fixed part of zero at most: all per level
        return ms - per_level * level, per_level

    def predict(self, levels: float, prior_per_level: float) -> float:
        fixed, per_level = self.fit(prior_per_level)
        return fixed + per_level * levels


class AdaptivePolicy:
    def __init__(self, table: CostTable, limits: TreeSettings, config: PolicyConfig = PolicyConfig()):
        self.table, self.limits, self.cfg = table, limits, config
        self.sizes = tree_sizes(limits)
        self._levels = np.array([limits.capped(m).depth for m in self.sizes], dtype=np.float64)
        p = config.prior_acceptance
        prior = np.array([sum(p ** d for d in range(1, int(lv) + 1)) for lv in self._levels])
        self._global = Acceptance(prior, config.global_weight)
        self._seq: dict[int, Acceptance] = {}
        self._nodes = np.array(self.sizes, dtype=np.float64)  # nodes the trees of each size really held
        self._residual: dict[bool, dict[int, float]] = {False: {}, True: {}}  # tree step? -> bucket -> ms
        self._draft: dict[int, DraftCost] = {}  # per batch bucket
        self._outliers: dict[int, int] = {}  # per batch bucket: draft calls not learned from, in a row
        self.outliers = 0  # draft calls not learned from (stalls)
        self._forward_cache: dict[tuple[int, int, int], float] = {}
        self.decisions: Counter[int] = Counter()  # steps per choice (0: plain decoding)
        self.choice = 0
        self.probes = 0
        self._since_probe = 0  # decisions since the last probe
        self._spent_ms = 0.0  # modelled cost of the chosen steps (recent ones: see _account) ...
        self._probe_ms = 0.0  # ... and what the probes added to it
        self._keep = 1.0 - 1.0 / max(config.probe_window, 1)
        self.observed: dict[str, list[float]] = {}  # per batch bucket and kind: steps, measured ms, modelled ms
        self._version = 0  # bumped by what moves the decision much: a tree's acceptance, a draft's cost
        self._held: list = [None, 0, 0]  # (batch, context / 256, speculating, budget, version), best, uses
        self._quick = None  # (caller's key, version, plain step's modelled ms) while plain decoding is held
        self.last_held = False  # the latest decision was a held plain one (choose_held)

    # --- the decision ---------------------------------------------------------------------------

    def choose(self, batch: int, context: float, seq_ids: list[int], budgets: list[int], quick_key=None) -> int:
        """Nodes per tree for the next step (0: plain decoding). ``batch``: the sequences that decode
        next step; ``seq_ids``/``budgets``: those that may speculate, and the most nodes each may have.
        ``quick_key``: the caller's cheap summary of the step (see ``choose_held``)."""
        key = (batch, int(context) >> 8, len(seq_ids), min(budgets, default=0), self._version)
        if key != self._held[0] or self._held[2] >= self.cfg.hold_steps:
            self._held = [key, self.best(batch, context, seq_ids, budgets), 0]
        self._held[2] += 1
        self.choice = self._probe(self._held[1], batch, context, len(seq_ids))
        self.decisions[self.choice] += 1
        plain = self.step_ms(batch, context, 0, len(seq_ids)) if self.choice == 0 and quick_key is not None else None
        self._quick = None if plain is None else (quick_key, self._version, plain)
        self.last_held = False
        return self.choice

    def choose_held(self, quick_key) -> bool:
        """Plain decoding again, without looking at the sequences: True (and counted as a decision)
        when the latest decision was plain for the same ``quick_key`` (the caller's cheap summary:
        sequences running, sequences fed), nothing was learned since, it is held fewer than
        ``hold_steps`` steps and no probe is due. A plain step then costs the policy a few
        comparisons; False: call ``choose``."""
        q = self._quick
        if q is None or q[0] != quick_key or q[1] != self._version or self._held[2] >= self.cfg.hold_steps \
                or (self.cfg.probe_every and self._since_probe + 1 >= self.cfg.probe_every):
            return False
        self._held[2] += 1
        self._since_probe += 1
        self._account(q[2])
        self.choice, self.last_held = 0, True
        self.decisions[0] += 1
        return True

    def best(self, batch: int, context: float, seq_ids: list[int], budgets: list[int]) -> int:
        """argmax over {0} + sizes of expected tokens per ms (no probing, no counting)."""
        if not seq_ids:
            return 0
        tokens = batch + self._accepted(seq_ids, budgets).sum(axis=0)  # [len(sizes)]
        return self._fastest(batch, context, len(seq_ids), tokens, self.cfg.margin)

    def _fastest(self, batch: int, context: float, speculating: int, tokens, margin: float) -> int:
        """The size whose expected ``tokens`` [len(sizes)] per ms beat plain decoding's by ``margin``
        most; 0 where none does."""
        rates = [t / self.step_ms(batch, context, m, speculating) for t, m in zip(tokens, self.sizes)]
        i = int(np.argmax(rates))
        return self.sizes[i] if rates[i] > batch / self.step_ms(batch, context, 0, speculating) * (1 + margin) else 0

    def expected_tokens(self, batch: int, seq_ids: list[int], budgets: list[int], nodes: int) -> float:
        """tokens(n): every decoding sequence commits one, a speculating one its expected accepted too."""
        return batch + sum(self.expected_accepted(s, min(nodes, b)) for s, b in zip(seq_ids, budgets))

    def _accepted(self, seq_ids: list[int], budgets: list[int]) -> np.ndarray:
        """[S, len(sizes)]: a_i(min(size, budget_i)), each sequence's curve computed once."""
        rows = np.stack([self._seq.get(s, self._global).curve(self.sizes, self._levels) for s in seq_ids])
        for i, b in enumerate(budgets):
            if b < self.sizes[-1]:  # a request's own smaller tree caps what larger choices bring it
                rows[i] = np.interp(np.minimum(self.sizes, b), (0, *self.sizes), (0.0, *rows[i]))
        return rows

    def expected_accepted(self, seq_id: int, nodes: int) -> float:
        """a_i(n), linear between the sizes (a(0) = 0)."""
        a = self._seq.get(seq_id, self._global).curve(self.sizes, self._levels)
        return float(np.interp(nodes, (0, *self.sizes), (0.0, *a)))

    def step_ms(self, batch: int, context: float, nodes: int, speculating: int) -> float:
        """cost(n) for ``batch`` decoding sequences, ``speculating`` of them with a tree of ``nodes``."""
        j = self.sizes.index(nodes) if nodes else -1
        step = self._verify_ms(batch, 1 + (self._nodes[j] if nodes else 0), context)
        return step + self.draft_ms(speculating, self._levels[j], context) if nodes else step

    def _verify_ms(self, batch: int, tokens: float, context: float) -> float:
        """A step without its draft: the forward plus the learned residual. The residual may be negative
        (the table measured slower than steps run); a step is never free."""
        forward = self._forward(batch, tokens, context)
        residual = _learned(self._residual[bool(tokens > 1)], _bucket(batch))
        return max(forward + (residual or 0.0), 0.05 * forward)

    def draft_ms(self, speculating: int, levels: float, context: float) -> float:
        """The draft's part of a step with trees of ``levels`` levels for ``speculating`` sequences."""
        near = _nearest(self._draft, _bucket(speculating))
        if near is None:
            return self._prior_per_level(speculating, context) * (1 + levels)
        bucket, scale = near
        return scale * self._draft[bucket].predict(1 + levels, self._prior_per_level(bucket, context))

    def _prior_per_level(self, speculating: int, context: float) -> float:
        return self.cfg.draft_prior_fraction * self._forward(speculating, 1, context)

    def _forward(self, batch: int, tokens: float, context: float) -> float:
        """The table's forward ms, memoised on (batch, tokens, context to 128): asked every step."""
        key = (batch, round(tokens), int(context) >> 7)
        ms = self._forward_cache.get(key)
        if ms is None:
            if len(self._forward_cache) > 4096:
                self._forward_cache.clear()
            ms = self._forward_cache[key] = self.table.forward_ms(batch, round(tokens), (key[2] << 7) + 64)
        return ms

    def _probe(self, best: int, batch: int, context: float, speculating: int) -> int:
        """``best``, or the next size up when a probe is due and the probes' budget allows it."""
        every = self.cfg.probe_every
        best_ms = self.step_ms(batch, context, best, speculating) if speculating else 0.0
        self._since_probe += 1
        if not every or self._since_probe < every or best == self.sizes[-1] or not speculating:
            self._account(best_ms)
            return best
        probe = self._global_best(batch, context, speculating) if best == 0 else \
            self.sizes[self.sizes.index(best) + 1]
        probe_ms = self.step_ms(batch, context, probe, speculating)
        extra = max(probe_ms - best_ms, 0.0)
        if self._probe_ms + extra > self.cfg.probe_share * (self._spent_ms + probe_ms):
            self._account(best_ms)
            # Still due: tried again a quarter period on. (Not at the next decision: while it is due,
            # every plain step would take the whole decision, not the held one: at batch 16, 0.1 to
            # 0.2 ms of a 1.4 ms step, H200.)
            self._since_probe = every - max(1, every // 4)
            return best
        self._since_probe, self.probes = 0, self.probes + 1
        self._account(probe_ms, extra)
        return probe

    def _account(self, ms: float, probe_extra: float = 0.0) -> None:
        """A decision's modelled step time (and a probe's extra part of it), into the probes' budget:
        sums that decay by 1 / probe_window a decision, so the budget reflects the recent steps."""
        self._spent_ms = self._spent_ms * self._keep + ms
        self._probe_ms = self._probe_ms * self._keep + probe_extra

    def _global_best(self, batch: int, context: float, speculating: int) -> int:
        """The size the global estimate picks for ``speculating`` of ``batch`` sequences; the smallest
        where that is plain decoding."""
        tokens = batch + speculating * self._global.curve(self.sizes, self._levels)
        return self._fastest(batch, context, speculating, tokens, 0.0) or self.sizes[0]

    def settings(self, seq_settings: TreeSettings, nodes: int) -> TreeSettings:
        """A sequence's tree for a choice of ``nodes`` (> 0)."""
        return seq_settings.capped(nodes)

    # --- what was measured ------------------------------------------------------------------

    def observe_tree(self, seq_id: int, tree: CandidateTree, accepted: list[int], asked: int) -> None:
        """A verified tree asked for with at most ``asked`` nodes, and the nodes accepted along its path."""
        if not tree.num_nodes:
            return
        seen = [j for j, m in enumerate(self.sizes) if m <= asked]
        if not seen:
            return
        acc = accepted_within(tree, accepted, [self.sizes[j] for j in seen])
        own = self._seq.get(seq_id)
        if own is None:  # a sequence's own estimate starts from the global one, as its prior
            own = self._seq[seq_id] = Acceptance(self._global.curve(self.sizes, self._levels), self.cfg.seq_weight,
                                                 wider=self._global)
        own.update(acc)
        self._global.update(acc)
        self._version += 1
        j = seen[-1]
        self._nodes[j] += self.cfg.cost_weight * (min(tree.num_nodes, self.sizes[j]) - self._nodes[j])

    def observe_step(self, batch: int, nodes: int, context: float, ms: float) -> None:
        """A decode (``nodes`` = 0) or tree step without prefill, its draft's part excluded, took ``ms``."""
        if not self.cfg.cost_weight:
            return
        key = (_bucket(batch), nodes > 0)
        modelled = self._verify_ms(batch, 1 + nodes, context)
        seen = self.observed.setdefault(f"{'tree' if nodes else 'plain'} b{key[0]}", [0, 0.0, 0.0])
        seen[0] += 1
        seen[1] += ms
        seen[2] += modelled
        residual = ms - self._forward(batch, 1 + nodes, context)
        learned = self._residual[key[1]]
        old = learned.get(key[0])
        learned[key[0]] = residual if old is None else old + self.cfg.cost_weight * (residual - old)

    def observe_draft(self, speculating: int, levels: int, ms: float, backlog: int = 0) -> None:
        """The draft's part of a step that asked ``speculating`` trees of ``levels`` levels took ``ms``;
        ``backlog``: rows of earlier plain steps it extended first (such a call is no tree's cost: only
        counted in the diagnostics)."""
        seen = self.observed.setdefault(f"draft{' after plain steps' if backlog else ''} b{_bucket(speculating)}",
                                        [0, 0.0, 0.0])
        seen[0] += 1
        seen[1] += ms
        seen[2] += backlog
        if not self.cfg.cost_weight or backlog:
            return
        bucket = _bucket(speculating)
        expected = self.draft_ms(speculating, levels, 1024.0)  # the learned cost, or the prior before one
        if ms > OUTLIER_FACTOR * expected and self._outliers.get(bucket, 0) < OUTLIER_RUN:
            # A stall (a graph captured or a kernel compiled in the draft, a hiccup of the link), not the
            # draft's cost: learned, it would stop every later tree (and the probes that could correct
            # it). As many in a row as OUTLIER_RUN are a real change, and learned.
            self._outliers[bucket] = self._outliers.get(bucket, 0) + 1
            self.outliers += 1
            return
        self._outliers[bucket] = 0
        self._version += 1
        self._draft.setdefault(bucket, DraftCost(self.cfg.cost_weight)).update(1 + levels, ms)

    def release(self, seq_id: int) -> None:
        self._seq.pop(seq_id, None)
        self._version += 1

    def diagnostics(self) -> dict:
        """What the policy learned and how its model compares with the steps measured (for benchmarks)."""
        return {"decisions": {str(k): v for k, v in sorted(self.decisions.items())}, "probes": self.probes,
                "draft_outliers": self.outliers,
                "probe_share_modelled": round(float(self._probe_ms / self._spent_ms), 4) if self._spent_ms else 0.0,
                "residual_ms": {f"{'tree' if t else 'plain'} b{b}": round(float(v), 4)
                                for t, by_bucket in self._residual.items() for b, v in by_bucket.items()},
                "draft_ms": {f"b{b}": dict(zip(("fixed", "per_level"), (round(float(v), 4) for v in
                                                     cost.fit(self._prior_per_level(b, 1024)))))
                             for b, cost in self._draft.items()},
                "steps": {k: {"steps": int(n), "measured_ms": round(float(m / n), 4), "modelled_ms": round(float(e / n), 4)}
                          for k, (n, m, e) in self.observed.items() if not k.startswith("draft")},
                "draft_calls": {k: {"calls": int(n), "ms": round(float(m / n), 4), "backlog_rows": round(float(e / n), 1)}
                                for k, (n, m, e) in self.observed.items() if k.startswith("draft")}}


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
