"""CUDA graphs of the draft extend: the draft head's layers, LM head and log-softmax over each
step's accepted tokens replayed as one graph, captured per padded batch (a power of two).

(Tree levels run inside the whole-proposal graph, ``proposal_graph.py``.) An extend holds up to
``extend_tokens`` (the tree depth + 1) rows a sequence, packed at the front; the rows past a
step's own write no KV (slot -1) and give outputs no one reads; padding sequences bring no rows.
Eagerly it costs some forty kernel launches from Python; replayed, one graph plus the copy that
puts the step's metadata at the graph's fixed addresses::

    host:   layout arrays (slots, positions, tables ...) -> pinned buffer -> one copy
    device: the fed features -> the graph's buffer (device-to-device)
    graph:  draft layers -> LM head at each sequence's last row -> log_softmax

Rows that waited out plain steps (adaptive speculation) and prompts come in larger numbers: a second
graph per padded batch holds ``backlog_rows(B)`` rows a sequence (``BACKLOG_ROWS`` in all), and the
drafter feeds more than that in consecutive rounds.

Fills take the next of a ring of pinned buffers, waiting only on the copy that last used it.
``max_seq_len`` of the graphed metadata is the cache's capacity, so the attention grid never
depends on a step's lengths.
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

_FIELDS = ("qsl", "seq_lens", "tables", "slots", "positions", "token_seq", "q_idx", "ids", "rows")
_RING = 4  # pinned host buffers in turn
BACKLOG_ROWS = 2048  # rows of a backlog extend graph (all sequences together)
BACKLOG_ROWS_PER_SEQ = 128  # ... and a sequence's at most


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [T, k * H], the target's features
    meta_buffer: torch.Tensor  # int64, the _FIELDS back to back (the token ids among them)
    views: dict[str, tuple[int, tuple[int, ...]]]  # field -> (offset, shape) in meta_buffer
    out: torch.Tensor  # [T, H]
    logp: torch.Tensor  # float32 [B, draft vocab], each sequence's last row


class DraftGraphs:
    def __init__(self, net: EagleNet, kv: PagedKVCache, kernels: KernelSet, table_width: int, max_seq_len: int,
                 extend_tokens: int):
        self.net, self.kv, self.kernels = net, kv, kernels
        self.table_width, self.max_seq_len = table_width, max_seq_len
        self.extend_tokens = extend_tokens
        self.device = net.norm.weight.device
        self._graphs: dict[tuple[str, int, int], _Graph | None] = {}
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

    def backlog_rows(self, batch: int) -> int:
        """Rows a sequence that a backlog extend graph of ``batch`` sequences (padded) holds."""
        return max(self.extend_tokens, min(BACKLOG_ROWS_PER_SEQ, BACKLOG_ROWS // padded_batch(batch)))

    def run_extend(self, chunks: list[SeqChunk], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(out [T, H], log-probs [B', Vd] at each sequence's last row, B' >= B: the padded batch the
        graph was captured for) of a draft extend (host token ids, causal); None when a sequence
        brings more than ``backlog_rows`` rows."""
        n = [len(c.token_ids) for c in chunks]
        B = padded_batch(len(chunks))  # padding sequences bring no tokens (their query range is empty)
        Q = self.extend_tokens if max(n) <= self.extend_tokens else self.backlog_rows(B)
        if max(n) > Q:
            return None
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
        """Capture the extend graphs (a step's rows, a backlog's) of a padded ``batch`` now (start-up)
        rather than on first use."""
        for rows in sorted({self.extend_tokens, self.backlog_rows(batch)}):
            self._graph("extend", padded_batch(batch), rows, hidden_size)

    def _send(self, g: _Graph, arrays: dict[str, np.ndarray]) -> None:
        """``arrays`` to the graph's metadata buffer: a pinned ring buffer, one copy."""
        buf, turn = self._pinned(g, arrays)
        g.meta_buffer.copy_(buf, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._ring[turn] = (*self._ring[turn][:2], event)

    def _pinned(self, g: _Graph, arrays: dict[str, np.ndarray]) -> tuple[torch.Tensor, int]:
        """The next ring buffer (once the copy that last read it is done), holding ``arrays``, and
        its place in the ring."""
        buf, host, event = self._ring[self._turn]
        if event is not None:
            event.synchronize()  # normally long done: it is _RING steps old
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

    def _graph(self, kind: str, B: int, F: int, hidden_size: int) -> _Graph | None:
        key = (kind, B, F)
        if key not in self._graphs:
            try:
                self._graphs[key] = self._capture(kind, B, F, hidden_size)
            except torch.OutOfMemoryError:  # exact either way: this shape runs eagerly
                log.warning("no GPU memory to capture a draft %s graph for %d x %d rows: it runs eagerly", kind, B, F)
                self._graphs[key] = None
                torch.cuda.empty_cache()
        return self._graphs[key]

    def _capture(self, kind: str, B: int, F: int, hidden_size: int) -> _Graph:
        assert kind == "extend", kind
        T, dev = B * F, self.device
        shapes = {"qsl": (B + 1,), "seq_lens": (B,), "tables": (B, self.table_width), "slots": (T,),
                  "positions": (T,), "token_seq": (T,), "q_idx": (T,), "ids": (T,), "rows": (B,)}
        views, at = {}, 0
        for name in _FIELDS:
            views[name] = (at, shapes[name])
            at += int(np.prod(shapes[name]))
        meta_buffer = torch.zeros(at, dtype=torch.int64, device=dev)
        field = {name: meta_buffer[o:o + int(np.prod(s))].view(s) for name, (o, s) in views.items()}
        # Placeholder inputs for the capture: every sequence F rows at KV 0.., writing nothing.
        field["qsl"].copy_(torch.arange(B + 1, device=dev) * F)
        field["seq_lens"].fill_(F)
        field["slots"].fill_(-1)
        field["positions"].copy_(torch.arange(F, device=dev).repeat(B))
        field["token_seq"].copy_(torch.arange(B, device=dev).repeat_interleave(F))
        field["q_idx"].copy_(torch.arange(F, device=dev).repeat(B))
        field["rows"].copy_(torch.arange(1, B + 1, device=dev) * F - 1)
        hidden = torch.zeros(T, hidden_size, dtype=self.net.norm.weight.dtype, device=dev)
        meta = AttentionMetadata(query_start_loc=field["qsl"], seq_lens=field["seq_lens"], block_tables=field["tables"],
                                 slot_mapping=field["slots"], positions=field["positions"],
                                 token_seq=field["token_seq"], token_q_idx=field["q_idx"], max_query_len=F,
                                 max_seq_len=self.max_seq_len)

        def forward():
            out = self.net(field["ids"], hidden, self.kernels.prepare_attention(meta), self.kv, self.kernels)
            return out, torch.log_softmax(self.net.compute_logits(out[field["rows"]], self.kernels), dim=-1)

        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            forward()  # compiles the kernels and settles the allocator before capture
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out, logp = forward()
        self._grow_ring(meta_buffer.numel())
        return _Graph(graph, hidden, meta_buffer, views, out, logp)
