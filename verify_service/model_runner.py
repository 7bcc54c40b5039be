"""One forward step of the target over a batch of sequence chunks.

The scheduler decides *what* runs (``SeqChunk`` per sequence); the runner lays it out as
device tensors plus ``AttentionMetadata``, runs the model and returns logits only for the
rows that need them.

Decode steps (one token per sequence) and verification steps (a candidate tree per sequence,
logits for every node) replay CUDA graphs, captured on first use per ``Bucket`` of sequence
count and tokens per sequence (``target_graphs.py``: which buckets exist, which one a step
takes); their inputs live in a ``StaticLayout`` filled with one host-to-device copy. Small prompt
steps replay a decode graph of one-token sequences (``_prefill_as_decodes``), bigger ones a ragged
graph (``_ragged_step``); a mixed step (decodes or trees, then prompt chunks: a request arriving
while others decode) runs as two forwards, the prompt chunks' and the rest's on its graph
(``_split_step``). Prompt chunks past the prompt graphs' context and steps larger than every
bucket run eagerly (``layout_step``), as does everything off CUDA, with the reference kernels
(their shapes follow each step's lengths) or with ``enforce_eager``.
"""

from __future__ import annotations

import logging
import time
from typing import Callable
from dataclasses import dataclass

import numpy as np
import torch

from common.errors import UnsupportedModelError
from kernels import KernelSet
from kernels.metadata import AttentionMetadata
from runtime.block_manager import blocks_for
from runtime.graphs import capture_graph
from kernels.host_copy import take_rows
from runtime.kv_cache import PagedKVCache
from runtime.static_layout import Bucket, StaticLayout
from runtime.step_layout import SeqChunk, Staging, layout_step
from verify_service.accept_graph import TreeInputsGraph, write_device_trees
from verify_service.model import CausalLM
from verify_service.target_graphs import PROMPT_GRAPH_CONTEXT, TargetGraphs, StepGraph, is_prompt

__all__ = ["ModelRunner", "SeqChunk", "StepOutput"]

log = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class StepOutput:
    """A step's results. After a graphed step, ``logits`` and ``hidden`` are views of the graph's
    outputs, valid until the next step; ``captured`` is always the caller's own."""

    logits: torch.Tensor  # [sum(len(logits_rows)), vocab] in the model's dtype, in chunk order
    hidden: torch.Tensor  # [T, hidden] final-normed hidden of every new token
    captured: torch.Tensor | None  # [T, k * hidden] EAGLE-3 features, when capture layers are set
    query_start_loc: list[int]  # chunk i owns rows query_start_loc[i]:query_start_loc[i+1]
    # The captured forward whose static inputs and outputs these are, when the step replayed one alone
    # (what comes after it may be captured on them too: ``TreeVerifier``'s acceptance graphs).
    graph: "StepGraph | None" = None
    # Each logits row's argmax (int64), where the step's graph computed it (decode and prompt graphs):
    # the greedy tokens with no launch of their own. None: the sampler computes them.
    greedy: torch.Tensor | None = None


