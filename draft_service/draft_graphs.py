"""CUDA graphs of the draft forward: the draft head's layers, LM head and log-softmax replayed as
one graph, captured on first use per (sequences, level width) for tree levels and per padded
batch (a power of two) for the draft extend over each step's accepted tokens.

A tree level is the same computation at every step: B sequences of F new nodes each, their
ids and ancestor mask already on the device, the hidden input gathered from the parents'
outputs. Eagerly it costs some forty kernel launches from Python; replayed, one graph plus
the few copies that put the level's inputs at the graph's fixed addresses::

    host:   layout arrays (slots, positions, tables ...) -> pinned buffer -> one copy
    device: ids, hidden, mask -> the graph's buffers (device-to-device)
    graph:  prepare_attention (packs the mask) -> draft layers -> LM head -> log_softmax

The levels of one proposal follow each other without a host sync, so each fill takes the next
of a ring of pinned buffers, waiting only on the copy that last used it. ``max_seq_len`` of the
graphed metadata is the cache's capacity, so the attention grid never depends on a step's
lengths; the mask buffer is as wide as the deepest level, zero past each level's columns.
An extend holds up to ``extend_tokens`` (the tree depth + 1) rows a sequence, packed at the
front; the rows past a step's own write no KV (slot -1) and give outputs no one reads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from draft_service.eagle_net import EagleNet
from kernels import KernelSet
from kernels.metadata import AttentionMetadata
from runtime.kv_cache import PagedKVCache
from draft_service.proposal_graph import padded_batch
from runtime.step_layout import SeqChunk, layout_arrays

log = logging.getLogger(__name__)

_FIELDS = {"level": ("qsl", "seq_lens", "tables", "slots", "positions", "token_seq", "q_idx", "mask_start"),
           "extend": ("qsl", "seq_lens", "tables", "slots", "positions", "token_seq", "q_idx", "ids", "rows")}
_RING = 16  # pinned host buffers in turn: more than the levels of one proposal


@dataclass
class _LevelGraph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # int64 [T] (an extend's live in meta_buffer)
    hidden: torch.Tensor  # [T, H] (an extend's: [T, k * H], the target's features)
    mask: torch.Tensor | None  # bool [T, mask_cols] (levels)
    meta_buffer: torch.Tensor  # int64, the _FIELDS back to back
    views: dict[str, tuple[int, tuple[int, ...]]]  # field -> (offset, shape) in meta_buffer
    out: torch.Tensor  # [T, H]
    logp: torch.Tensor  # float32 [T, draft vocab] (an extend's: [B, draft vocab], each sequence's last row)


class DraftGraphs:
    def __init__(self, net: EagleNet, kv: PagedKVCache, kernels: KernelSet, table_width: int, max_seq_len: int,
                 mask_cols: int, extend_tokens: int):
        self.net, self.kv, self.kernels = net, kv, kernels
        self.table_width, self.max_seq_len, self.mask_cols = table_width, max_seq_len, mask_cols
        self.extend_tokens = extend_tokens
        self.device = net.norm.weight.device
        self._graphs: dict[tuple[str, int, int], _LevelGraph | None] = {}
        self._pool = None
        self._ring: list[tuple[torch.Tensor, np.ndarray, torch.cuda.Event | None]] = []  # buffer, view, last copy
        self._turn = 0
        self.replays = 0

    @property
    def pool(self):
        """The memory pool the drafter's graphs share (they never run concurrently)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def run(self, chunks: list[SeqChunk], hidden: torch.Tensor, ids: torch.Tensor,
            mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(out [T, H], log-probs [T, Vd]) of one level, views valid until this shape runs again;
        None when the level does not fit a graph (the caller runs it eagerly)."""
        B, F = len(chunks), len(chunks[0].token_ids)
        if mask.shape[1] > self.mask_cols or any(len(c.token_ids) != F or len(c.logits_rows) != F for c in chunks):
            return None
        g = self._graph("level", B, F, hidden.shape[1])
        if g is None:
            return None
        arrays = layout_arrays(chunks, self.kv.block_size, self.table_width)
        arrays["mask_start"] = np.array([c.mask_start for c in chunks], dtype=np.int64)
        self._send(g, arrays)
        g.ids.copy_(ids)
        g.hidden.copy_(hidden)
        g.mask.zero_()
        g.mask[:, :mask.shape[1]].copy_(mask)
        g.graph.replay()
        self.replays += 1
        return g.out, g.logp

    def run_extend(self, chunks: list[SeqChunk], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(out [T, H], log-probs [B', Vd] at each sequence's last row, B' >= B: the padded batch the
        graph was captured for) of a draft extend (host token ids, causal); None when a sequence
        brings more than ``extend_tokens`` rows."""
        Q = self.extend_tokens
        n = [len(c.token_ids) for c in chunks]
        if max(n) > Q:
            return None
        B = padded_batch(len(chunks))  # padding sequences bring no tokens (their query range is empty)
        g = self._graph("extend", B, Q, hidden.shape[1])
        if g is None:
            return None
        chunks = chunks + [SeqChunk(np.zeros(0, dtype=np.int64), 0, [])] * (B - len(chunks))
        arrays = layout_arrays(chunks, self.kv.block_size, self.table_width)
        T, pad = sum(n), B * Q - sum(n)
        for name, fill in (("slots", -1), ("positions", 0), ("token_seq", 0), ("q_idx", 0)):
            arrays[name] = np.concatenate([arrays[name], np.full(pad, fill, dtype=np.int64)])
        arrays["ids"] = np.concatenate([np.asarray(c.token_ids, dtype=np.int64) for c in chunks] +
                                       [np.zeros(pad, dtype=np.int64)])
        arrays["rows"] = arrays["qsl"][1:] - 1
        self._send(g, arrays)
        g.hidden[:T].copy_(hidden)
        g.graph.replay()
        self.replays += 1
        return g.out[:T], g.logp

    def capture_extend(self, batch: int, hidden_size: int) -> None:
        """Capture the extend graph of a padded ``batch`` now (start-up) rather than on first use."""
        self._graph("extend", padded_batch(batch), self.extend_tokens, hidden_size)

    def _send(self, g: _LevelGraph, arrays: dict[str, np.ndarray]) -> None:
        """``arrays`` to the graph's metadata buffer: a pinned ring buffer, one copy."""
        buf, turn = self._pinned(g, arrays)
        g.meta_buffer.copy_(buf, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._ring[turn] = (*self._ring[turn][:2], event)

    def _pinned(self, g: _LevelGraph, arrays: dict[str, np.ndarray]) -> tuple[torch.Tensor, int]:
        """The next ring buffer (once the copy that last read it is done), holding ``arrays``, and
        its place in the ring."""
        buf, host, event = self._ring[self._turn]
        if event is not None:
            event.synchronize()  # normally long done: it is _RING levels old
        turn = self._turn
        self._ring[turn] = (buf, host, None)
        self._turn = (turn + 1) % _RING
        for name, (at, shape) in g.views.items():
            host[at:at + int(np.prod(shape))] = arrays[name].reshape(-1)
        return buf[:g.meta_buffer.numel()], turn

    def _grow_ring(self, size: int) -> None:
        """Every ring buffer at least ``size`` long, made when a graph is captured: a step then
        allocates no pinned memory and reads no tensor on the host."""
        while len(self._ring) < _RING:
            empty = torch.empty(0, dtype=torch.int64)
            self._ring.append((empty, empty.numpy(), None))
        for i, (buf, _, event) in enumerate(self._ring):
            if buf.numel() < size:
                if event is not None:
                    event.synchronize()
                buf = torch.empty(max(size, 1024), dtype=torch.int64, pin_memory=True)
                self._ring[i] = (buf, buf.numpy(), None)

    def _graph(self, kind: str, B: int, F: int, hidden_size: int) -> _LevelGraph | None:
        key = (kind, B, F)
        if key not in self._graphs:
            try:
                self._graphs[key] = self._capture(kind, B, F, hidden_size)
            except torch.OutOfMemoryError:  # exact either way: this shape runs eagerly
                log.warning("no GPU memory to capture a draft %s graph for %d x %d rows: it runs eagerly", kind, B, F)
                self._graphs[key] = None
                torch.cuda.empty_cache()
        return self._graphs[key]

    def _capture(self, kind: str, B: int, F: int, hidden_size: int) -> _LevelGraph:
        T, dev = B * F, self.device
        shapes = {"qsl": (B + 1,), "seq_lens": (B,), "tables": (B, self.table_width), "slots": (T,),
                  "positions": (T,), "token_seq": (T,), "q_idx": (T,), "mask_start": (B,), "ids": (T,),
                  "rows": (B,)}
        views, at = {}, 0
        for name in _FIELDS[kind]:
            views[name] = (at, shapes[name])
            at += int(np.prod(shapes[name]))
        meta_buffer = torch.zeros(at, dtype=torch.int64, device=dev)
        field = {name: meta_buffer[o:o + int(np.prod(s))].view(s) for name, (o, s) in views.items()}
        # Placeholder inputs for the capture: every sequence F nodes at KV 0.., writing nothing.
        field["qsl"].copy_(torch.arange(B + 1, device=dev) * F)
        field["seq_lens"].fill_(F)
        field["slots"].fill_(-1)
        field["positions"].copy_(torch.arange(F, device=dev).repeat(B))
        field["token_seq"].copy_(torch.arange(B, device=dev).repeat_interleave(F))
        field["q_idx"].copy_(torch.arange(F, device=dev).repeat(B))
        hidden = torch.zeros(T, hidden_size, dtype=self.net.norm.weight.dtype, device=dev)
        level = kind == "level"
        if level:
            ids = torch.zeros(T, dtype=torch.int64, device=dev)
            mask = torch.zeros(T, self.mask_cols, dtype=torch.bool, device=dev)
            mask[:, 0] = True
        else:
            ids, mask = field["ids"], None
            field["rows"].copy_(torch.arange(1, B + 1, device=dev) * F - 1)
        meta = AttentionMetadata(query_start_loc=field["qsl"], seq_lens=field["seq_lens"], block_tables=field["tables"],
                                 slot_mapping=field["slots"], positions=field["positions"],
                                 token_seq=field["token_seq"], token_q_idx=field["q_idx"], max_query_len=F,
                                 max_seq_len=self.max_seq_len, custom_mask=mask,
                                 mask_start=field["mask_start"] if level else None)

        def forward():
            out = self.net(ids, hidden, self.kernels.prepare_attention(meta), self.kv, self.kernels)
            return out, torch.log_softmax(self.net.compute_logits(out if level else out[field["rows"]]), dim=-1)

        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            forward()  # compiles the kernels and settles the allocator before capture
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out, logp = forward()
        self._grow_ring(meta_buffer.numel())
        return _LevelGraph(graph, ids, hidden, mask, meta_buffer, views, out, logp)
