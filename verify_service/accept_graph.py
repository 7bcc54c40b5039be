"""Greedy acceptance of chained trees as one CUDA graph (``AcceptGraph``), the trees written into the
verification's inputs as another (``TreeInputsGraph``), and the two things every acceptance hands on:
the draft's feed and the values the host reads (``feeds_of``, ``values_of``).

A chained step verifies trees still on the device through a captured forward graph; its acceptance
(argmax, the tree walk, the KV compaction, the gather of the draft's features and feed) is then
captured on that graph's static inputs and outputs, one graph per (trees, nodes, depth), so it
costs the host one replay instead of some thirty launches from Python.
"""

from __future__ import annotations

import torch

from kernels import KernelSet
from runtime.graphs import capture_graph
from runtime.kv_cache import PagedKVCache


def feeds_of(r, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's feed after acceptance result ``r`` over the trees' ``tokens`` [B, N+1] (root in column 0):
    the counts k + 1 [B] and the tokens [B, D] that follow the features along each path (the accepted
    nodes', then the bonus token; columns past k: padding)."""
    along = torch.gather(tokens, 1, r.path.clamp(min=0))  # column j: path node j's token
    following = torch.cat([along[:, 1:], along[:, :1]], dim=1)
    following.scatter_(1, r.num_accepted[:, None].long(), r.bonus[:, None].to(following.dtype))
    return r.num_accepted.long() + 1, following


def values_of(r) -> torch.Tensor:
    """What the host reads of acceptance result ``r``, flat: every path, then the accepted counts, then the
    bonus tokens."""
    return torch.cat([r.path.flatten(), r.num_accepted, r.bonus])


class AcceptGraph:
    """Greedy acceptance of B trees of n nodes (depth at most D), its KV compaction, the gather of the
    draft's features and its feeds, captured as one CUDA graph on a forward graph's static inputs and
    outputs: a chained step's acceptance costs the host one replay, not some thirty launches. The trees'
    tokens are read where the step's layout holds them (its input ids, the roots' among them), the
    prefixes from its sequence lengths, the block tables from its tables; only the parents come in
    (``parents``, copied from the trees before each replay)."""

    def __init__(self, k: KernelSet, kv: PagedKVCache, source, B: int, n: int, D: int):
        """``k``: the kernel set; ``kv``: the target's cache; ``source``: the forward graph (its layout and
        outputs); B trees of n nodes, at most D levels deep."""
        lay, rows, dev = source.layout, B * (n + 1), source.logits.device
        self.parents = torch.zeros(B, n, dtype=torch.int64, device=dev)
        num_nodes = torch.full((B,), n + 1, dtype=torch.int64, device=dev)
        starts = torch.arange(B, device=dev)[:, None] * (n + 1)  # each tree's first row in the step
        self._constants = (num_nodes, starts)  # the graph reads them: they live as long as it does

        def body(compact: bool):
            tokens = lay.input_ids[:rows].view(B, n + 1)
            parents = torch.nn.functional.pad(self.parents + 1, (1, 0), value=-1)
            argmax = k.argmax(source.logits[:rows]).view(B, n + 1)
            result = k.greedy_accept(argmax, tokens, parents, num_nodes, D)
            prefix = lay.meta.seq_lens[:B] - (n + 1)
            src, dst = k.compaction_slots(result.path, result.num_accepted, prefix, lay.meta.block_tables[:B],
                                          kv.block_size)
            if compact:
                k.compact_kv(kv.data, src, dst)
            features = source.captured[starts + result.path.clamp(min=0)] if source.captured is not None else None
            return result, tokens, features, (feeds_of(result, tokens), values_of(result))

        # The warm-up run compacts nothing (moving the KV twice would move it wrongly); a private memory
        # pool: no other graph reuses its outputs.
        self.graph, (self.result, self.tokens, self.features, self.computed) = capture_graph(
            lambda: body(compact=True), dev, warm=lambda: body(compact=False))


def write_device_trees(k: KernelSet, layout, trees: torch.Tensor, num_nodes: torch.Tensor | None = None) -> None:
    """Trees on the device (int64 [3+, B, n]: tokens | parents | depths) written into ``layout``'s inputs
    after its ``fill_roots``: the nodes' tokens and positions and their packed ancestor masks.
    ``num_nodes``: n for each tree, int64 [B] (default: made here)."""
    tokens, parents, depths = trees[0], trees[1], trees[2]
    if num_nodes is None:
        num_nodes = torch.full((tokens.shape[0],), tokens.shape[1], dtype=torch.int64, device=tokens.device)
    layout.write_trees(tokens, depths, k.packed_tree_mask(parents, num_nodes))


class TreeInputsGraph:
    """B chained trees of n nodes written into a forward graph's inputs (``write_device_trees``) as one
    CUDA graph on that layout: the host copies the trees into ``nodes`` and replays it, where it
    launched the mask kernel and the writes from Python while the device waited for the step (the host
    lays a chained step out while the device runs the draft). Capturing it runs the writes once on
    placeholder trees (children of the root); the next ``write`` rewrites every input they touched."""

    def __init__(self, k: KernelSet, layout, B: int, n: int):
        dev = layout.device_buffer.device
        self.nodes = torch.zeros(3, B, n, dtype=torch.int64, device=dev)  # tokens | parents | depths
        self.nodes[1] = -1
        self.nodes[2] = 1
        self._num_nodes = torch.full((B,), n, dtype=torch.int64, device=dev)  # (read by the graph)
        self.graph, _ = capture_graph(lambda: write_device_trees(k, layout, self.nodes, self._num_nodes), dev)

    def write(self, trees: torch.Tensor) -> None:
        """Write ``trees`` (int64 [4, B, n] on the device: tokens | parents | depths | scores) into the
        layout's inputs, behind the work queued before."""
        self.nodes.copy_(trees[:3])
        self.graph.replay()
