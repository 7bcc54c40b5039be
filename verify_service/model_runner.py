"""One forward step of the target over a batch of sequence chunks.

The scheduler decides *what* runs (``SeqChunk`` per sequence); the runner lays it out as
device tensors plus ``AttentionMetadata``, runs the model and returns logits only for the
rows that need them.

Decode steps (one token per sequence) and verification steps (a candidate tree per sequence,
logits for every node) replay CUDA graphs, captured on first use per ``Bucket`` of sequence
count and tokens per sequence; their inputs live in a ``StaticLayout`` filled with one
host-to-device copy. Small prompt steps replay a decode graph of one-token sequences
(``_prefill_as_decodes``); a mixed step (decodes or trees, then prompt chunks: a request
arriving while others decode) runs as two forwards, the prompt chunks' and the rest's on its
graph (``_split_step``). Larger prompt chunks and steps larger than every bucket run eagerly
(``layout_step``), as does everything off CUDA, with the reference kernels (their shapes follow
each step's lengths) or with ``enforce_eager``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable
from dataclasses import dataclass

import numpy as np
import torch

from common.errors import UnsupportedModelError
from kernels import KernelSet
from kernels.attention import unpack_mask
from kernels.metadata import AttentionMetadata
from runtime.block_manager import blocks_for
from runtime.graphs import capture_graph
from kernels.host_copy import take_rows
from runtime.kv_cache import PagedKVCache
from runtime.static_layout import Bucket, StaticLayout
from runtime.step_layout import SeqChunk, Staging, layout_step
from verify_service.model import CausalLM

__all__ = ["ModelRunner", "SeqChunk", "StepOutput", "graph_buckets"]

log = logging.getLogger(__name__)

# Most tokens a graphed step holds: its logits ([tokens, vocab] float32) live in the graph pool.
MAX_GRAPH_TOKENS = 2048
# Prompt steps of up to this many tokens (prompt chunks and decodes) replay a decode graph of as
# many one-token sequences, beyond the decode graphs' max_num_seqs: an eager prompt step launches
# some 300 kernels from Python (9.4 ms for an 80-token prompt on the H200, 0.9 ms of kernels) ...
PROMPT_GRAPH_TOKENS = 512
PROMPT_GRAPH_CONTEXT = 4096  # ... when it ends within this many tokens (those graphs' table width)
# Bigger prompt steps (a batch's prompts arriving together) replay a ragged graph of up to this many
# tokens (``Bucket.ragged``: causal chunks of any lengths, the prompt graphs' context), with the
# Triton or the reference kernels: at batch 64 on the H200, four eager 2048-token prompt steps of
# SmolLM2 took 14-16 ms each for 2.6 ms of kernels.
RAGGED_GRAPH_TOKENS = (1024, 2048)


@dataclass(frozen=True, slots=True)
class StepOutput:
    """A step's results. After a graphed step, ``logits`` and ``hidden`` are views of the graph's
    outputs, valid until the next step; ``captured`` is always the caller's own."""

    logits: torch.Tensor  # [sum(len(logits_rows)), vocab] float32, in chunk order
    hidden: torch.Tensor  # [T, hidden] final-normed hidden of every new token
    captured: torch.Tensor | None  # [T, k * hidden] EAGLE-3 features, when capture layers are set
    query_start_loc: list[int]  # chunk i owns rows query_start_loc[i]:query_start_loc[i+1]
    # The captured forward whose static inputs and outputs these are, when the step replayed one alone
    # (what comes after it may be captured on them too: ``TreeVerifier``'s acceptance graphs).
    graph: "_Graph | None" = None


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