# Prompt pieces the warm-up runs beside full chunks (their attention launches few programs, so the keys
# are split). 96 tokens: a piece long enough for the batch-invariant attention's prompt tile
# (``kernels/attention_exact.py`` WIDE_QUERY_LEN) in such a launch; without it an exact-mode server
# compiled that variant while serving, when prompts joined decoding requests past one key chunk
# (SmolLM2, 16 and 64 concurrent requests, H200).
WARM_PIECES = (96, 48, 12, 2)


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
        self.graphs = TargetGraphs(self._capture, max_num_seqs, self.max_model_len)
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
            self.graphs.clear()  # captured with other outputs (later captures take a new pool)
        self.capture_layers = tuple(layers)

    @torch.inference_mode()
    def step(self, chunks: list[SeqChunk], ids: torch.Tensor | None = None, capture: bool = True,
             eager: bool = False) -> StepOutput:
        """``ids``: a decode step's token ids [len(chunks)] on the device (the last step's samples),
        in place of the chunks' own (placeholders). ``capture`` False: no row of the step goes to the
        draft (its sequences run without one): no captured features are kept (``captured`` None).
        ``eager``: no graph (a chunk with ``write_from``: the graphs' layouts write every row's KV)."""
        bucket = self.graphs.bucket_for(chunks) if self.cuda_graphs and not eager else None
        graph = self.graphs.get(bucket) if bucket is not None else None
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
            self.graphs.capture(buckets)

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
            for tokens in sorted({n - 1, n - 2, *(t for t in WARM_PIECES if t < n - 2)}):
                start = max(0, seq_len - tokens - 1)
                table = [0] * (-(-(start + tokens + 1) // bs))
                prefill = SeqChunk(np.zeros(tokens, np.int64), start, table, logits_rows=(tokens - 1,))
                decode = SeqChunk(np.zeros(1, np.int64), start + tokens, table, logits_rows=(0,))
                self.step([prefill])
                self.step([prefill, decode])
                if tree_tokens:  # a prompt arriving while trees are verified: an eager masked step
                    self.step([prefill, _chain_chunk(max(tree_tokens), start + tokens, bs)])
        # Greedy tokens of logits rows taken from the middle of a step's logits (an eager step's trees
        # after its prompt rows): with a vocabulary that is no multiple of 4, such rows start at
        # addresses that are no multiple of 16 bytes, a specialisation of their own.
        logits = torch.zeros(2, self.model.config.vocab_size, device=self.device,
                             dtype=self.model.lm_head_weight().dtype)  # (logits come in the model's dtype)
        self.kernels.argmax(logits)
        self.kernels.argmax(logits[1:])
        if self.kernels.name != "reference":  # both blocks of the split attention's combine
            from kernels.attention_triton import warm_combine
            cfg = self.model.config
            warm_combine(self.device, self.model.model.embed_tokens.weight.dtype, cfg.num_heads, cfg.head_dim)
        if tree_tokens:
            self._warm_acceptance(max(tree_tokens), bs)
            for width in sorted(set(tree_tokens)):
                self._warm_tree_layout(width)
        torch.cuda.synchronize()
        buckets = self.graphs.buckets()
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
            trees = k.sanitize_trees(torch.zeros(4, 1, n, dtype=torch.int64, device=dev), 1, 1)[:4 * n].view(4, 1, n)
            k.packed_tree_mask(trees[1], torch.tensor([n], device=dev))

    def _capture(self, bucket: Bucket) -> StepGraph:
        # A tree's nodes sit past the sequence's committed tokens: the table holds those too. A prompt
        # bucket's table is narrower (its every row is filled, sent and read each prompt step).
        prompts = bucket.ragged or bucket.seqs > self.max_num_seqs
        span = min(self.max_model_len, PROMPT_GRAPH_CONTEXT) if prompts else self.max_model_len
        width = blocks_for(span + bucket.tokens, self.kv_cache.block_size)
        layout = StaticLayout(bucket, width, self.max_model_len, self.kv_cache.block_size, self.device)

        def forward():
            out = self.model(layout.input_ids, self._graph_meta(layout), self.kv_cache, self.kernels,
                             self.capture_layers, join=bucket.tree)
            rows = out.hidden[layout.logit_rows] if bucket.ragged else out.hidden  # (ragged: each chunk's row)
            logits = self.model.compute_logits(rows, self.kernels.linear)
            # A decode or prompt step's greedy tokens in the graph (a row per sequence: a few us, no
            # launch from the host); a tree's many rows are the acceptance's to reduce, greedy or not.
            greedy = None if bucket.tree else self.kernels.argmax(logits)
            return logits, out.hidden, out.captured, greedy, out.parts

        if self.graphs.pool is None and self.device.type == "cuda":
            self.graphs.pool = torch.cuda.graph_pool_handle()
        graph, (logits, hidden, captured, greedy, parts) = capture_graph(forward, self.device, self.graphs.pool)
        return StepGraph(layout, graph, logits, hidden, captured, greedy, parts)

    def _graph_meta(self, layout: StaticLayout) -> AttentionMetadata:
        """The layout's metadata as this kernel set takes it, inside the graph. The layout holds the
        mask packed, and every set's ``prepare_attention`` reads the packed words: the Triton set keeps
        them, the batch-invariant set builds its ancestor table from them (one launch on CUDA,
        ``ancestor_table_triton``; the mask unpacked first took the torch table's 13 small launches a
        tree step), the references unpack them."""
        meta = layout.meta
        return meta if meta.custom_mask is None else self.kernels.prepare_attention(meta)

    def _prefill_as_decodes(self, chunks: list[SeqChunk], capture: bool = True) -> StepOutput | None:
        """A step of prompt chunks (and decodes) small enough for a captured decode graph, replayed as
        one: every prompt token a one-token sequence of its own (``decode_tokens``). None when the step
        holds a tree, or more tokens than the largest captured decode graph has sequences: it runs
        eagerly, some ten kernel launches a layer from Python."""
        tokens = sum(len(c.token_ids) for c in chunks)  # first: a big prompt step builds no chunk per token
        graph = next((g for g in map(self.graphs.captured, self.graphs.fitting(False, tokens, 1, prompt=True)) if g), None)
        single = decode_tokens(chunks) if graph is not None else None
        if single is None or not graph.layout.fits(single):
            return None
        out = self._replay(graph, single, capture=capture)
        qsl = np.concatenate(([0], np.cumsum([len(c.token_ids) for c in chunks])))
        rows = [int(qsl[i]) + int(r) for i, c in enumerate(chunks) for r in c.logits_rows]  # increasing
        # Consecutive rows (a prompt's last token): a view; else a gather with no host sync.
        logits = take_rows(out.logits, rows) if rows else out.logits[:0]
        greedy = None if out.greedy is None else take_rows(out.greedy, rows) if rows else out.greedy[:0]
        return StepOutput(logits, out.hidden, out.captured, qsl.tolist(), greedy=greedy)

    def _ragged_step(self, chunks: list[SeqChunk], capture: bool = True) -> StepOutput | None:
        """A step of causal chunks (prompt chunks, decodes beside them) that no prompt graph holds,
        replayed on the smallest ragged graph of as many tokens (captured now if it was not). None
        when none holds it: a tree, a chunk past the prompt graphs' context, more tokens than the
        largest, more than one logits row in a chunk."""
        tokens = sum(len(c.token_ids) for c in chunks)
        bucket = self.graphs.ragged_for(tokens)
        graph = self.graphs.get(bucket) if bucket is not None else None
        if graph is None or not graph.layout.fits(chunks):
            return None
        qsl = graph.layout.fill(chunks)
        graph.graph.replay()
        self.graph_steps += 1
        self.ragged_steps += 1
        rows = sum(len(c.logits_rows) for c in chunks)
        captured = graph.features(tokens) if capture else None
        return StepOutput(graph.logits[:rows], graph.hidden[:tokens], captured, qsl.tolist(),
                          greedy=None if graph.greedy is None else graph.greedy[:rows])

    def _split_step(self, chunks: list[SeqChunk], capture: bool = True) -> StepOutput | None:
        """A step of decodes or trees followed by prompt chunks (the scheduler's order: a request
        arriving while others decode), run as two forwards: the prompt chunks (``step``: a prompt
        graph where they fit one, else eagerly), then the rest on its captured graph; their outputs
        joined in chunk order. In one eager forward, the trees would cost the ~300 launches from
        Python of a prompt step too (every sequence waits for them); each row's result is the same
        (no row attends to another sequence's). None when the step is not of that form, or no graph
        holds its first part."""
        k = next((i for i, c in enumerate(chunks) if is_prompt(c)), 0)
        if k == 0 or not all(is_prompt(c) for c in chunks[k:]):
            return None
        head, tail = chunks[:k], chunks[k:]
        bucket = self.graphs.bucket_for(head)
        graph = self.graphs.get(bucket) if bucket is not None else None
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
        inputs = self.tree_inputs(graph, B, n)
        if inputs is not None:
            inputs.write(nodes)
        else:
            write_device_trees(self.kernels, graph.layout, nodes)
        return self._run(graph, qsl)

    def tree_inputs(self, graph: StepGraph, B: int, n: int) -> TreeInputsGraph | None:
        """The graph that writes B chained trees of n nodes into ``graph``'s inputs, captured now if it was
        not (None: no GPU memory to capture it; those steps write them launch by launch)."""
        key = ("tree_inputs", B, n)
        if key not in graph.followers:
            try:
                graph.followers[key] = TreeInputsGraph(self.kernels, graph.layout, B, n)
            except torch.OutOfMemoryError:  # the same inputs, written launch by launch
                log.warning("no GPU memory to capture the tree inputs' graph of %d trees of %d nodes", B, n)
                graph.followers[key] = None
                torch.cuda.empty_cache()
        return graph.followers[key]

    def tree_graph(self, B: int, n: int) -> StepGraph | None:
        """The captured verification graph a step of B trees of n nodes replays (None: none holds it)."""
        return self.graphs.tree_graph(B, n) if self.cuda_graphs else None

    def _replay(self, graph: StepGraph, chunks: list[SeqChunk], on_device=None, capture: bool = True) -> StepOutput:
        """``on_device(layout)``: device work that completes the inputs after the host's fill."""
        qsl = graph.layout.fill(chunks)
        if on_device is not None:
            on_device(graph.layout)
        return self._run(graph, qsl, capture)

    def _run(self, graph: StepGraph, qsl: np.ndarray, capture: bool = True) -> StepOutput:
        """Replay ``graph`` on its filled inputs (``qsl``: the step's query_start_loc); ``capture``:
        keep a copy of the captured features (the next replay overwrites the graph's own)."""
        graph.graph.replay()
        self.graph_steps += 1
        T = int(qsl[-1])
        captured = graph.features(T) if capture else None
        return StepOutput(graph.logits[:T], graph.hidden[:T], captured, qsl.tolist(), graph,
                          None if graph.greedy is None else graph.greedy[:T])


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
