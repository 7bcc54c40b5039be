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
             per level: slots/positions/lengths from rows and tables, the feed mask,
                        parents' outputs -> draft forward -> log-softmax -> builder.expand
             builder.finish (re-rank the final nodes, parents first)
             -> tokens | parents | depths | score bits, packed [4, B, n]
    host:    the packed trees, the proposal's ONE device-to-host copy

Batches are padded to a power of two: padding rows are not ``live``, write no KV (slot -1)
and give trees no one reads. Without CUDA graphs (a CPU, the reference kernels) the same
computation runs eagerly, so the CPU tests check it against the level-by-level drafter.
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import torch

from draft_service.eagle_net import EagleNet
from draft_service.tree_builders import Frontier
from kernels import KernelSet
from kernels.metadata import AttentionMetadata
from runtime.kv_cache import PagedKVCache

log = logging.getLogger(__name__)


def padded_batch(n: int) -> int:
    """The batch a proposal of ``n`` sequences is captured for: the next power of two."""
    return 1 << max(0, n - 1).bit_length()


class DeviceProposal:
    """Trees of one shape for up to ``batch`` sequences, grown to the shape's full ``depth``; the
    levels occupy at most ``tree_rows`` draft KV rows past each sequence's committed ones."""

    def __init__(self, net: EagleNet, kv: PagedKVCache, kernels: KernelSet, make_builder: Callable[[], object],
                 depth: int, tree_rows: int, batch: int, table_width: int, max_seq_len: int, graph: bool, pool=None):
        self.net, self.kv, self.kernels = net, kv, kernels
        self.builder = make_builder()  # one builder for every run: a static shape keeps its level tensors
        self.depth, self.tree_rows, self.batch, self.max_seq_len = depth, tree_rows, batch, max_seq_len
        weight = net.norm.weight
        dev = self.device = weight.device
        B = batch
        # Host inputs, sent in one copy: rows | live | tables.
        self._meta = torch.zeros(2 * B + B * table_width, dtype=torch.int64, device=dev)
        self._host = torch.zeros_like(self._meta, device="cpu", pin_memory=dev.type == "cuda")
        self._host_view = self._host.numpy()
        self.rows, self.live = self._meta[:B], self._meta[B:2 * B]
        self.tables = self._meta[2 * B:].view(B, table_width)
        self.root_logp = torch.zeros(B, net.d2t.shape[0], dtype=torch.float32, device=dev)
        self.root_out = torch.zeros(B, net.config.hidden_size, dtype=weight.dtype, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        self._packed: torch.Tensor | None = None  # the graph's output
        self._constants: dict[int, tuple[torch.Tensor, ...]] = {}
        self.replays = 0
        # Attention's ``max_seq_len``: the cache's capacity in a graph (its grid never depends on a
        # step's lengths); an eager run's own longest sequence (a CPU's dense reference mask).
        self._longest = max_seq_len
        if graph:
            self._capture(pool)

    def run(self, root_logp: torch.Tensor, root_out: torch.Tensor, rows: np.ndarray,
            tables: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Trees of ``len(rows)`` sequences (root log-probs [n, Vd], root outputs [n, H], committed draft
        rows, block tables covering the rows the levels write): host arrays tokens, parents, depths,
        scores, each [n, nodes]."""
        n = len(rows)
        assert n <= self.batch, (n, self.batch)
        host = self._host_view
        B, W = self.batch, self.tables.shape[1]
        host[:] = 0
        host[:n] = rows
        host[B:B + n] = 1
        table_block = host[2 * B:].reshape(B, W)
        for i, t in enumerate(tables):
            table_block[i, :len(t)] = t
        self._meta.copy_(self._host, non_blocking=True)
        self.root_logp[:n].copy_(root_logp)
        self.root_out[:n].copy_(root_out)
        if self.graph is not None:
            self.graph.replay()
            packed = self._packed
        else:
            self._longest = int(np.max(rows)) + self.tree_rows if n else self.tree_rows
            packed = self._grow()
        self.replays += self.graph is not None
        out = packed.cpu().numpy()[:, :n]  # the proposal's one device-to-host copy
        return out[0], out[1], out[2], out[3].astype(np.int32).view(np.float32)

    # --- the computation (captured once, or run eagerly) ----------------------------------

    def _grow(self) -> torch.Tensor:
        builder = self.builder
        frontier = builder.start(self.root_logp)
        parent_out = self.root_out[:, None]  # (B, 1, H): the root's output
        fed = 0
        while frontier is not None and frontier.depth < self.depth:
            out, logp = self._level(frontier, parent_out, fed)
            fed += frontier.tokens.shape[1]
            parent_out = out
            frontier = builder.expand(logp)
        tokens, parents, depths, scores = builder.finish_tensors()
        return torch.stack([tokens, parents, depths, scores.view(torch.int32).to(torch.int64)])

    def _level(self, frontier: Frontier, parent_out: torch.Tensor, fed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One level: its ``F`` nodes a sequence go to draft KV rows ``rows + fed ..`` at RoPE position
        ``rows + depth - 1`` and see the committed rows plus their fed ancestors and themselves."""
        B, F = frontier.tokens.shape
        bs = self.kv.block_size
        masks = self.builder.feed_mask(frontier)  # (B, F, fed + F)
        slot = frontier.parent_slot.clamp(min=0)
        hidden = torch.gather(parent_out, 1, slot[..., None].expand(-1, -1, parent_out.shape[2]))
        j, qsl, token_seq, q_idx = self._level_constants(F)
        kv_idx = self.rows[:, None] + fed + j  # (B, F)
        blocks = self.tables.gather(1, kv_idx // bs)
        slots = torch.where(self.live[:, None] > 0, blocks * bs + kv_idx % bs, -1)
        # Materialised, not expanded views: kernels index these [T] arrays as contiguous memory (at
        # B = 1 an expanded view flattens to a stride-0 view of one element).
        positions = (self.rows + frontier.depth - 1)[:, None].expand(B, F).contiguous()
        meta = AttentionMetadata(
            query_start_loc=qsl, seq_lens=self.rows + fed + F, block_tables=self.tables,
            slot_mapping=slots.reshape(-1), positions=positions.reshape(-1),
            token_seq=token_seq, token_q_idx=q_idx, max_query_len=F,
            max_seq_len=min(self._longest, self.max_seq_len), custom_mask=masks.reshape(B * F, -1), mask_start=self.rows)
        out = self.net(frontier.tokens.reshape(-1), hidden.reshape(B * F, -1), self.kernels.prepare_attention(meta),
                       self.kv, self.kernels)
        logp = torch.log_softmax(self.net.compute_logits(out, self.kernels), dim=-1)
        return out.view(B, F, -1), logp.view(B, F, -1)

    def _level_constants(self, F: int) -> tuple[torch.Tensor, ...]:
        """A level of width F's fixed arrays (node index, query starts, each token's sequence and index),
        made on the first (eager) run: the graph reads them instead of launching kernels for them."""
        if F not in self._constants:
            B, dev = self.batch, self.device
            j = torch.arange(F, device=dev)
            self._constants[F] = (j, torch.arange(B + 1, device=dev) * F,
                                  torch.arange(B, device=dev).repeat_interleave(F), j.repeat(B))
        return self._constants[F]

    def _capture(self, pool) -> None:
        """Warm up eagerly on a side stream (compiles kernels, builds a static shape's level tensors),
        then capture. The placeholder inputs are not live: nothing is written to the cache."""
        dev = self.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            self._grow()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self._packed = self._grow()
        self.graph = graph
