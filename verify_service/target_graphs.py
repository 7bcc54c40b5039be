"""The target's captured step graphs: which ``Bucket`` shapes exist, which one a step takes, and
each bucket's graph, captured on first use (or at start-up) by the runner's ``capture`` function.

Buckets: decode steps (one token per sequence) by sequence count, prompt steps as many one-token
sequences (``PROMPT_GRAPH_TOKENS``), ragged prompt steps by total tokens (``RAGGED_GRAPH_TOKENS``)
and verification steps by sequence count x tokens per sequence. A step takes the smallest captured
bucket that holds it, else the smallest one (captured then): a slightly larger forward costs less
than a capture in the middle of serving.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import numpy as np
import torch

from runtime.static_layout import Bucket, StaticLayout
from runtime.step_layout import SeqChunk

log = logging.getLogger(__name__)

# Most tokens a graphed step holds: its logits ([tokens, vocab], the model's dtype) live in the graph pool.
MAX_GRAPH_TOKENS = 2048
# Prompt steps of up to this many tokens (prompt chunks and decodes) replay a decode graph of as
# many one-token sequences, beyond the decode graphs' max_num_seqs: an eager prompt step launches
# some 300 kernels from Python (9.4 ms for an 80-token prompt on the H200, 0.9 ms of kernels) ...
PROMPT_GRAPH_TOKENS = 512
PROMPT_GRAPH_CONTEXT = 4096  # ... when it ends within this many tokens (those graphs' table width)
# Bigger prompt steps (a batch's prompts arriving together) replay a ragged graph of up to this many
# tokens (``Bucket.ragged``: causal chunks of any lengths, the prompt graphs' context), with the
# Triton, the exact or the reference kernels: at batch 64 on the H200, four eager 2048-token prompt steps of
# SmolLM2 took 14-16 ms each for 2.6 ms of kernels.
RAGGED_GRAPH_TOKENS = (1024, 2048)


def graph_buckets(max_num_seqs: int, max_tree_tokens: int, prompt_tokens: int = 0,
                  ragged_tokens: tuple[int, ...] = ()) -> list[Bucket]:
    """Decode buckets for 1, 2, 4, 8, then every multiple of 8 sequences up to ``max_num_seqs``,
    and prompt buckets (decode buckets used only by prompt steps) of 64, 128, 256 and 512 sequences
    above ``max_num_seqs`` up to ``prompt_tokens``; ragged buckets of ``max_num_seqs`` sequences and
    each of ``ragged_tokens`` tokens; tree buckets for 2, 4, 8, ... tokens per sequence up to
    ``max_tree_tokens``, as far as ``MAX_GRAPH_TOKENS`` allows."""
    seqs = sorted({n for n in (1, 2, 4, 8) if n < max_num_seqs} | set(range(8, max_num_seqs, 8)) | {max_num_seqs})
    prompts = [n for n in (64, 128, 256, 512) if max_num_seqs < n <= prompt_tokens]
    out = [Bucket(b, 1, False) for b in seqs + prompts if b <= MAX_GRAPH_TOKENS]
    out += [Bucket(max_num_seqs, t, False, ragged=True) for t in ragged_tokens if t <= MAX_GRAPH_TOKENS]
    tokens, q = [], 2
    while q < 2 * max_tree_tokens:
        tokens.append(min(q, max_tree_tokens))
        q *= 2
    return out + [Bucket(b, q, True) for q in sorted(set(tokens)) for b in seqs if b * q <= MAX_GRAPH_TOKENS]


class StepGraph:
    """One captured forward: its static inputs, the graph, and its outputs (``greedy``: each logits
    row's argmax, computed in the graph where it is a decode or prompt step's; None in a tree's).

    The draft's features: a tree's graph joins them in the graph (``captured``: its acceptance graphs
    gather the accepted rows' from there); a decode or prompt graph keeps the captured layers' inputs
    apart (``parts``) and a step that feeds the draft joins its rows after the replay, so a step none
    of whose requests uses the draft (target-only decoding beside a draft, adaptive speculation's
    plain steps) launches nothing for them."""

    def __init__(self, layout: StaticLayout, graph: torch.cuda.CUDAGraph, logits: torch.Tensor,
                 hidden: torch.Tensor, captured: torch.Tensor | None, greedy: torch.Tensor | None = None,
                 parts: tuple[torch.Tensor, ...] = ()):
        self.layout, self.graph = layout, graph
        self.logits, self.hidden, self.captured, self.greedy = logits, hidden, captured, greedy
        self.parts = parts
        self.followers: dict = {}  # graphs captured on this one's inputs and outputs (they die with it)

    def features(self, rows: int) -> torch.Tensor | None:
        """The last replay's features of its first ``rows`` tokens, in a tensor of the caller's own
        (the next replay overwrites the graph's); None without capture layers."""
        if self.parts:
            return torch.cat([p[:rows] for p in self.parts], dim=-1)
        return None if self.captured is None else self.captured[:rows].clone()


class TargetGraphs:
    """Every bucket's graph of one runner (None: its capture ran out of memory, those steps run
    eagerly), the bucket lists a step is matched against, and the graphs' shared memory pool."""

    def __init__(self, capture: Callable[[Bucket], StepGraph], max_num_seqs: int, max_model_len: int):
        """``capture(bucket)``: the runner's capture of one bucket's forward."""
        self._capture = capture
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self._graphs: dict[Bucket, StepGraph | None] = {}
        self._fits: dict[tuple, list[Bucket]] = {}  # fitting's answers
        self.pool = None  # the graphs' memory pool (CUDA), taken at the first capture

    def clear(self) -> None:
        """Drop every graph (captured with other outputs); the pool goes with the last of them."""
        self._graphs.clear()
        self.pool = None

    def captured(self, bucket: Bucket) -> StepGraph | None:
        """The bucket's graph if it was captured (no capture now)."""
        return self._graphs.get(bucket)

    def get(self, bucket: Bucket) -> StepGraph | None:
        """The bucket's graph, captured now if it was not."""
        if bucket not in self._graphs:
            try:
                self._graphs[bucket] = self._capture(bucket)
            except torch.OutOfMemoryError:  # results stay exact: this bucket's steps run eagerly
                log.warning("no GPU memory to capture a CUDA graph for %s: those steps run eagerly", bucket)
                self._graphs[bucket] = None
                torch.cuda.empty_cache()
        return self._graphs[bucket]

    def capture(self, buckets: list[Bucket]) -> None:
        """Capture ``buckets`` now (server start-up) rather than on their first step."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            for b in buckets:
                self.get(b)
        log.info("captured %d CUDA graphs in %.1f s", sum(g is not None for g in self._graphs.values()),
                 time.perf_counter() - t0)

    def buckets(self) -> list[Bucket]:
        return graph_buckets(self.max_num_seqs, min(MAX_GRAPH_TOKENS, self.max_model_len),
                             min(PROMPT_GRAPH_TOKENS, self.max_model_len), RAGGED_GRAPH_TOKENS)

    def fitting(self, tree: bool, seqs: int, tokens: int, prompt: bool = False) -> list[Bucket]:
        """The buckets that hold ``seqs`` sequences of up to ``tokens`` tokens, smallest first (by
        tokens, then tokens per sequence; ties in ``buckets`` order). Cached: a step asks for the
        same few shapes again and again, and the bucket list is fixed by the runner's sizes. ``prompt``:
        the prompt buckets too (a decode step never takes one: it would never capture its own)."""
        key = (tree, seqs, tokens, prompt, self.max_num_seqs, self.max_model_len)
        if key not in self._fits:
            fitting = [b for b in self.buckets() if b.tree == tree and not b.ragged and b.seqs >= seqs
                       and b.tokens >= tokens and (prompt or b.seqs <= self.max_num_seqs)]
            self._fits[key] = sorted(fitting, key=lambda b: (b.num_tokens, b.tokens))
        return self._fits[key]

    def bucket_for(self, chunks: list[SeqChunk]) -> Bucket | None:
        """The smallest captured bucket that holds this step (else the smallest), if it is a decode or
        verification step."""
        tree, most = False, 1
        for c in chunks:
            n = len(c.token_ids)
            if c.custom_mask is None:
                if is_prompt(c):
                    return None
            else:
                if c.custom_mask.shape != (n, n) or (c.mask_start is not None and c.mask_start != c.kv_start) \
                        or not np.array_equal(c.logits_rows, np.arange(n)):
                    return None
                tree, most = True, max(most, n)
        fitting = self.fitting(tree, len(chunks), most)
        # A bucket already captured, if one fits: a slightly larger forward costs less than a capture
        # in the middle of serving (trees shrink near a request's end; adaptive sizes vary).
        return next((b for b in fitting if self._graphs.get(b) is not None), fitting[0] if fitting else None)

    def ragged_for(self, tokens: int) -> Bucket | None:
        """The smallest ragged bucket of at least ``tokens`` tokens."""
        return min((b for b in self.buckets() if b.ragged and b.tokens >= tokens), key=lambda b: b.tokens, default=None)

    def tree_graph(self, B: int, n: int) -> StepGraph | None:
        """The captured verification graph a step of B trees of n nodes replays (None: none holds it)."""
        return next((self._graphs[b] for b in self.fitting(True, B, n + 1) if self._graphs.get(b) is not None), None)

    def __iter__(self):
        return iter(self._graphs.values())


def is_prompt(c: SeqChunk) -> bool:
    """A prompt chunk: no tree mask, and more than one token or other than one logits row (what
    ``bucket_for`` takes for a decode step it never is)."""
    return c.custom_mask is None and (len(c.token_ids) != 1 or len(c.logits_rows) != 1)
