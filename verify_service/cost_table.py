"""What one target forward costs on this engine, measured: the table adaptive speculation reads.

    table = calibrate(target, CostGrid.default(...))     # times target.runner.step on a grid
    table.save("costs.json"); table = CostTable.load("costs.json")
    table.forward_ms(batch=8, tokens=60, context=3000)   # interpolated between grid points

Grid point (b, q, c): b sequences, each with q new tokens after c cached ones: q = 1 is a decode
step, q > 1 a verification step over a chain of q - 1 nodes below the root (the deepest tree of
that size), logits for every row. It runs through the runner exactly as the engine's steps do
(replaying a CUDA graph where the runner has one for that step) and ends in one device-to-host
copy, as a step does. Between grid points the cost is interpolated linearly along each axis and
beyond the last point extrapolated linearly from the last two: a step's cost is close to affine in
the batch and the context (weights read once, KV read per token of context) and in the tokens.
"""

from __future__ import annotations

import bisect
import functools
import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from runtime.block_manager import blocks_for
from runtime.step_layout import SeqChunk

log = logging.getLogger(__name__)
UNAFFORDABLE_MS = 1e6  # the cost of a grid point that ran out of memory


def interp1(xs, ys, x: float):
    """Piecewise-linear ys(x) through the points (xs ascending), extrapolated linearly from the end
    pairs; a single point is a constant. ``ys`` may carry more axes after the first: each is
    interpolated alike."""
    if not isinstance(ys, np.ndarray) or ys.dtype != np.float64:
        ys = np.asarray(ys, dtype=np.float64)
    if len(xs) == 1:
        return ys[0]
    # (numpy's searchsorted and clip on one scalar cost microseconds: asked as a batch changes, per step)
    i = min(max(bisect.bisect_left(xs, x) - 1, 0), len(xs) - 2)
    x0, x1 = xs[i], xs[i + 1]
    return ys[i] + (ys[i + 1] - ys[i]) * ((x - x0) / (x1 - x0))


@dataclass(frozen=True)
class CostTable:
    """Milliseconds of one target forward: ``ms[c, b, q]`` at contexts[c], batches[b], tokens[q]."""

    batches: tuple[int, ...]
    tokens: tuple[int, ...]  # new tokens per sequence (1 + tree nodes)
    contexts: tuple[int, ...]
    ms: np.ndarray  # float64 [len(contexts), len(batches), len(tokens)]
    meta: dict = field(default_factory=dict)  # where it was measured (device, dtype, model, kernels, graphs)

    def __post_init__(self):
        shape = (len(self.contexts), len(self.batches), len(self.tokens))
        assert np.shape(self.ms) == shape, f"ms has shape {np.shape(self.ms)}, the axes say {shape}"
        for name in ("batches", "tokens", "contexts"):
            axis = getattr(self, name)
            assert len(axis) >= 1 and list(axis) == sorted(set(axis)), f"{name} must ascend: {axis}"

    def forward_ms(self, batch: float, tokens: float, context: float) -> float:
        """The forward's cost at any point: linear along each axis (context, then batch, then tokens)."""
        plane = interp1(self.contexts, self.ms, context)  # [batches, tokens]
        # Floor: extrapolating downwards may not make a step free.
        return max(float(interp1(self.tokens, interp1(self.batches, plane, batch), tokens)), self._floor)

    @functools.cached_property
    def _floor(self) -> float:
        return 0.05 * float(np.min(self.ms))

    def to_json(self) -> dict:
        return {"batches": list(self.batches), "tokens": list(self.tokens), "contexts": list(self.contexts),
                "ms": np.round(self.ms, 4).tolist(), "meta": self.meta}

    @classmethod
    def from_json(cls, d: dict) -> "CostTable":
        return cls(tuple(d["batches"]), tuple(d["tokens"]), tuple(d["contexts"]), np.asarray(d["ms"], dtype=np.float64),
                   d.get("meta", {}))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "CostTable":
        return cls.from_json(json.loads(Path(path).read_text()))


