"""A whole proposal on the device: every tree level of one tree shape for a batch of sequences,
with no host work between levels, replayed as ONE CUDA graph.

The level-by-level drafter lays out each level on the host (KV slots, positions, lengths), so a
proposal costs the host a layout, a copy and a launch per level, plus the builder's small top-k,
score and mask kernels launched from Python. Here the host sends, once per proposal, what it
alone knows (each sequence's committed draft rows and block table); the levels' metadata is
computed from them on the device::

    host:    rows [B], tables [B, W], live [B]            -> one copy (pinned)
    device:  root log-probs, root outputs                 -> the graph's buffers
    graph:   builder.start (top-k through d2t)
             every level's slots/positions/lengths from rows and tables, at once (_kv_layout)
             per level: the packed feed mask (its parents' rows | its own bits),
                        parents' outputs -> draft forward -> logits -> builder.expand
             builder.finish (re-rank the final nodes, parents first)
             -> tokens | parents | depths | score bits, packed [4, B, n]
    host:    the packed trees, the proposal's ONE device-to-host copy (started by ``launch``,
             waited for by ``collect``: the host may work meanwhile)

Batches are padded to a power of two: padding rows are not ``live``, write no KV (slot -1)
and give trees no one reads. Without CUDA graphs (a CPU, the reference kernels) the same
computation runs eagerly, so the CPU tests check it against the level-by-level drafter.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from draft_service.eagle_net import EagleNet
from draft_service.tree_builders import Frontier
from kernels import KernelSet
from kernels.metadata import AttentionMetadata
from runtime.graphs import capture_graph
from runtime.kv_cache import PagedKVCache
from runtime.step_layout import Readback

log = logging.getLogger(__name__)


def padded_batch(n: int) -> int:
    """The batch a proposal of ``n`` sequences is captured for: the next power of two."""
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True, eq=False)
class _Level:
    """A level's fixed arrays: the graph reads them instead of launching kernels for them."""

    width: int  # F: nodes a sequence
    tokens: slice  # the level's tokens among all levels' (``_Layout``'s flat order)
    qsl: torch.Tensor  # int64 [B + 1]: query starts
    token_seq: torch.Tensor  # int64 [B * F]: each token's sequence
    q_idx: torch.Tensor  # int64 [B * F]: each token's node index
    own: torch.Tensor  # int32 [F, words]: node j's own feed column, fed + j, as a packed mask bit


@dataclass(frozen=True, eq=False)
class _Layout:
    """Every level's tokens in one flat order, level by level, then sequence, then node::

        token:  level 0: b0 j0 .. b0 jF-1, b1 j0 ..  | level 1: ..
        seq:    b                                     (its sequence)
        row:    fed + j                               (its KV row past the committed ones)
        step:   depth - 1                             (its RoPE position past them)
    """

    seq: torch.Tensor  # int64 [T]
    row: torch.Tensor  # int64 [T]
    step: torch.Tensor  # int64 [T]
    lens: torch.Tensor  # int64 [levels]: fed + F, the draft rows past the committed ones once a level is fed
    levels: list[_Level]


