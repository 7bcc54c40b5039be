"""CUDA graphs of the draft forward over one tree level: the draft head's layers, LM head and
log-softmax replayed as one graph, captured per (sequences, level width) on first use.

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
from runtime.step_layout import SeqChunk, layout_arrays

log = logging.getLogger(__name__)

_FIELDS = ("qsl", "seq_lens", "tables", "slots", "positions", "token_seq", "q_idx", "mask_start")
_RING = 16  # pinned host buffers in turn: more than the levels of one proposal


@dataclass
class _LevelGraph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # int64 [T]
    hidden: torch.Tensor  # [T, H]
    mask: torch.Tensor  # bool [T, mask_cols]
    meta_buffer: torch.Tensor  # int64, the _FIELDS back to back
    views: dict[str, tuple[int, tuple[int, ...]]]  # field -> (offset, shape) in meta_buffer
    out: torch.Tensor  # [T, H]
    logp: torch.Tensor  # float32 [T, draft vocab]


class DraftGraphs:
    def __init__(self, net: EagleNet, kv: PagedKVCache, kernels: KernelSet, table_width: int, max_seq_len: int,
                 mask_cols: int):
        self.net, self.kv, self.kernels = net, kv, kernels
        self.table_width, self.max_seq_len, self.mask_cols = table_width, max_seq_len, mask_cols
        self.device = net.norm.weight.device
        self._graphs: dict[tuple[int, int], _LevelGraph | None] = {}
        self._pool = None
        self._ring: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        self._turn = 0
        self.replays = 0

    def run(self, chunks: list[SeqChunk], hidden: torch.Tensor, ids: torch.Tensor,
            mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(out [T, H], log-probs [T, Vd]) of one level, views valid until this shape runs again;
        None when the level does not fit a graph (the caller runs it eagerly)."""
        B, F = len(chunks), len(chunks[0].token_ids)
        if mask.shape[1] > self.mask_cols or any(len(c.token_ids) != F or len(c.logits_rows) != F for c in chunks):
            return None
        g = self._graph(B, F, hidden.shape[1])
        if g is None:
            return None
        arrays = layout_arrays(chunks, self.kv.block_size, self.table_width)
        arrays["mask_start"] = np.array([c.mask_start for c in chunks], dtype=np.int64)
        buf, turn = self._pinned(g, arrays)
        g.meta_buffer.copy_(buf, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._ring[turn] = (self._ring[turn][0], event)
        g.ids.copy_(ids)
        g.hidden.copy_(hidden)
        g.mask.zero_()
        g.mask[:, :mask.shape[1]].copy_(mask)
        g.graph.replay()
        self.replays += 1
        return g.out, g.logp

    def _pinned(self, g: _LevelGraph, arrays: dict[str, np.ndarray]) -> tuple[torch.Tensor, int]:
        """The next ring buffer (once the copy that last read it is done), holding ``arrays``, and
        its place in the ring."""
        size = g.meta_buffer.numel()
        if len(self._ring) < _RING:
            self._ring.append((torch.empty(0, dtype=torch.int64), None))
        buf, event = self._ring[self._turn]
        if event is not None:
            event.synchronize()  # normally long done: it is _RING levels old
        if buf.numel() < size:
            buf = torch.empty(max(size, 1024), dtype=torch.int64, pin_memory=True)
        turn = self._turn
        self._ring[turn] = (buf, None)
        self._turn = (turn + 1) % _RING
        host = buf.numpy()
        for name, (at, shape) in g.views.items():
            host[at:at + int(np.prod(shape))] = arrays[name].reshape(-1)
        return buf[:size], turn

    def _graph(self, B: int, F: int, hidden_size: int) -> _LevelGraph | None:
        if (B, F) not in self._graphs:
            try:
                self._graphs[(B, F)] = self._capture(B, F, hidden_size)
            except torch.OutOfMemoryError:  # exact either way: this shape runs eagerly
                log.warning("no GPU memory to capture a draft graph for %d x %d nodes: that level runs eagerly", B, F)
                self._graphs[(B, F)] = None
                torch.cuda.empty_cache()
        return self._graphs[(B, F)]

    def _capture(self, B: int, F: int, hidden_size: int) -> _LevelGraph:
        T, dev = B * F, self.device
        shapes = {"qsl": (B + 1,), "seq_lens": (B,), "tables": (B, self.table_width), "slots": (T,),
                  "positions": (T,), "token_seq": (T,), "q_idx": (T,), "mask_start": (B,)}
        views, at = {}, 0
        for name in _FIELDS:
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
        ids = torch.zeros(T, dtype=torch.int64, device=dev)
        hidden = torch.zeros(T, hidden_size, dtype=self.net.norm.weight.dtype, device=dev)
        mask = torch.zeros(T, self.mask_cols, dtype=torch.bool, device=dev)
        mask[:, 0] = True
        meta = AttentionMetadata(query_start_loc=field["qsl"], seq_lens=field["seq_lens"], block_tables=field["tables"],
                                 slot_mapping=field["slots"], positions=field["positions"],
                                 token_seq=field["token_seq"], token_q_idx=field["q_idx"], max_query_len=F,
                                 max_seq_len=self.max_seq_len, custom_mask=mask, mask_start=field["mask_start"])

        def forward():
            out = self.net(ids, hidden, self.kernels.prepare_attention(meta), self.kv, self.kernels)
            return out, torch.log_softmax(self.net.compute_logits(out), dim=-1)

        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            forward()  # compiles the kernels and settles the allocator before capture
        torch.cuda.current_stream(dev).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out, logp = forward()
        return _LevelGraph(graph, ids, hidden, mask, meta_buffer, views, out, logp)