@dataclass(frozen=True)
class CostGrid:
    """Where to measure: every (context, batch, tokens) combination, ``reps`` timed runs each."""

    batches: tuple[int, ...]
    tokens: tuple[int, ...]
    contexts: tuple[int, ...]
    reps: int = 5
    warmup: int = 2  # untimed runs first (the first one of a bucket captures its CUDA graph)

    @classmethod
    def default(cls, device_type: str, max_num_seqs: int, tree_sizes: tuple[int, ...]) -> "CostGrid":
        """On a GPU: batches 1, 2, 4, ... up to ``max_num_seqs``, every tree size the policy may pick,
        contexts 1K and 8K (a few seconds for an 8B model). On a CPU a tiny grid (a second or two)."""
        tokens = tuple(sorted({1, *(n + 1 for n in tree_sizes)}))
        if device_type == "cuda":
            batches = sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_num_seqs} | {max_num_seqs})
            return cls(tuple(batches), tokens, (1024, 8192))
        return cls(tuple(sorted({1, min(4, max_num_seqs)})), tokens, (128,), reps=3, warmup=1)


def calibrate(target, grid: CostGrid) -> CostTable:
    """Time ``target``'s forward over ``grid``. Run it before any request: it writes KV blocks
    freely (tables built here, the block manager untouched), so nothing live may hold them."""
    assert target.blocks.num_used_blocks == 0, "calibrate before serving: it overwrites KV blocks"
    bs, num_blocks = target.blocks.block_size, target.blocks.num_blocks
    most = max(grid.tokens)
    contexts = [c for c in grid.contexts
                if c + most <= target.max_model_len and blocks_for(c + most, bs) <= num_blocks]
    if not contexts:  # a short context or a small cache: measure at what fits
        contexts = [max(1, min(target.max_model_len, num_blocks * bs) - most - 1)]
    start = time.perf_counter()
    ms = np.array([[[_time_step(target, b, q, c, grid) for q in grid.tokens] for b in grid.batches]
                   for c in contexts])
    log.info("cost table: %d points in %.1f s", ms.size, time.perf_counter() - start)
    return CostTable(tuple(grid.batches), tuple(grid.tokens), tuple(contexts), ms, describe(target))


def describe(target) -> dict:
    """What a table's costs depend on: a table measured elsewhere does not describe this target."""
    cfg, runner = target.model_config, target.runner
    name = torch.cuda.get_device_name(target.device) if target.device.type == "cuda" else "cpu"
    return {"device": name, "dtype": str(target.dtype).replace("torch.", ""), "architecture": cfg.architecture,
            "layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "kernels": runner.kernels.name, "cuda_graphs": runner.cuda_graphs}


def _time_step(target, batch: int, tokens: int, context: int, grid: CostGrid) -> float:
    """Median ms of one forward of ``batch`` sequences x ``tokens`` new tokens after ``context``."""
    bs, num_blocks = target.blocks.block_size, target.blocks.num_blocks
    per_seq = blocks_for(context + tokens, bs)
    # Sequences share blocks when the cache cannot hold them all apart: timing only, the values are junk.
    tables = [[(j * per_seq + i) % num_blocks for i in range(per_seq)] for j in range(batch)]
    ids = np.arange(1, tokens + 1) % target.model_config.vocab_size
    if tokens == 1:
        chunks = [SeqChunk(ids, context, t, logits_rows=(0,)) for t in tables]
    else:
        mask = np.tril(np.ones((tokens, tokens), dtype=bool))
        chunks = [SeqChunk(ids, context, t, logits_rows=np.arange(tokens),
                           positions=np.arange(context, context + tokens), custom_mask=mask) for t in tables]
    times = []
    try:
        for i in range(grid.warmup + grid.reps):
            t0 = time.perf_counter()
            out = target.runner.step(chunks)
            out.logits.argmax(-1).cpu()  # the step's device-to-host copy: the forward has finished
            if i >= grid.warmup:
                times.append(time.perf_counter() - t0)
    except torch.OutOfMemoryError:  # a step that does not fit: priced out, never chosen
        log.warning("cost table: %d sequences x %d tokens at context %d do not fit in memory", batch, tokens, context)
        torch.cuda.empty_cache()
        return UNAFFORDABLE_MS
    return statistics.median(times) * 1e3
