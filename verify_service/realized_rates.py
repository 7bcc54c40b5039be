"""What speculation really delivered, per batch bucket: a guard over adaptive speculation's cost model.

The model prices a tree step from a calibrated forward, learned residuals and a learned draft cost,
extrapolated to batches it has not measured; at large batches its errors are costly (measured on an
H100 with SmolLM2: chained trees chosen at batch 16 ran at 0.57x target-only; at batch 128 a probe's
catch-up of 16K waiting rows took 35 ms, the time of 27 plain steps). Here nothing is modelled:
each step without prefill adds its committed tokens and its wall time to exponentially weighted sums
per batch bucket, for plain steps and for steps that verified trees apart. Every draft call is
speculation's cost, whatever step made it (a plain step leaving plain decoding pays the draft's
catch-up and its first trees). Where steps with trees were measured slower per token than plain
steps at a bucket (``MIN_STEPS`` of each), trees are vetoed there and at every larger batch (a
larger batch pays more per tree token and gains no more from one) for ``span`` decisions; the veto
then lapses and that bucket's tree measurements start over, so acceptance or costs that changed are
found again at the price of a few tree steps. Small buckets (below ``from_bucket``) are left to the
per-sequence model: there one sequence's hard passage would veto trees that pay for the others.
"""

from __future__ import annotations

from verify_service.learned_costs import batch_bucket

MIN_STEPS = 4  # steps of each kind at a bucket before its rates are compared


class RealizedRates:
    def __init__(self, window: int = 64, span: int = 4096, from_bucket: int = 8):
        """``window``: about how many recent steps the sums hold; ``span``: decisions a veto lasts
        after the last tree step measured at its bucket; ``from_bucket``: the smallest bucket vetoed."""
        self._keep = 1.0 - 1.0 / max(window, 1)
        self.span, self.from_bucket = span, from_bucket
        self._plain: dict[int, list[float]] = {}  # bucket -> [tokens, ms, steps]
        self._trees: dict[int, list[float]] = {}  # bucket -> [tokens, ms, steps, decision of the last]

    def observe(self, batch: int, tokens: int, ms: float, draft_ms: float, trees: bool, now: int) -> None:
        """A step of ``batch`` decoding sequences (no prefill) committed ``tokens`` in ``ms``, besides
        ``draft_ms`` in a draft call; ``trees``: it verified trees; ``now``: the policy's decisions so far."""
        bucket = batch_bucket(batch)
        if trees:
            self._add(self._trees, bucket, tokens, ms + draft_ms, now)
        else:
            self._add(self._plain, bucket, tokens, ms, None)
            if draft_ms > 0.0:  # leaving plain decoding: the catch-up and the first trees
                self._add(self._trees, bucket, 0, draft_ms, now, step=False)

    def _add(self, sums: dict, bucket: int, tokens: int, ms: float, now: int | None, step: bool = True) -> None:
        s = sums.setdefault(bucket, [0.0, 0.0, 0, now])
        s[0] = s[0] * self._keep + tokens
        s[1] = s[1] * self._keep + ms
        s[2] += step
        if now is not None:
            s[3] = now

    def vetoed(self, batch: int, now: int) -> bool:
        """Whether trees were measured slower than plain decoding at this batch's bucket or a smaller
        one (from ``from_bucket``) within the last ``span`` decisions."""
        bucket = batch_bucket(batch)
        if bucket < self.from_bucket:
            return False
        for b in [b for b in self._trees if self.from_bucket <= b <= bucket]:
            tokens, ms, steps, last = self._trees[b]
            plain = self._plain.get(b)
            if steps < MIN_STEPS or plain is None or plain[2] < MIN_STEPS or ms <= 0.0 or plain[1] <= 0.0:
                continue
            if now - last >= self.span:  # lapsed: this bucket's trees are measured afresh
                del self._trees[b]
                continue
            if tokens / ms < plain[0] / plain[1]:
                return True
        return False

    def rates(self) -> dict:
        """tokens per ms per bucket, plain and with trees (for diagnostics)."""
        out = {}
        for name, sums in (("plain", self._plain), ("trees", self._trees)):
            for b, s in sorted(sums.items()):
                if s[1] > 0:
                    out[f"{name} b{b}"] = {"tokens_per_ms": round(s[0] / s[1], 3), "steps": int(s[2])}
        return out
