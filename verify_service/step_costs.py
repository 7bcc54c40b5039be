"""What a step costs, as adaptive speculation models it: the calibrated forward, and what it learns
online as steps run (``adaptive.py`` chooses with it).

    cost(n) = forward(B, 1 + n, ctx) + residual(B, n > 0) + draft(S, n)        (n = 0: no draft)

forward: the calibrated ``CostTable``. residual: what a step costs beyond the forward (sampling,
acceptance, compaction, commit), learned per batch bucket for plain and tree steps apart, as
bias-corrected means (the first few steps count about alike before the window takes over).
A chained step (the largest trees, grown on the device behind the last step's acceptance:
``DraftCoordinator.chains``) has no draft call: its draft's device time lands in the step that
verifies its trees, so those steps learn a residual of their own that holds the draft, and the
largest size costs forward + that residual where the drafter chains. At a batch bucket where a tree
step ran but no chained step yet, the guess is optimistic (the tree step without its draft): the
largest trees are tried, and the next step of them, chained, teaches their cost.
draft: the draft's part (extend + tree growth, the link's round trip included), learned online
per batch bucket as a fixed part plus a part per level (levels = 1 + tree depth), by weighted
least squares: a draft call has a fixed cost (launches, the copy back, the link) that a
proportional model would charge a deep tree many times over. Until two depths were seen the
per-level part is the prior's and the fixed part takes the rest. A bucket not measured yet takes
the nearest measured one's residual and draft cost, a tree's residual and the draft's scaled with the
square root of the batch when larger, a plain step's residual flat (``learned_costs.py``). A draft
call that first extends rows plain steps left waiting teaches what such a row costs (from backlogs
of ``BACKLOG_ROWS`` or more); a draft call ten times its expected cost is a stall, not learned from
unless ``OUTLIER_RUN`` come in a row.
"""

from __future__ import annotations

import numpy as np

from verify_service.cost_table import CostTable
from verify_service.learned_costs import DraftCost, batch_bucket, learned_at, nearest_bucket

OUTLIER_FACTOR = 10.0  # a draft call this many times its expected cost is a stall, not its cost ...
OUTLIER_RUN = 3  # ... unless this many come in a row
BACKLOG_ROWS = 256  # a draft call's catch-up of fewer rows is lost in its own noise: not learned per row
EVIDENCE_STEPS = 16  # steps (or draft calls) of a kind at a batch bucket before ``lower_bound_ms`` counts them
DRAFT_VOCAB = 32000  # an EAGLE-3 head's draft vocabulary at most (the Llama 3 heads'), for ``head_weight_fraction``


def head_weight_fraction(meta: dict) -> float | None:
    """An EAGLE-3 head's weights over its target's, from the target's geometry in a cost table's
    ``meta`` (layers L, hidden size h, vocabulary V): one decoder layer (about 12 h^2: its attention
    and an MLP of about 3.5 h), the 3h -> h fc and an LM head over at most ``DRAFT_VOCAB`` tokens,
    against L such layers and the target's LM head. SmolLM2-135M: 0.158; Llama-3-8B: 0.055. None
    where the meta does not give the geometry."""
    try:
        layers, h, vocab = int(meta["layers"]), int(meta["hidden_size"]), int(meta["vocab_size"])
    except (KeyError, TypeError, ValueError):
        return None
    if min(layers, h, vocab) <= 0:
        return None
    layer = 12 * h * h
    return (layer + 3 * h * h + h * min(vocab, DRAFT_VOCAB)) / (layers * layer + h * vocab)


