"""CUDA graphs of the draft extend: the draft head's layers, LM head and log-softmax over each
step's accepted tokens replayed as one graph, captured per padded batch (a power of two).

(Tree levels run inside the whole-proposal graph, ``proposal_graph.py``; a chained step's extend of rows
still on the device runs inside its proposal's graph, ``chain_graph.py``.) An extend holds up to
``extend_tokens`` (the tree depth + 1) rows a sequence, packed at the front; the rows past a
step's own write no KV (slot -1) and give outputs no one reads; padding sequences bring no rows.
Eagerly it costs some forty kernel launches from Python; replayed, one graph plus the copy that
puts the step's inputs at the graph's fixed addresses. The host sends only what it alone knows,
per sequence; the graph lays the rows out itself (``kernels.extend_layout``: what ``layout_arrays``
computes on the host, one launch instead of a dozen array passes a step)::

    host:   first row, row count, block table a sequence; the token ids -> pinned buffer -> one copy
    device: the fed features -> the graph's buffer (device-to-device)
    graph:  layout (query ranges, slots, positions) -> draft layers -> each sequence's last row:
            its output, and log_softmax(LM head)

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
from draft_service.proposal_graph import padded_batch
from runtime.graphs import capture_graph
from runtime.kv_cache import PagedKVCache
from runtime.step_layout import SeqChunk

log = logging.getLogger(__name__)

_FIELDS = ("starts", "counts", "tables", "ids")
_RING = 4  # pinned host buffers in turn
BACKLOG_ROWS = 2048  # rows of a backlog extend graph (all sequences together)
BACKLOG_ROWS_PER_SEQ = 128  # ... and a sequence's at most


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [T, k * H], the target's features
    meta_buffer: torch.Tensor  # int64, the _FIELDS back to back (the token ids among them)
    views: dict[str, tuple[int, tuple[int, ...]]]  # field -> (offset, shape) in meta_buffer
    last: torch.Tensor  # [B, H]: each sequence's last row's output
    logp: torch.Tensor  # float32 [B, draft vocab], each sequence's last row


def extend_forward(net: EagleNet, kv: PagedKVCache, kernels: KernelSet, ids: torch.Tensor, features: torch.Tensor,
                   starts: torch.Tensor, counts: torch.Tensor, tables: torch.Tensor, rows_per_seq: int,
                   max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft extend laid out on the device (``kernels.extend_layout``): rows packed ``rows_per_seq`` a
    sequence, ``ids`` [B * rows_per_seq] and ``features`` [B * rows_per_seq, width], written to the
    KV rows ``starts ..`` of ``tables``. Returns each sequence's last row's output [B, H] and its
    log-probs over the draft vocabulary [B, Vd] (float32)."""
    lay = kernels.extend_layout(starts, counts, tables, kv.block_size, rows_per_seq)
    meta = AttentionMetadata(query_start_loc=lay["qsl"], seq_lens=lay["seq_lens"], block_tables=tables,
                             slot_mapping=lay["slots"], positions=lay["positions"], token_seq=lay["token_seq"],
                             token_q_idx=lay["q_idx"], max_query_len=rows_per_seq, max_seq_len=max_seq_len)
    out, logits = net.extend(ids, features, kernels.prepare_attention(meta), kv, kernels, lay["rows"])
    # (In float32 as it reads the head's logits: one kernel, no float32 copy of them first.)
    return out[lay["rows"]], torch.log_softmax(logits, dim=-1, dtype=torch.float32)


