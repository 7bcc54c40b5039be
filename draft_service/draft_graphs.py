"""CUDA graphs of the draft extend: the draft head's layers, LM head and log-softmax over each
step's accepted tokens replayed as one graph, captured per padded batch (a power of two).

(Tree levels run inside the whole-proposal graph, ``proposal_graph.py``.) An extend holds up to
``extend_tokens`` (the tree depth + 1) rows a sequence, packed at the front; the rows past a
step's own write no KV (slot -1) and give outputs no one reads; padding sequences bring no rows.
Eagerly it costs some forty kernel launches from Python; replayed, one graph plus the copy that
puts the step's inputs at the graph's fixed addresses. The host sends only what it alone knows,
per sequence; the graph lays the rows out itself (``extend_layout``: what ``layout_arrays``
computes on the host, a few small kernels instead of a dozen array passes a step)::

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
from runtime.kv_cache import PagedKVCache
from draft_service.proposal_graph import padded_batch
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
    # "extend_rows" only: rows still on the device, packed by the graph: counts [B], tokens [B, F],
    # features [B, F, k * H] (the meta buffer's counts and ids are then unused)
    rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def extend_layout(starts: torch.Tensor, counts: torch.Tensor, tables: torch.Tensor, block_size: int,
                  rows_per_seq: int) -> dict[str, torch.Tensor]:
    """An extend's metadata on the device, from each sequence's first KV row ``starts`` [B], row
    count ``counts`` [B] (0: a padding sequence) and block table ``tables`` [B, W]: rows packed
    sequence after sequence in ``B * rows_per_seq`` slots, as ``layout_arrays`` lays them out on
    the host, and the slots past the last row writing nothing (slot -1, position, sequence and
    index 0). Adds ``rows``: each sequence's last row (0 for none before it). No host sync."""
    B, W = tables.shape
    T = B * rows_per_seq
    qsl = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    r = torch.arange(T, device=counts.device)
    seq = torch.searchsorted(qsl[1:], r, right=True).clamp(max=B - 1)  # the sequence whose range holds r
    q_idx = r - qsl[seq]
    valid = r < qsl[B]
    kv = starts[seq] + q_idx
    block = tables[seq, (kv // block_size).clamp(0, W - 1)]
    zero = torch.zeros_like(r)
    return {"qsl": qsl, "seq_lens": starts + counts, "slots": torch.where(valid, block * block_size + kv % block_size, -1),
            "positions": torch.where(valid, kv, zero), "token_seq": torch.where(valid, seq, zero),
            "q_idx": torch.where(valid, q_idx, zero), "rows": (qsl[1:] - 1).clamp(min=0)}


def pack_rows(counts: torch.Tensor, tokens: torch.Tensor, features: torch.Tensor, rows: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences' rows packed front to back, as an extend lays them out: ``counts`` [B] rows of
    ``tokens`` [B, D] and ``features`` [B, D, width] -> token ids [rows] and features [rows, width],
    zero past the last row. A gather per packed row (its sequence by a search of the row starts),
    on the device, with no host sync."""
    B, D = tokens.shape
    ends = counts.cumsum(0)
    r = torch.arange(rows, device=counts.device)
    seq = torch.searchsorted(ends, r, right=True).clamp(max=B - 1)
    col = (r - (ends[seq] - counts[seq])).clamp(0, D - 1)
    valid = r < ends[-1]
    flat = seq * D + col
    ids = torch.where(valid, tokens.reshape(-1)[flat], 0)
    hidden = features.reshape(B * D, -1)[flat] * valid[:, None].to(features.dtype)
    return ids, hidden


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
        g = self._graph("extend", B, Q, hidden.shape[1])
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

    def run_extend_on_device(self, chunks: list[SeqChunk], counts: torch.Tensor, tokens: torch.Tensor,
                             features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``run_extend`` of rows still on the device: sequence i (``chunks[i]``: its first row and block
        table) brings ``counts[i]`` rows, the features ``features[i]`` [D, width] paired with the tokens
        ``tokens[i]`` [D] (columns past the count: padding). The host sends what it knows (first rows,
        tables); the rows are packed on the device (``pack_rows``); nothing waits. None when D exceeds
        ``extend_tokens``."""
        B, D = padded_batch(len(chunks)), tokens.shape[1]
        if D > self.extend_tokens:
            return None
        g = self._graph("extend_rows", B, self.extend_tokens, features.shape[2])
        if g is None:
            return None
        buf, turn, v = self._pinned(g)
        k = len(chunks)
        self._fill(v, chunks)
        self._send(g, buf, turn)  # then the counts, tokens and features, from the device
        g_counts, g_tokens, g_features = g.rows
        if B > k:
            g_counts[k:].zero_()  # padding sequences: no rows
        g_counts[:k].copy_(counts)
        g_tokens[:k, :D].copy_(tokens)
        g_features[:k, :D].copy_(features)
        g.graph.replay()
        self.replays += 1
        return g.last, g.logp

    def capture_extend(self, batch: int, hidden_size: int, chained: bool = False) -> None:
        """Capture the extend graphs (a step's rows, a backlog's; ``chained``: also a step's rows fed
        from the device, ``run_extend_on_device``) of a padded ``batch`` now (start-up) rather than on
        first use."""
        for rows in sorted({self.extend_tokens, self.backlog_rows(batch)}):
            self._graph("extend", padded_batch(batch), rows, hidden_size)
        if chained:
            self._graph("extend_rows", padded_batch(batch), self.extend_tokens, hidden_size)

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
        assert kind in ("extend", "extend_rows"), kind
        T, dev = B * F, self.device
        shapes = {"starts": (B,), "counts": (B,), "tables": (B, self.table_width), "ids": (T,)}
        views, at = {}, 0
        for name in _FIELDS:
            views[name] = (at, shapes[name])
            at += int(np.prod(shapes[name]))
        meta_buffer = torch.zeros(at, dtype=torch.int64, device=dev)
        field = {name: meta_buffer[o:o + int(np.prod(s))].view(s) for name, (o, s) in views.items()}
        # Placeholder inputs for the capture: every sequence without rows (counts 0), writing nothing.
        dtype = self.net.norm.weight.dtype
        hidden = torch.zeros(T, hidden_size, dtype=dtype, device=dev)
        rows = None if kind == "extend" else (torch.zeros(B, dtype=torch.int64, device=dev),
                                              torch.zeros(B, F, dtype=torch.int64, device=dev),
                                              torch.zeros(B, F, hidden_size, dtype=dtype, device=dev))

        def forward():
            counts, ids, feats = (field["counts"], field["ids"], hidden) if rows is None else \
                (rows[0], *pack_rows(*rows, T))
            lay = extend_layout(field["starts"], counts, field["tables"], self.kv.block_size, F)
            meta = AttentionMetadata(query_start_loc=lay["qsl"], seq_lens=lay["seq_lens"], block_tables=field["tables"],
                                     slot_mapping=lay["slots"], positions=lay["positions"],
                                     token_seq=lay["token_seq"], token_q_idx=lay["q_idx"], max_query_len=F,
                                     max_seq_len=self.max_seq_len)
            out = self.net(ids, feats, self.kernels.prepare_attention(meta), self.kv, self.kernels)
            last = out[lay["rows"]]
            return last, torch.log_softmax(self.net.compute_logits(last, self.kernels), dim=-1)

        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            forward()  # compiles the kernels and settles the allocator before capture
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            last, logp = forward()
        self._grow_ring(meta_buffer.numel())
        return _Graph(graph, hidden, meta_buffer, views, last, logp, rows)