class _Graph:
    """One captured forward: its static inputs, the graph, and its outputs."""

    def __init__(self, layout: StaticLayout, graph: torch.cuda.CUDAGraph, logits: torch.Tensor,
                 hidden: torch.Tensor, captured: torch.Tensor | None):
        self.layout, self.graph = layout, graph
        self.logits, self.hidden, self.captured = logits, hidden, captured
        self.followers: dict = {}  # graphs captured on this one's inputs and outputs (they die with it)


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: PagedKVCache, kernels: KernelSet,
                 capture_layers: tuple[int, ...] = (), cuda_graphs: bool = False, max_num_seqs: int = 1):
        """``cuda_graphs``: replay captured graphs for decode and verification steps (CUDA with the
        Triton or the exact kernels; on a CPU, ``EngineConfig.graphs_on_cpu``, each replay an eager
        forward: tests of the graphed paths. The caller decides)."""
        self.model = model
        self.kv_cache = kv_cache
        self.kernels = kernels
        self.device = kv_cache.data.device
        self.staging = Staging(self.device)  # one host-to-device copy per step, reused buffers
        self.max_num_seqs = max_num_seqs
        self.max_model_len = model.cos.shape[0]
        self.cuda_graphs = cuda_graphs  # (on a CPU: each replay runs eagerly, ``runtime/graphs.py``)
        self._graphs: dict[Bucket, _Graph | None] = {}  # None: capture failed, that bucket runs eagerly
        self._pool = None
        self._fits: dict[tuple, list[Bucket]] = {}  # _fitting's answers
        self.graph_steps = 0  # steps that replayed a graph (a metric; tests read it)
        self.ragged_steps = 0  # prompt steps replayed on a ragged graph (``_ragged_step``)
        self.split_steps = 0  # mixed steps run as a prompt forward and a graph (``_split_step``)
        self.set_capture_layers(capture_layers)

    def set_capture_layers(self, layers: tuple[int, ...]) -> None:
        """Layers whose input hidden states ``step`` returns, concatenated in the given order."""
        bad = [i for i in layers if not 0 <= i < self.model.config.num_layers]
        if bad:
            raise UnsupportedModelError(f"capture layers {bad} outside [0, {self.model.config.num_layers})")
        if tuple(layers) != getattr(self, "capture_layers", None):
            self._graphs.clear()  # captured with other outputs
            self._pool = None  # freed with its last graph: later captures take a new pool
        self.capture_layers = tuple(layers)

    @torch.inference_mode()
    def step(self, chunks: list[SeqChunk], ids: torch.Tensor | None = None, capture: bool = True,
             eager: bool = False) -> StepOutput:
        """``ids``: a decode step's token ids [len(chunks)] on the device (the last step's samples),
        in place of the chunks' own (placeholders). ``capture`` False: no row of the step goes to the
        draft (its sequences run without one): no captured features are kept (``captured`` None).
        ``eager``: no graph (a chunk with ``write_from``: the graphs' layouts write every row's KV)."""
        bucket = self._bucket(chunks) if self.cuda_graphs and not eager else None
        graph = self._graph(bucket) if bucket is not None else None
        if graph is not None and graph.layout.fits(chunks):
            write = None if ids is None else lambda layout: layout.input_ids[:len(ids)].copy_(ids)
            return self._replay(graph, chunks, write, capture)
        if self.cuda_graphs and bucket is None and ids is None and not eager:
            graphed = self._prefill_as_decodes(chunks, capture) or self._ragged_step(chunks, capture) or \
                self._split_step(chunks, capture)
            if graphed is not None:
                return graphed
        lay = layout_step(chunks, self.kv_cache.block_size, self.device, self.kernels, self.staging)
        if ids is not None:
            lay.input_ids[:len(ids)].copy_(ids)
        out = self.model(lay.input_ids, lay.meta, self.kv_cache, self.kernels, self.capture_layers if capture else ())
        logits = self.model.compute_logits(out.hidden[lay.logits_rows], self.kernels.linear)
        return StepOutput(logits, out.hidden, out.captured, lay.query_start_loc.tolist())

    def capture(self, buckets: list[Bucket]) -> None:
        """Capture ``buckets`` now (server start-up) rather than on their first step."""
        if self.cuda_graphs:
            t0 = time.perf_counter()
            with torch.inference_mode():
                for b in buckets:
                    self._graph(b)
            log.info("captured %d CUDA graphs in %.1f s", sum(g is not None for g in self._graphs.values()),
                     time.perf_counter() - t0)

    @torch.inference_mode()
    def warm_up(self, max_batch_tokens: int, tree_tokens: tuple[int, ...] = ()) -> float:
        """Compile every kernel variant a prefill or mixed step can need, and capture the decode
        graphs, and for each of ``tree_tokens`` (a tree's nodes + 1: the default tree's, and every
        size adaptive speculation may pick) the verification graphs for every batch bucket,
        before the first request (server start-up; the cache must hold no sequence yet).

        Triton compiles a kernel on its first launch per specialisation (integer arguments
        divisible by 16 or not, the attention tiles of short and long keys): a long prompt
        arriving at a fresh server would otherwise stall every stream for the compilation.
        The dummy steps write their KV into block 0 and their outputs are discarded. Returns
        the seconds it took (0 on a CPU, where nothing compiles)."""
        if self.device.type != "cuda":
            return 0.0
        t0 = time.perf_counter()
        bs = self.kv_cache.block_size
        n = max(3, min(max_batch_tokens, self.max_model_len - 1))  # a chunk and one decode token fit the budget
        for seq_len in sorted({min(self.max_model_len, length) for length in (n, 8192 + n, self.max_model_len)}):
            # Full chunks (T and T + 1 tokens, on both sides of a multiple of 16), and short ones (a
            # prompt's last piece) whose few programs make attention split the keys: each attention
            # tile shape, split or not.
            for tokens in sorted({n - 1, n - 2, *(t for t in (48, 12, 2) if t < n - 2)}):
                start = max(0, seq_len - tokens - 1)
                table = [0] * (-(-(start + tokens + 1) // bs))
                prefill = SeqChunk(np.zeros(tokens, np.int64), start, table, logits_rows=(tokens - 1,))
                decode = SeqChunk(np.zeros(1, np.int64), start + tokens, table, logits_rows=(0,))
                self.step([prefill])
                self.step([prefill, decode])
                if tree_tokens:  # a prompt arriving while trees are verified: an eager masked step
                    self.step([prefill, _chain_chunk(max(tree_tokens), start + tokens, bs)])
        if tree_tokens:
            self._warm_acceptance(max(tree_tokens), bs)
            for width in sorted(set(tree_tokens)):
                self._warm_tree_layout(width)
        torch.cuda.synchronize()
        buckets = self._buckets()
        tree_q = {min((b.tokens for b in buckets if b.tree and b.tokens >= n), default=0) for n in tree_tokens}
        self.capture([b for b in buckets if not b.tree or b.tokens in tree_q])
        return time.perf_counter() - t0

    def _warm_acceptance(self, width: int, block_size: int) -> None:
        """Compile the tree-acceptance kernels (greedy acceptance, the KV compaction moves) on
        placeholder trees: a chain of ``width`` columns, root included."""
        dev, k = self.device, self.kernels
        cols = torch.arange(width, device=dev)[None]
        result = k.greedy_accept(cols, cols, cols - 1, torch.tensor([width], device=dev), width - 1)
        k.compaction_slots(result.path, result.num_accepted, torch.zeros(1, dtype=torch.int64, device=dev),
                           torch.zeros(1, -(-width // block_size), dtype=torch.int64, device=dev), block_size)

    def _warm_tree_layout(self, width: int) -> None:
        """Compile the kernels that lay out trees on the device (a chained step's check of the draft
        service's trees, their packed ancestor masks) for trees of ``width`` columns, root included."""
        dev, k, n = self.device, self.kernels, width - 1
        if n >= 1:
            trees, _ = k.sanitize_trees(torch.zeros(4, 1, n, dtype=torch.int64, device=dev), 1, 1)
            k.packed_tree_mask(trees[1], torch.tensor([n], device=dev))

    def _bucket(self, chunks: list[SeqChunk]) -> Bucket | None:
        """The smallest captured bucket that holds this step (else the smallest), if it is a decode or
        verification step."""
        tree, most = False, 1
        for c in chunks:
            n = len(c.token_ids)
            if c.custom_mask is None:
                if _is_prompt(c):
                    return None
            else:
                if c.custom_mask.shape != (n, n) or (c.mask_start is not None and c.mask_start != c.kv_start) \
                        or not np.array_equal(c.logits_rows, np.arange(n)):
                    return None
                tree, most = True, max(most, n)
        fitting = self._fitting(tree, len(chunks), most)
        # A bucket already captured, if one fits: a slightly larger forward costs less than a capture
        # in the middle of serving (trees shrink near a request's end; adaptive sizes vary).
        return next((b for b in fitting if self._graphs.get(b) is not None), fitting[0] if fitting else None)

    def _fitting(self, tree: bool, seqs: int, tokens: int, prompt: bool = False) -> list[Bucket]:
        """The buckets that hold ``seqs`` sequences of up to ``tokens`` tokens, smallest first (by
        tokens, then tokens per sequence; ties in ``_buckets`` order). Cached: a step asks for the
        same few shapes again and again, and the bucket list is fixed by the runner's sizes. ``prompt``:
        the prompt buckets too (a decode step never takes one: it would never capture its own)."""
        key = (tree, seqs, tokens, prompt, self.max_num_seqs, self.max_model_len)
        if key not in self._fits:
            fitting = [b for b in self._buckets() if b.tree == tree and not b.ragged and b.seqs >= seqs
                       and b.tokens >= tokens and (prompt or b.seqs <= self.max_num_seqs)]
            self._fits[key] = sorted(fitting, key=lambda b: (b.num_tokens, b.tokens))
        return self._fits[key]

    def _buckets(self) -> list[Bucket]:
        # (the exact kernels' attention keeps its own grid: their prompt steps run eagerly)
        ragged = RAGGED_GRAPH_TOKENS if self.kernels.name != "exact" else ()
        return graph_buckets(self.max_num_seqs, min(MAX_GRAPH_TOKENS, self.max_model_len),
                             min(PROMPT_GRAPH_TOKENS, self.max_model_len), ragged)

    def _graph(self, bucket: Bucket) -> _Graph | None:
        if bucket not in self._graphs:
            try:
                self._graphs[bucket] = self._capture(bucket)
            except torch.OutOfMemoryError:  # results stay exact: this bucket's steps run eagerly
                log.warning("no GPU memory to capture a CUDA graph for %s: those steps run eagerly", bucket)
                self._graphs[bucket] = None
                torch.cuda.empty_cache()
        return self._graphs[bucket]

    def _capture(self, bucket: Bucket) -> _Graph:
        # A tree's nodes sit past the sequence's committed tokens: the table holds those too. A prompt
        # bucket's table is narrower (its every row is filled, sent and read each prompt step).
        prompts = bucket.ragged or bucket.seqs > self.max_num_seqs
        span = min(self.max_model_len, PROMPT_GRAPH_CONTEXT) if prompts else self.max_model_len
        width = blocks_for(span + bucket.tokens, self.kv_cache.block_size)
        layout = StaticLayout(bucket, width, self.max_model_len, self.kv_cache.block_size, self.device)

        def forward():
            out = self.model(layout.input_ids, self._graph_meta(layout), self.kv_cache, self.kernels,
                             self.capture_layers)
            rows = out.hidden[layout.logit_rows] if bucket.ragged else out.hidden  # (ragged: each chunk's row)
            return self.model.compute_logits(rows, self.kernels.linear), out.hidden, out.captured

        if self._pool is None and self.device.type == "cuda":
            self._pool = torch.cuda.graph_pool_handle()
        graph, (logits, hidden, captured) = capture_graph(forward, self.device, self._pool)
        return _Graph(layout, graph, logits, hidden, captured)

    def _graph_meta(self, layout: StaticLayout) -> AttentionMetadata:
        """The layout's metadata as this kernel set takes it. The layout holds the mask packed as the
        Triton set's ``prepare_attention`` packs it; another set (the exact one: an ancestor table)
        prepares its own from the unpacked mask, inside the graph."""
        from kernels.attention_triton import prepare_attention_triton  # graphs imply Triton

        meta = layout.meta
        if meta.custom_mask is None or self.kernels.prepare_attention is prepare_attention_triton:
            return meta
        return self.kernels.prepare_attention(dataclasses.replace(meta, custom_mask=unpack_mask(meta.custom_mask)))

    def _prefill_as_decodes(self, chunks: list[SeqChunk], capture: bool = True) -> StepOutput | None:
        """A step of prompt chunks (and decodes) small enough for a captured decode graph, replayed as
        one: every prompt token a one-token sequence of its own (``decode_tokens``). None when the step
        holds a tree, or more tokens than the largest captured decode graph has sequences: it runs
        eagerly, some ten kernel launches a layer from Python."""
        tokens = sum(len(c.token_ids) for c in chunks)  # first: a big prompt step builds no chunk per token
        fitting = [b for b in self._fitting(False, tokens, 1, prompt=True) if self._graphs.get(b) is not None]
        single = decode_tokens(chunks) if fitting else None
        if single is None or not self._graphs[fitting[0]].layout.fits(single):
            return None
        out = self._replay(self._graphs[fitting[0]], single, capture=capture)
        qsl = np.concatenate(([0], np.cumsum([len(c.token_ids) for c in chunks])))
        rows = [int(qsl[i]) + int(r) for i, c in enumerate(chunks) for r in c.logits_rows]  # increasing
        # Consecutive rows (a prompt's last token): a view; else a gather with no host sync.
        logits = take_rows(out.logits, rows) if rows else out.logits[:0]
        return StepOutput(logits, out.hidden, out.captured, qsl.tolist())

    def _ragged_step(self, chunks: list[SeqChunk], capture: bool = True) -> StepOutput | None:
        """A step of causal chunks (prompt chunks, decodes beside them) that no prompt graph holds,
        replayed on the smallest ragged graph of as many tokens (captured now if it was not). None
        when none holds it: a tree, a chunk past the prompt graphs' context, more tokens than the
        largest, more than one logits row in a chunk."""
        tokens = sum(len(c.token_ids) for c in chunks)
        bucket = min((b for b in self._buckets() if b.ragged and b.tokens >= tokens), key=lambda b: b.tokens, default=None)
        graph = self._graph(bucket) if bucket is not None else None
        if graph is None or not graph.layout.fits(chunks):
            return None
        qsl = graph.layout.fill(chunks)
        graph.graph.replay()
        self.graph_steps += 1
        self.ragged_steps += 1
        rows = sum(len(c.logits_rows) for c in chunks)
        captured = graph.captured[:tokens].clone() if capture and graph.captured is not None else None
        return StepOutput(graph.logits[:rows], graph.hidden[:tokens], captured, qsl.tolist())

    def _split_step(self, chunks: list[SeqChunk], capture: bool = True) -> StepOutput | None:
        """A step of decodes or trees followed by prompt chunks (the scheduler's order: a request
        arriving while others decode), run as two forwards: the prompt chunks (``step``: a prompt
        graph where they fit one, else eagerly), then the rest on its captured graph; their outputs
        joined in chunk order. In one eager forward, the trees would cost the ~300 launches from
        Python of a prompt step too (every sequence waits for them); each row's result is the same
        (no row attends to another sequence's). None when the step is not of that form, or no graph
        holds its first part."""
        k = next((i for i, c in enumerate(chunks) if _is_prompt(c)), 0)
        if k == 0 or not all(_is_prompt(c) for c in chunks[k:]):
            return None
        head, tail = chunks[:k], chunks[k:]
        bucket = self._bucket(head)
        graph = self._graph(bucket) if bucket is not None else None
        if graph is None or not graph.layout.fits(head):
            return None
        self.split_steps += 1
        prompt = self.step(tail, capture=capture)  # never split again: its chunks are all prompt chunks
        # A prompt graph's outputs, copied before the next replay (graphs of one pool may reuse each
        # other's memory); its captured rows are the caller's already.
        logits, hidden = prompt.logits.clone(), prompt.hidden.clone()
        rest = self._replay(graph, head, capture=capture)
        offset = rest.query_start_loc[-1]
        captured = None if rest.captured is None else torch.cat([rest.captured, prompt.captured])
        return StepOutput(torch.cat([rest.logits, logits]), torch.cat([rest.hidden, hidden]), captured,
                          rest.query_start_loc + [offset + q for q in prompt.query_start_loc[1:]])

    @torch.inference_mode()
    def step_trees_on_device(self, starts: np.ndarray, roots: np.ndarray, tables: list[list[int]], n: int,
                             trees: Callable[[], torch.Tensor | None]) -> StepOutput | None:
        """A verification step of trees whose nodes are still on the device (a draft chained behind
        the last step's acceptance), queued behind the draft's work with no wait for the trees' copy
        to the host. Sequence b: its root token ``roots[b]`` at KV index ``starts[b]`` (its block
        table ``tables[b]``) and ``n`` nodes, logits for every row (``StaticLayout.fill_roots``).
        ``trees()``: the nodes, int64 [4, B, n] (tokens | parents | depths | scores), asked for once
        the step's layout is on its way (the draft service answers meanwhile); the device writes their
        tokens, positions and ancestor masks into the graph's inputs. None when no captured graph
        holds the step or the trees are not B trees of n nodes: the caller lays the trees out on the host."""
        B = len(starts)
        graph = self.tree_graph(B, n)
        if graph is None or B > graph.layout.bucket.seqs or any(len(t) > graph.layout.table_width for t in tables):
            return None
        qsl = graph.layout.fill_roots(starts, roots, tables, n)  # (a layout filled for nothing is refilled next)
        nodes = trees()
        if nodes is None or nodes.shape[1:] != (B, n):
            return None
        tokens, parents, depths = nodes[0], nodes[1], nodes[2]
        mask = self.kernels.packed_tree_mask(parents, torch.full((B,), n, dtype=torch.int64, device=parents.device))
        graph.layout.write_trees(tokens, depths, mask)
        return self._run(graph, qsl)

    def tree_graph(self, B: int, n: int) -> _Graph | None:
        """The captured verification graph a step of B trees of n nodes replays (None: none holds it)."""
        if not self.cuda_graphs:
            return None
        return next((self._graphs[b] for b in self._fitting(True, B, n + 1) if self._graphs.get(b) is not None), None)

    def _replay(self, graph: _Graph, chunks: list[SeqChunk], on_device=None, capture: bool = True) -> StepOutput:
        """``on_device(layout)``: device work that completes the inputs after the host's fill."""
        qsl = graph.layout.fill(chunks)
        if on_device is not None:
            on_device(graph.layout)
        return self._run(graph, qsl, capture)

    def _run(self, graph: _Graph, qsl: np.ndarray, capture: bool = True) -> StepOutput:
        """Replay ``graph`` on its filled inputs (``qsl``: the step's query_start_loc); ``capture``:
        keep a copy of the captured features (the next replay overwrites the graph's own)."""
        graph.graph.replay()
        self.graph_steps += 1
        T = int(qsl[-1])
        captured = graph.captured[:T].clone() if capture and graph.captured is not None else None
        return StepOutput(graph.logits[:T], graph.hidden[:T], captured, qsl.tolist(), graph)


def _is_prompt(c: SeqChunk) -> bool:
    """A prompt chunk: no tree mask, and more than one token or other than one logits row (what
    ``ModelRunner._bucket`` takes for a decode step it never is)."""
    return c.custom_mask is None and (len(c.token_ids) != 1 or len(c.logits_rows) != 1)


def decode_tokens(chunks: list[SeqChunk]) -> list[SeqChunk] | None:
    """``chunks`` as one-token chunks, token by token in order, each with logits: token i of a chunk
    a sequence whose KV ends at its own index, over the chunk's block table. A decode step computes
    them exactly as the causal step would: every token's KV is written before any attention reads it
    (a layer writes the step's KV, then attends), and token i reads indices 0 .. kv_start + i, which
    is its causal window. None for a chunk with its own positions or mask (a tree)."""
    out = []
    for c in chunks:
        if c.positions is not None or c.custom_mask is not None or c.mask_start is not None:
            return None
        ids = c.token_ids
        out += [SeqChunk(ids[i:i + 1], c.kv_start + i, c.block_table, logits_rows=(0,)) for i in range(len(ids))]
    return out


def _chain_chunk(q: int, start: int, block_size: int) -> SeqChunk:
    """A placeholder tree of ``q`` tokens (a chain: each node sees its predecessors) at KV ``start``,
    its KV in block 0."""
    return SeqChunk(np.zeros(q, np.int64), start, [0] * -(-(start + q) // block_size), logits_rows=tuple(range(q)),
                    positions=start + np.arange(q), custom_mask=np.tril(np.ones((q, q), dtype=bool)))