class StepCosts:
    def __init__(self, table: CostTable, config, sizes: tuple[int, ...], levels: np.ndarray):
        """``config``: the policy's (``PolicyConfig``: cost_weight, draft_prior_fraction,
        draft_prior_geometry); ``sizes``/``levels``: the tree sizes the policy picks from and their levels."""
        self.table, self.cfg, self.sizes, self.levels = table, config, sizes, levels
        # The draft's prior cost a level, as a share of a decode forward: the head's weights over the
        # target's where the policy asks for it and the table gives the geometry, else the setting.
        share = head_weight_fraction(table.meta) if config.draft_prior_geometry else None
        self.prior_fraction = config.draft_prior_fraction if share is None else share
        self.nodes = np.array(sizes, dtype=np.float64)  # nodes the trees of each size really held (the policy says)
        self._residual: dict[bool, dict[int, float]] = {False: {}, True: {}}  # tree step? -> bucket -> ms
        self._chained_residual: dict[int, float] = {}  # bucket -> ms: chained steps', the draft's time in it
        self._mass: dict[tuple[str, int], float] = {}  # (kind, bucket) -> the weight its residual's steps gathered
        self.chainable = False  # the drafter chains the largest trees (the coordinator says)
        self.backlog_rows = 0  # rows the draft must extend before its next trees (the coordinator says)
        self._row_ms: float | None = None  # the draft's extend of one such row, learned
        self._draft: dict[int, DraftCost] = {}  # per batch bucket
        self._outliers: dict[int, int] = {}  # per batch bucket: draft calls not learned from, in a row
        self.outliers = 0  # draft calls not learned from (stalls)
        self._forward_cache: dict[tuple[int, int, int], float] = {}
        self.observed: dict[str, list[float]] = {}  # per batch bucket and kind: steps, measured ms, modelled ms
        self.changes = 0  # bumped by what moves a decision much: a draft's cost, the first chained step

    def step_ms(self, batch: int, context: float, nodes: int, speculating: int) -> float:
        """cost(n) for ``batch`` decoding sequences, ``speculating`` of them with a tree of ``nodes``."""
        j = self.sizes.index(nodes) if nodes else -1
        step = self.verify_ms(batch, 1 + (self.nodes[j] if nodes else 0), context)
        if not nodes:
            return step
        unchained = step + self.draft_ms(speculating, self.levels[j], context)
        if self.chainable and nodes == self.sizes[-1] and speculating == batch:
            residual = self._chained_residual.get(batch_bucket(batch))
            if residual is None:  # not measured at this batch: once a tree step ran there, the optimistic
                # guess (no draft); before, the unchained model (a batch whose trees the scheduler
                # splits over several steps measures none: never guessed cheap)
                return step if batch_bucket(batch) in self._residual[True] else unchained
            # Never above the unchained step (the same device work without the draft's call): a few
            # slow first chained steps, learned, would otherwise price the largest trees out for good
            # (no other choice measures them again).
            forward = self.forward(batch, 1 + self.nodes[j], context)
            return min(max(forward + residual, 0.05 * forward), unchained)
        return unchained

    def sizes_ms(self, batch: int, context: float, speculating: int) -> list[float]:
        """``[step_ms(batch, context, m, speculating) for m in sizes]``, the same floats, with what the
        sizes share (the learned residual and draft cost at this batch) read once: a decision prices
        every size, and at batch 1 one decision a step."""
        bucket = batch_bucket(batch)
        residuals = {}  # tree step? -> learned residual (or None), read once each
        near = nearest_bucket(self._draft, batch_bucket(speculating))
        if near is None:
            prior = self._prior_per_level(speculating, context)
        else:
            draft_bucket, scale = near
            fixed, per_level = self._draft[draft_bucket].fit(self._prior_per_level(draft_bucket, context))
        last = len(self.sizes) - 1
        chained = self.chainable and speculating == batch
        out = []
        for j in range(len(self.sizes)):
            tokens = 1 + self.nodes[j]
            forward = self.forward(batch, tokens, context)
            tree = bool(tokens > 1)
            if tree not in residuals:
                residuals[tree] = learned_at(self._residual[tree], bucket, scaled=tokens > 1)
            step = max(forward + (residuals[tree] or 0.0), 0.05 * forward)  # (verify_ms)
            levels = 1 + self.levels[j]
            unchained = step + (prior * levels if near is None else scale * (fixed + per_level * levels))
            if chained and j == last:
                residual = self._chained_residual.get(bucket)
                if residual is None:
                    out.append(step if bucket in self._residual[True] else unchained)
                else:
                    out.append(min(max(forward + residual, 0.05 * forward), unchained))
            else:
                out.append(unchained)
        return out

    def lower_bounds_ms(self, batch: int, context: float) -> list[float]:
        """``[lower_bound_ms(batch, context, m) for m in sizes]``, the same floats, what the sizes
        share read once."""
        bucket = batch_bucket(batch)

        def measured(kind: str) -> bool:
            return self.observed.get(f"{kind} b{bucket}", (0,))[0] >= EVIDENCE_STEPS

        chained = self._chained_residual.get(bucket) if measured("chained tree") else None
        base = self._residual[True].get(bucket, 0.0) if measured("tree") else 0.0
        draft = self._draft.get(bucket) if measured("draft") else None
        if draft is not None:
            fixed, per_level = draft.fit(self._prior_per_level(bucket, context))
        last = len(self.sizes) - 1
        out = []
        for j in range(len(self.sizes)):
            forward = self.forward(batch, 1 + self.nodes[j], context)
            if self.chainable and j == last and chained is not None:
                extra = chained
            else:
                extra = base if draft is None else base + (fixed + per_level * (1 + self.levels[j]))
            out.append(max(forward + extra, 0.05 * forward))
        return out

    def lower_bound_ms(self, batch: int, context: float, nodes: int) -> float:
        """A step of the whole batch with trees of ``nodes`` nodes at its lowest: the calibrated forward,
        plus only what was measured at this batch's own bucket over ``EVIDENCE_STEPS`` steps at least
        (the residual of tree or chained steps, the draft's call). Nothing read from other batches or
        from a few steps: a machine's first tree steps (graphs captured, kernels compiled) ran at a
        third of their later rate on the H200, and a fit of the draft's cost from two calls read 0.19
        ms a level where later calls took 0.06."""
        bucket, j = batch_bucket(batch), self.sizes.index(nodes)
        forward = self.forward(batch, 1 + self.nodes[j], context)

        def measured(kind: str) -> bool:
            return self.observed.get(f"{kind} b{bucket}", (0,))[0] >= EVIDENCE_STEPS

        chained = self._chained_residual.get(bucket) if measured("chained tree") else None
        if self.chainable and nodes == self.sizes[-1] and chained is not None:
            extra = chained
        else:
            extra = self._residual[True].get(bucket, 0.0) if measured("tree") else 0.0
            draft = self._draft.get(bucket) if measured("draft") else None  # (None: calls counted, none learned:
            if draft is not None:  # stalls, or cost_weight 0)
                extra += draft.predict(1 + self.levels[j], self._prior_per_level(bucket, context))
        return max(forward + extra, 0.05 * forward)

    def verify_ms(self, batch: int, tokens: float, context: float) -> float:
        """A step without its draft: the forward plus the learned residual. The residual may be negative
        (the table measured slower than steps run); a step is never free."""
        forward = self.forward(batch, tokens, context)
        # Scaled up to an unseen larger batch for trees (taken flat, a tree there would look cheaper than
        # it is), never for plain decoding: its residual is the step's, not the sequences' (scaled, batch
        # 1's 0.4 ms read 6 ms at batch 16, and trees looked faster than plain decoding there).
        residual = learned_at(self._residual[bool(tokens > 1)], batch_bucket(batch), scaled=tokens > 1)
        return max(forward + (residual or 0.0), 0.05 * forward)

    def draft_ms(self, speculating: int, levels: float, context: float) -> float:
        """The draft's part of a step with trees of ``levels`` levels for ``speculating`` sequences."""
        near = nearest_bucket(self._draft, batch_bucket(speculating))
        if near is None:
            return self._prior_per_level(speculating, context) * (1 + levels)
        bucket, scale = near
        return scale * self._draft[bucket].predict(1 + levels, self._prior_per_level(bucket, context))

    def _prior_per_level(self, speculating: int, context: float) -> float:
        return self.prior_fraction * self.forward(speculating, 1, context)

    def forward(self, batch: int, tokens: float, context: float) -> float:
        """The table's forward ms, memoised on (batch, tokens, context to 128): asked every step."""
        key = (batch, round(tokens), int(context) >> 7)
        ms = self._forward_cache.get(key)
        if ms is None:
            if len(self._forward_cache) > 4096:
                self._forward_cache.clear()
            ms = self._forward_cache[key] = self.table.forward_ms(batch, round(tokens), (key[2] << 7) + 64)
        return ms

    def backlog_ms(self) -> float:
        """What extending the rows waiting for the draft costs (learned; 0 until a call measured it)."""
        return self.backlog_rows * (self._row_ms or 0.0)

    def observe_step(self, batch: int, nodes: int, context: float, ms: float, chained: bool = False) -> None:
        """A decode (``nodes`` = 0) or tree step without prefill, its draft call's part excluded, took
        ``ms``. ``chained``: its trees were grown on the device behind the last step's acceptance (the
        draft's device time is in ``ms``), all of them the largest size."""
        if not self.cfg.cost_weight:
            return
        key = (batch_bucket(batch), nodes > 0)
        chained = chained and nodes > 0
        kind = "chained tree" if chained else "tree" if nodes else "plain"
        modelled = self.step_ms(batch, context, self.sizes[-1], batch) if chained else \
            self.verify_ms(batch, 1 + nodes, context)
        seen = self.observed.setdefault(f"{kind} b{key[0]}", [0, 0.0, 0.0])
        seen[0] += 1
        seen[1] += ms
        seen[2] += modelled
        residual = ms - self.forward(batch, 1 + nodes, context)
        learned = self._chained_residual if chained else self._residual[key[1]]
        old = learned.get(key[0])
        # A bias-corrected mean: the k-th step weighs w / (1 - (1 - w)^k), so the first few count about
        # alike (a running mean) before the window takes over. Counted fully and then at w, one slow
        # first chained step at batch 1 (4.0 ms where they run 2.0) priced the largest trees out for good.
        mass = self._mass.get((kind, key[0]), 0.0)
        mass += self.cfg.cost_weight * (1.0 - mass)
        self._mass[(kind, key[0])] = mass
        learned[key[0]] = residual if old is None else old + self.cfg.cost_weight / mass * (residual - old)
        if chained and old is None:
            self.changes += 1  # the largest trees' cost changed model: decisions held on the old one end

    def observe_draft(self, speculating: int, levels: int, ms: float, backlog: int = 0) -> None:
        """The draft's part of a step that asked ``speculating`` trees of ``levels`` levels took ``ms``;
        ``backlog``: rows of earlier plain steps it extended first (such a call is no tree's cost: only
        counted in the diagnostics)."""
        seen = self.observed.setdefault(f"draft{' after plain steps' if backlog else ''} b{batch_bucket(speculating)}",
                                        [0, 0.0, 0.0])
        seen[0] += 1
        seen[1] += ms
        seen[2] += backlog
        bucket = batch_bucket(speculating)
        if backlog >= BACKLOG_ROWS and self.cfg.cost_weight:  # beyond its trees' cost, per row caught up
            row_ms = max(ms - self.draft_ms(speculating, levels, 1024.0), 0.0) / backlog
            self._row_ms = row_ms if self._row_ms is None else self._row_ms + self.cfg.cost_weight * (
                row_ms - self._row_ms)
        if not self.cfg.cost_weight or backlog:
            return
        expected = self.draft_ms(speculating, levels, 1024.0)  # the learned cost, or the prior before one
        if ms > OUTLIER_FACTOR * expected and self._outliers.get(bucket, 0) < OUTLIER_RUN:
            # A stall (a graph captured or a kernel compiled in the draft, a hiccup of the link), not the
            # draft's cost: learned, it would stop every later tree (and the probes that could correct
            # it). As many in a row as OUTLIER_RUN are a real change, and learned.
            self._outliers[bucket] = self._outliers.get(bucket, 0) + 1
            self.outliers += 1
            return
        self._outliers[bucket] = 0
        self.changes += 1
        self._draft.setdefault(bucket, DraftCost(self.cfg.cost_weight)).update(1 + levels, ms)

    def diagnostics(self) -> dict:
        """What was learned, and the model against the steps measured (for benchmarks)."""
        return {"draft_outliers": self.outliers,
                "backlog_row_us": round(float(self._row_ms) * 1e3, 4) if self._row_ms is not None else None,
                "residual_ms": {**{f"{'tree' if t else 'plain'} b{b}": round(float(v), 4)
                                   for t, by_bucket in self._residual.items() for b, v in by_bucket.items()},
                                **{f"chained tree b{b}": round(float(v), 4)
                                   for b, v in self._chained_residual.items()}},
                "draft_ms": {f"b{b}": dict(zip(("fixed", "per_level"), (round(float(v), 4) for v in
                                                     cost.fit(self._prior_per_level(b, 1024)))))
                             for b, cost in self._draft.items()},
                "steps": {k: {"steps": int(n), "measured_ms": round(float(m / n), 4), "modelled_ms": round(float(e / n), 4)}
                          for k, (n, m, e) in self.observed.items() if not k.startswith("draft")},
                "draft_calls": {k: {"calls": int(n), "ms": round(float(m / n), 4), "backlog_rows": round(float(e / n), 1)}
                                for k, (n, m, e) in self.observed.items() if k.startswith("draft")}}