class DraftGraphs:
    def __init__(self, net: EagleNet, kv: PagedKVCache, kernels: KernelSet, table_width: int, max_seq_len: int,
                 extend_tokens: int):
        self.net, self.kv, self.kernels = net, kv, kernels
        self.table_width, self.max_seq_len = table_width, max_seq_len
        self.extend_tokens = extend_tokens
        self.device = net.norm.weight.device
        self._graphs: dict[tuple[int, int], _Graph | None] = {}
        self._pool = None
        self._ring: list[tuple[torch.Tensor, np.ndarray, torch.cuda.Event | None]] = []  # buffer, view, last copy
        self._turn = 0
        self._views: dict[tuple[int, int], dict[str, np.ndarray]] = {}  # (graph, ring turn) -> field views
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
        """(output [B', H] and log-probs [B', Vd] at each sequence's last row, B' >= B: the padded
        batch the graph was captured for; the graph's buffers, overwritten by its next replay) of a
        draft extend (host token ids, causal); None when a sequence brings more than
        ``backlog_rows`` rows."""
        n = [len(c.token_ids) for c in chunks]
        B = padded_batch(len(chunks))  # padding sequences bring no tokens (their query range is empty)
        Q = self.extend_tokens if max(n) <= self.extend_tokens else self.backlog_rows(B)
        if max(n) > Q:
            return None
        g = self._graph(B, Q, hidden.shape[1])
        if g is None:
            return None
        buf, turn, v = self._pinned(g)
        k, T = len(chunks), sum(n)
        self._fill(v, chunks)
        v["counts"][:k] = n
        v["counts"][k:] = 0
        v["ids"][:T] = np.concatenate([c.token_ids for c in chunks]) if k > 1 else chunks[0].token_ids
        v["ids"][T:] = 0  # the rows past the last: valid ids all the same (they are embedded, then dropped)
        self._send(g, buf, turn)
        g.hidden[:T].copy_(hidden)
        g.graph.replay()
        self.replays += 1
        return g.last, g.logp

    def capture_extend(self, batch: int, hidden_size: int) -> None:
        """Capture the extend graphs (a step's rows, a backlog's) of a padded ``batch`` now (start-up)
        rather than on first use."""
        for rows in sorted({self.extend_tokens, self.backlog_rows(batch)}):
            self._graph(padded_batch(batch), rows, hidden_size)

    @staticmethod
    def _fill(v: dict[str, np.ndarray], chunks: list[SeqChunk]) -> None:
        """Each sequence's first row and block table into the pinned fields ``v`` (padding: zeros)."""
        k = len(chunks)
        v["starts"][:k] = [c.kv_start for c in chunks]
        v["starts"][k:] = 0
        tables = v["tables"]
        tables[:] = 0
        for i, c in enumerate(chunks):
            tables[i, :len(c.block_table)] = c.block_table

    def _send(self, g: _Graph, buf: torch.Tensor, turn: int) -> None:
        """The filled ring buffer ``buf`` to the graph's metadata buffer: one copy."""
        g.meta_buffer.copy_(buf, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._ring[turn] = (*self._ring[turn][:2], event)

    def _pinned(self, g: _Graph) -> tuple[torch.Tensor, int, dict[str, np.ndarray]]:
        """The next ring buffer (once the copy that last read it is done), its place in the ring, and
        the graph's fields as views of it, to fill."""
        buf, host, event = self._ring[self._turn]
        if event is not None:
            event.synchronize()  # normally long done: it is _RING steps old
        turn = self._turn
        self._ring[turn] = (buf, host, None)
        self._turn = (turn + 1) % _RING
        key = (id(g), turn)
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = {name: host[at:at + int(np.prod(shape))].reshape(shape)
                                        for name, (at, shape) in g.views.items()}
        return buf[:g.meta_buffer.numel()], turn, views

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
                self._views = {k: v for k, v in self._views.items() if k[1] != i}  # views of the old buffer

    def _graph(self, B: int, F: int, hidden_size: int) -> _Graph | None:
        key = (B, F)
        if key not in self._graphs:
            try:
                self._graphs[key] = self._capture(B, F, hidden_size)
            except torch.OutOfMemoryError:  # exact either way: this shape runs eagerly
                log.warning("no GPU memory to capture a draft extend graph for %d x %d rows: it runs eagerly", B, F)
                self._graphs[key] = None
                torch.cuda.empty_cache()
        return self._graphs[key]

    def _capture(self, B: int, F: int, hidden_size: int) -> _Graph:
        T, dev = B * F, self.device
        shapes = {"starts": (B,), "counts": (B,), "tables": (B, self.table_width), "ids": (T,)}
        views, at = {}, 0
        for name in _FIELDS:
            views[name] = (at, shapes[name])
            at += int(np.prod(shapes[name]))
        meta_buffer = torch.zeros(at, dtype=torch.int64, device=dev)
        field = {name: meta_buffer[o:o + int(np.prod(s))].view(s) for name, (o, s) in views.items()}
        # Placeholder inputs for the capture: every sequence without rows (counts 0), writing nothing.
        hidden = torch.zeros(T, hidden_size, dtype=self.net.norm.weight.dtype, device=dev)
        graph, (last, logp) = capture_graph(lambda: extend_forward(
            self.net, self.kv, self.kernels, field["ids"], hidden, field["starts"], field["counts"], field["tables"],
            F, self.max_seq_len), dev, self.pool)
        self._grow_ring(meta_buffer.numel())
        return _Graph(graph, hidden, meta_buffer, views, last, logp)