def _level_layout(widths: list[int], batch: int, device: torch.device) -> _Layout:
    """The layout of levels of ``widths`` nodes a sequence for ``batch`` sequences. The packed masks
    have one 32-column word per 32 nodes fed in all; a level's columns past its own are zero."""
    B, words = batch, max(1, -(-sum(widths) // 32))
    seq, row, step, lens, levels = [], [], [], [], []
    fed = 0
    for i, F in enumerate(widths):
        j = np.arange(F)
        seq.append(np.repeat(np.arange(B), F))
        row.append(np.tile(fed + j, B))
        step.append(np.full(B * F, i))
        lens.append(fed + F)
        own = np.zeros((F, words), dtype=np.uint32)
        own[j, (fed + j) // 32] = np.left_shift(np.uint32(1), ((fed + j) % 32).astype(np.uint32))
        own = torch.from_numpy(own.view(np.int32)).to(device)
        levels.append(_Level(F, slice(B * fed, B * (fed + F)), torch.arange(B + 1, device=device) * F,
                             torch.from_numpy(seq[-1]).to(device), torch.from_numpy(j).repeat(B).to(device),
                             own))
        fed += F
    cat = [torch.from_numpy(np.concatenate(x) if x else np.zeros(0, dtype=np.int64)).to(device)
           for x in (seq, row, step)]
    return _Layout(*cat, torch.tensor(lens, dtype=torch.int64, device=device), levels)


_UNKNOWN = object()  # a table row written from something other than a list: always rewritten


class DeviceProposal:
    """Trees of one shape for up to ``batch`` sequences, grown to the shape's full ``depth``; the
    levels occupy at most ``tree_rows`` draft KV rows past each sequence's committed ones."""

    def __init__(self, net: EagleNet, kv: PagedKVCache, kernels: KernelSet, make_builder: Callable[[], object],
                 depth: int, tree_rows: int, batch: int, table_width: int, max_seq_len: int, graph: bool, pool=None):
        self.net, self.kv, self.kernels = net, kv, kernels
        self.builder = make_builder()  # one builder for every run: a static shape keeps its level tensors and pool
        self.depth, self.tree_rows, self.batch, self.max_seq_len = depth, tree_rows, batch, max_seq_len
        weight = net.norm.weight
        dev = self.device = weight.device
        B = batch
        # Host inputs, sent in one copy: rows | live | tables.
        self._meta = torch.zeros(2 * B + B * table_width, dtype=torch.int64, device=dev)
        # Two pinned host buffers, used in turn; each one's copy to the device is recorded, and a launch
        # rewrites a buffer only once its last copy has run (two launches ago: normally long done; a
        # launch need not wait for the last one's trees, and a draft service's chained steps never do).
        self._hosts = [torch.zeros_like(self._meta, device="cpu", pin_memory=dev.type == "cuda") for _ in range(2)]
        self._host_views = [h.numpy() for h in self._hosts]
        self._sent = [torch.cuda.Event() if dev.type == "cuda" else None for _ in range(2)]
        self._sending = [False, False]
        self._turn = 0
        # What each host buffer's table rows hold (a copy of the table written there; None: zeros): a
        # chained step sends the same tables step after step, and comparing a row costs a tenth of
        # rewriting it.
        self._table_rows: list[list] = [[None] * B for _ in range(2)]
        self.rows, self.live = self._meta[:B], self._meta[B:2 * B]
        self.tables = self._meta[2 * B:].view(B, table_width)
        self.root_logp = torch.zeros(B, net.d2t.shape[0], dtype=torch.float32, device=dev)
        self.root_out = torch.zeros(B, net.config.hidden_size, dtype=weight.dtype, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        self._readback = Readback(dev)  # the trees' copy to the host
        self._packed: torch.Tensor | None = None  # the graph's output
        widths = self.builder.frontier_widths()[:depth - 1]  # the levels fed: frontiers above ``depth``
        assert sum(widths) <= tree_rows, (widths, tree_rows)
        self._layout = _level_layout(widths, B, dev)
        self.replays = 0
        # Attention's ``max_seq_len``: the cache's capacity in a graph (its grid never depends on a
        # step's lengths); an eager run's own longest sequence (a CPU's dense reference mask).
        self._longest = max_seq_len
        if graph:
            self._capture(pool)

    def run(self, root_logp: torch.Tensor, root_out: torch.Tensor, rows: np.ndarray,
            tables: list[list[int]], more_rows: torch.Tensor | None = None
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Trees of ``len(rows)`` sequences (root log-probs [n, Vd], root outputs [n, H], committed draft
        rows, block tables covering the rows the levels write): host arrays tokens, parents, depths,
        scores, each [n, nodes]. ``more_rows`` [n]: rows committed on top of ``rows`` that only the
        device knows yet (a graph only: an eager proposal lays its levels out from the host's rows)."""
        return self.collect(self.launch(root_logp, root_out, rows, tables, more_rows)[0])

    def launch(self, root_logp: torch.Tensor, root_out: torch.Tensor, rows: np.ndarray,
               tables: list[list[int]], more_rows: torch.Tensor | None = None,
               to_host: bool = True) -> tuple[int, torch.Tensor]:
        """``run``'s work, queued: the trees' copy to the host is started, not waited for. Returns the
        ticket ``collect`` takes (the next ``launch`` must come after it; 0 and no copy where
        ``to_host`` is off: the trees stay on the device) and the trees on the device, int64
        [4, n, nodes] (tokens | parents | depths | score bits; valid until the next launch)."""
        assert more_rows is None or self.graph is not None, "an eager proposal lays out from host rows"
        n = len(rows)
        self.send(rows, tables)
        if more_rows is not None:
            self.rows[:n].add_(more_rows)
        self.root_logp[:n].copy_(root_logp)
        self.root_out[:n].copy_(root_out)
        if self.graph is not None:
            self.graph.replay()
            packed = self._packed
        else:
            self._longest = int(np.max(rows)) + self.tree_rows if n else self.tree_rows
            packed = self.grow(self.root_logp, self.root_out)
        self.replays += self.graph is not None
        return (self.copy_out(packed[:, :n]) if to_host else 0), packed[:, :n]

    def copy_out(self, trees: torch.Tensor) -> int:
        """Start the copy of ``trees`` (this proposal's, [4, n, nodes]) to the host, the proposal's one
        device-to-host copy; returns the ticket ``collect`` takes."""
        return self._readback.start(trees)

    def send(self, rows: np.ndarray, tables: list[list[int]], live: np.ndarray | int = 1) -> None:
        """The host's inputs of ``len(rows)`` sequences (their committed draft rows and block tables; the
        rest of the batch: padding, not ``live``) to ``rows``, ``live`` and ``tables``: one copy from the
        pinned buffer whose turn it is. ``live``: what the sequences' entries hold (any value above 0:
        a chained step's most rows a sequence, ``chain_graph.py``)."""
        n = len(rows)
        assert n <= self.batch, (n, self.batch)
        self._turn ^= 1
        turn = self._turn
        if self._sending[turn]:
            self._sent[turn].synchronize()
        host = self._host_views[turn]
        B, W = self.batch, self.tables.shape[1]
        host[:2 * B] = 0
        host[:n] = rows
        host[B:B + n] = live
        table_block, held = host[2 * B:].reshape(B, W), self._table_rows[turn]
        for i, t in enumerate(tables):
            if type(t) is not list or held[i] != t:
                table_block[i] = 0
                table_block[i, :len(t)] = t
                held[i] = list(t) if type(t) is list else _UNKNOWN
        for i in range(n, B):  # rows past the batch's: zeros
            if held[i] is not None:
                table_block[i] = 0
                held[i] = None
        self._meta.copy_(self._hosts[turn], non_blocking=True)
        if self._sent[turn] is not None:
            self._sent[turn].record()
            self._sending[turn] = True

    def collect(self, ticket: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The trees of ``launch``'s ``ticket`` on the host (waits for the copy): tokens, parents,
        depths, scores, each [n, nodes]."""
        out = self._readback.wait(ticket)
        return out[0], out[1], out[2], out[3].astype(np.int32).view(np.float32)

    # --- the computation (captured once, or run eagerly) ----------------------------------

    def grow(self, root_logp: torch.Tensor, root_out: torch.Tensor) -> torch.Tensor:
        """The trees grown from the roots' log-probs [B, Vd] and outputs [B, H], laid out from ``rows``,
        ``live`` and ``tables`` (as they are on the device when it runs: a graph captures it), packed
        int64 [4, B, nodes]: tokens | parents | depths | score bits."""
        builder = self.builder
        frontier = builder.start(root_logp)
        kv = self._kv_layout()
        parent_out, mask = root_out[:, None], None  # (B, 1, H): the root's output; its mask: none
        while frontier is not None and frontier.depth < self.depth:
            parent_out, logits, mask = self._level(frontier, parent_out, mask, kv)
            frontier = builder.expand(logits)
        tokens, parents, depths, scores = builder.finish_tensors()
        return torch.stack([tokens, parents, depths, scores.view(torch.int32).to(torch.int64)])

    def _kv_layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every level's KV slots and RoPE positions [all levels' tokens] and lengths [levels, B], from
        this proposal's rows and tables, in one go (``kernels.proposal_layout``: one launch on the GPU
        sets): a level reads its slices (no launches of its own).
        Token t of level i, sequence b, node j goes to KV row rows[b] + fed_i + j at position
        rows[b] + depth_i - 1; a padding sequence (not ``live``) writes nowhere (slot -1)."""
        c = self._layout
        return self.kernels.proposal_layout(self.rows, self.live, self.tables, c.seq, c.row, c.step, c.lens,
                                            self.kv.block_size)

    def _level(self, frontier: Frontier, parent_out: torch.Tensor, mask: torch.Tensor | None,
               kv: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One level: its ``F`` nodes a sequence go to draft KV rows ``rows + fed ..`` at RoPE position
        ``rows + depth - 1`` and see the committed rows plus their fed ancestors and themselves: their
        parents' mask rows (``mask``, the previous level's) plus their own columns. Returns the level's
        outputs [B, F, H], logits [B, F, Vd] and packed mask rows [B, F, words]."""
        B, F = frontier.tokens.shape
        level = self._layout.levels[frontier.depth - 1]
        assert F == level.width, (F, level.width)
        mid = self.net.midlayer
        # Parents' outputs and feed-mask rows gathered, the embeddings looked up and both input norms
        # taken: one launch on the GPU sets (at depth 1 every parent is the root, and no mask yet).
        x, hidden, mask = self.kernels.level_input(
            parent_out, frontier.parent_slot, frontier.tokens, self.net.embed_weight, mid.input_layernorm.weight,
            mid.input_layernorm.eps, mid.hidden_norm.weight, mid.hidden_norm.eps, mask, level.own)
        slots, positions, lens = kv
        meta = AttentionMetadata(
            query_start_loc=level.qsl, seq_lens=lens[frontier.depth - 1], block_tables=self.tables,
            slot_mapping=slots[level.tokens], positions=positions[level.tokens],
            token_seq=level.token_seq, token_q_idx=level.q_idx, max_query_len=F,
            max_seq_len=min(self._longest, self.max_seq_len), custom_mask=mask.view(B * F, -1), mask_start=self.rows)
        # Logits, not log-probs: the builder's top-k normalises them (``draft_topk``), a log-softmax
        # over the whole draft vocabulary first would only repeat that; in the head's dtype, as the
        # top-k reads them.
        out, logits = self.net.level_logits(x, hidden, self.kernels.prepare_attention(meta), self.kv, self.kernels,
                                            float32=False)
        return out.view(B, F, -1), logits.view(B, F, -1), mask

    def _capture(self, pool) -> None:
        """Warm up eagerly on a side stream (compiles kernels, builds a static shape's level tensors),
        then capture. The placeholder inputs are not live: nothing is written to the cache."""
        self.graph, self._packed = capture_graph(lambda: self.grow(self.root_logp, self.root_out), self.device, pool)
