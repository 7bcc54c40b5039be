"""Tree verification on the target: build the tree chunk, accept, compact the KV cache.

One verification step for a sequence with newest (uncached) token r at position n and a
candidate tree of N nodes::

    target input   r      node 0 ... node N-1
    KV index       n      n+1    ... n+N          (written by the forward)
    RoPE position  n      n+depth(node)
    mask           prefix + root + ancestors + self

Acceptance walks the tree from r (greedy: child == target argmax at its parent; sampling: by
default child == the target's own seeded sample at its parent, or the residual rule) and yields the accepted path a_1..a_k plus a bonus token b.
Compaction then moves the KV of a_1..a_k to indices n+1..n+k, the cache is cut to n+k+1
entries (r and the accepted nodes; b is the next newest token) and the rest is released.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from link.protocol import DraftFeed
from runtime.step_layout import SeqChunk, Staging, pad_rows
from runtime.tree import CandidateTree, ancestor_masks, pad_trees
from verify_service.accept_graph import AcceptGraph, feeds_of, values_of
from verify_service.model_runner import StepOutput
from verify_service.replay import AcceptanceReplay
from verify_service.sampler import Sampler
from verify_service.sequence import Sequence
from verify_service.target import Target

log = logging.getLogger(__name__)


class Verified:
    """One sequence's verified tree. Not a frozen dataclass, and its draft feed made only when read: a
    chained step (the draft fed on the device) reads none, and a step builds one per sequence (its
    host work is the critical path from batch 16 up). Treat it as read-only."""

    __slots__ = ("seq", "tokens", "start", "tree", "accepted", "_features", "_row")

    def __init__(self, seq: Sequence, tokens: list[int], start: int, tree: CandidateTree, accepted: list[int],
                 features: torch.Tensor | None, row: int):
        self.seq = seq
        self.tokens = tokens  # accepted node tokens, then the bonus token
        self.start = start  # the root's position: the feed's first row
        self.tree = tree  # the tree verified
        self.accepted = accepted  # its accepted nodes a_1..a_k (node indices, root excluded)
        self._features, self._row = features, row  # the step's gathered features [B, D, width], this row's

    @property
    def feed(self) -> DraftFeed:
        """Features of r, a_1..a_k paired with a_1..a_k, b (a view of the step's gathered features)."""
        feats = self._features[self._row, :len(self.tokens)] if self._features is not None else None
        return DraftFeed(self.seq.seq_id, self.start, feats, np.asarray(self.tokens, dtype=np.int64))


def tree_chunks(seqs: list[Sequence], tables: list[list[int]], padded: tuple | None = None) -> list[SeqChunk]:
    """The verification inputs of ``seqs``: each newest token followed by its tree's nodes.

    The step layout is built on the host, so are the masks and positions: one batched pass each
    for every tree of the step (trees arrive validated: parents before children); the chunks'
    arrays are views of the batch's. ``padded``: ``padded_trees(seqs)``, when the caller has it.
    """
    tokens, parents, depths, num_nodes = padded or padded_trees(seqs)  # (B, N+1), root in column 0
    masks = ancestor_masks(parents[:, 1:] - 1, num_nodes, int(depths.max()))  # (B, N+1, N+1)
    # tree_positions_ref's: the root at its KV index, node i at that + depths[i], padding as the root.
    positions = np.fromiter((s.num_cached for s in seqs), dtype=np.int64, count=len(seqs))[:, None] + depths
    rows = np.arange(tokens.shape[1])
    return [SeqChunk(tokens[i, :n + 1], s.num_cached, table, logits_rows=rows[:n + 1],
                     positions=positions[i, :n + 1], custom_mask=masks[i, :n + 1, :n + 1])
            for i, (s, n, table) in enumerate(zip(seqs, num_nodes.tolist(), tables))]


def padded_trees(seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The sequences' trees as [B, N+1] arrays with the root in column 0 (kernel convention):
    tokens (the root's: the newest token), parents (columns; -1 for the root and padding) and
    depths (root 0), and the node counts [B] (root excluded). A step computes them once, for its
    layout (``tree_chunks``) and its acceptance (``TreeVerifier.accept``); both only read them."""
    tokens, parents, depths, num_nodes = pad_trees([s.tree for s in seqs], root_column=True)
    tokens[:, 0] = [s.output_ids[-1] for s in seqs]
    return tokens, parents, depths, num_nodes


@dataclass(frozen=True, slots=True)
class PendingVerification:
    """Acceptance launched on the device, waiting for the step's one device-to-host copy."""

    seqs: list[Sequence]
    result: object  # kernels.acceptance.AcceptResult
    features: torch.Tensor  # [B, max_depth + 1, k * hidden]: the captured rows along each accepted path
    tokens: torch.Tensor  # int64 [B, N+1]: the trees' tokens on the device, the root's in column 0
    most: list[int]  # each sequence's node count + 1: the most rows its feed brings
    computed: tuple | None = None  # (feeds_on_device(), device_values()), when a graph computed them already

    def feeds_on_device(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's feed of each sequence, before the host knows it: the counts k + 1 [B] and the
        tokens [B, D] that follow the features along the path (the accepted nodes', then the bonus
        token; columns past k: padding). No host sync."""
        if self.computed is not None:
            return self.computed[0]
        return feeds_of(self.result, self.tokens)

    def device_values(self) -> torch.Tensor:
        """What the host needs, flat: every path, then the accepted counts, then the bonus tokens."""
        if self.computed is not None:
            return self.computed[1]
        return values_of(self.result)


class TreeVerifier:
    def __init__(self, target: Target, sampler: Sampler, replay: AcceptanceReplay | None = None):
        """``replay``: BENCHMARKS ONLY, acceptance taken from a recorded trace (outputs meaningless)."""
        self.target = target
        self.sampler = sampler
        self.replay = replay
        self.kernels = target.runner.kernels
        self.staging = Staging(target.device)  # the acceptance inputs: one host-to-device copy
        # Greedy acceptance of trees verified from the device by a forward graph, as a graph of its
        # own (``AcceptGraph``); off: launched op by op (tests compare the two).
        self.graph_acceptance = True
        self.graph_accepts = 0  # acceptances that replayed such a graph (a metric; tests read it)

    def accept(self, seqs: list[Sequence], logits_start: list[int], row_start: list[int],
               out: StepOutput, padded: tuple | None = None, on_device: torch.Tensor | None = None) -> PendingVerification:
        """Launch acceptance, KV compaction and the gather of the draft's features, all on the
        device; nothing waits. ``logits_start[i]``/``row_start[i]``: where sequence i's rows begin
        in ``out.logits`` and in the flat batch (``out.captured``); ``padded``: ``padded_trees(seqs)``,
        when the caller has it (the step's layout made it). ``on_device``: the step's trees where it
        verified them from the device (int64 [4, B, n], every tree of n nodes, its logits rows one
        after the other): acceptance reads them there, not from host copies."""
        if on_device is not None and self.replay is None and out.graph is not None and self.graph_acceptance \
                and all(s.params.greedy for s in seqs):
            pending = self._accept_graphed(seqs, out, on_device)
            if pending is not None:
                return pending
        eng = self.target
        table = pad_rows([eng.blocks.block_table(s.seq_id) for s in seqs])
        prefix = np.fromiter((s.num_cached for s in seqs), dtype=np.int64, count=len(seqs))
        rows = np.asarray(row_start, dtype=np.int64)
        if on_device is not None and self.replay is None:
            result, tokens, table, prefix, rows = self._accept_on_device(seqs, logits_start, out, on_device,
                                                                         [table, prefix, rows])
            most = [on_device.shape[2] + 1] * len(seqs)
        else:
            tokens, host_parents, depths, nodes = padded or padded_trees(seqs)  # (B, N+1), root in column 0
            num_nodes = nodes + 1  # with the root
            cols = np.minimum(np.arange(tokens.shape[1])[None, :], nodes[:, None])
            idx = np.asarray(logits_start)[:, None] + cols  # (B, N+1); padding repeats a row
            max_depth = int(depths.max())
            most = num_nodes.tolist()
            idx, tokens, parents, num_nodes, table, prefix, rows, depths = self.staging.upload(
                [idx, tokens, host_parents, num_nodes, table, prefix, rows, depths])
            if self.replay is not None:  # REPLAY (benchmarks only): the trace says how many nodes are accepted
                result = self.replay.accept([s.seq_id for s in seqs], host_parents, nodes + 1, out.logits[idx])
            else:
                result = self._accept(seqs, out.logits[idx], tokens, parents, num_nodes, max_depth, depths)
        src, dst = self.kernels.compaction_slots(result.path, result.num_accepted, prefix, table,
                                                 eng.kv_cache.block_size)
        self.kernels.compact_kv(eng.kv_cache.data, src, dst)
        features = out.captured[rows[:, None] + result.path.clamp(min=0)] if out.captured is not None else None
        return PendingVerification(seqs, result, features, tokens, most)

    @torch.inference_mode()
    def warm_up(self, nodes: int, depth: int) -> int:
        """Capture the acceptance graphs of chained steps of trees of ``nodes`` nodes and ``depth``
        levels, and the graphs that write their trees into the verification's inputs, for every batch
        size a verification graph holds (server start-up: none is captured in the middle of
        serving). Returns how many acceptance graphs were captured."""
        runner, captured, t0 = self.target.runner, 0, time.perf_counter()
        for B in range(1, runner.max_num_seqs + 1):
            graph = runner.tree_graph(B, nodes)
            if graph is not None:
                captured += self._accept_graph(graph, B, nodes, depth)[1]
                runner.tree_inputs(graph, B, nodes)
        if captured:
            log.info("captured %d acceptance graphs (trees of %d nodes) in %.1f s", captured, nodes,
                     time.perf_counter() - t0)
        return captured

    def _accept_graph(self, graph, B: int, n: int, D: int) -> tuple[AcceptGraph | None, bool]:
        """The acceptance graph on forward ``graph`` for (B trees, n nodes, depth D) (None: no memory to
        capture it, those steps accept op by op), and whether it was captured now."""
        key = ("accept", B, n, D)
        if key in graph.followers:
            return graph.followers[key], False
        try:
            g = AcceptGraph(self.kernels, self.target.kv_cache, graph, B, n, D)
        except torch.OutOfMemoryError:  # results stay exact: these steps' acceptance runs op by op
            log.warning("no GPU memory to capture the acceptance graph of %d trees of %d nodes", B, n)
            g = None
            torch.cuda.empty_cache()
        graph.followers[key] = g
        return g, g is not None

    @torch.inference_mode()
    def _accept_graphed(self, seqs: list[Sequence], out: StepOutput, trees: torch.Tensor) -> PendingVerification | None:
        """``accept`` of greedy trees verified from the device by ``out.graph``: one replay of the
        acceptance graph for (B trees, n nodes, depth), captured at start-up (``warm_up``) or first use
        (None: no graph for them)."""
        B, n, D = trees.shape[1], trees.shape[2], seqs[0].tree_settings.depth
        g, _ = self._accept_graph(out.graph, B, n, D)
        if g is None:
            return None
        g.parents.copy_(trees[1])
        g.graph.replay()
        self.graph_accepts += 1
        # The features are the caller's (a feed may wait in the draft's buffer past the next replay).
        features = g.features.clone() if g.features is not None else None
        return PendingVerification(seqs, g.result, features, g.tokens, [n + 1] * B, g.computed)

    def _accept_on_device(self, seqs: list[Sequence], logits_start: list[int], out: StepOutput, trees: torch.Tensor,
                          arrays: list[np.ndarray]):
        """``accept``'s inputs from trees on the device ([4, B, n]: tokens | parents | depths | scores,
        every tree of n nodes): the roots and ``arrays`` go up in one copy, the [B, n + 1] layout
        (root in column 0) is made there. Returns the result, the trees' tokens and ``arrays`` on the device."""
        B, n = trees.shape[1], trees.shape[2]
        assert list(logits_start) == list(range(0, B * (n + 1), n + 1)), "each tree's logits rows, one after the other"
        roots = np.fromiter((s.output_ids[-1] for s in seqs), dtype=np.int64, count=B)
        roots, num_nodes, *arrays = self.staging.upload([roots, np.full(B, n + 1, dtype=np.int64), *arrays])
        tokens = torch.cat([roots[:, None], trees[0]], dim=1)  # (B, n + 1)
        parents = torch.nn.functional.pad(trees[1] + 1, (1, 0), value=-1)  # node i's parent column; the root: -1
        depths = torch.nn.functional.pad(trees[2], (1, 0))
        logits = out.logits[:B * (n + 1)].view(B, n + 1, -1)
        # The trees' depth bound (each grown to its shape's depth at most): the same acceptance as their
        # deepest node's depth, with no host copy to find it.
        max_depth = seqs[0].tree_settings.depth
        return (self._accept(seqs, logits, tokens, parents, num_nodes, max_depth, depths), tokens, *arrays)

    def finish(self, pending: PendingVerification, host: list[int]) -> list[Verified]:
        """Commit what acceptance chose; ``host`` is ``pending.device_values()`` on the host."""
        B, D1 = pending.result.path.shape
        out = []
        for i, seq in enumerate(pending.seqs):
            path, k, bonus = host[i * D1:(i + 1) * D1], host[B * D1 + i], host[B * D1 + B + i]
            out.append(self._finish_one(seq, path[:k + 1], bonus, pending.features, i))
        return out

    def _accept(self, seqs, logits, tokens, parents, num_nodes, max_depth, depths):
        k = self.kernels
        if all(s.params.greedy for s in seqs):
            B, W, V = logits.shape
            return k.greedy_accept(k.argmax(logits.reshape(B * W, V)).view(B, W), tokens, parents, num_nodes, max_depth)
        B, W, V = logits.shape
        rep = [s for s in seqs for _ in range(W)]
        probs = self.sampler.probs(logits.reshape(B * W, V), rep).view(B, W, V)  # one-hot rows for greedy
        seeds, offsets = [s.seed for s in seqs], [s.num_tokens for s in seqs]
        if self.target.cfg.sampling_acceptance == "seeded":
            # Row d of a sequence: the noise plain decoding draws its token num_tokens + d with.
            noise = k.exponential_noise([s for s in seeds for _ in range(max_depth + 1)],
                                        [o + d for o in offsets for d in range(max_depth + 1)], V, logits.device)
            return k.seeded_accept(probs, tokens, parents, num_nodes, max_depth, depths,
                                   noise.view(B, max_depth + 1, V))
        uniforms = k.uniform_noise(seeds, offsets, W, logits.device)
        noise = k.exponential_noise(seeds, offsets, V, logits.device)
        return k.sampling_accept(probs, tokens, parents, num_nodes, max_depth, uniforms, noise)

    def _finish_one(self, seq: Sequence, path: list[int], bonus: int, features: torch.Tensor | None,
                    i: int) -> Verified:
        k = len(path) - 1
        node_tokens = [int(seq.tree.tokens[c - 1]) for c in path[1:]]
        seq.speculation.record(seq.tree.num_nodes, k)
        start = seq.num_cached
        seq.num_cached = start + k + 1
        # The blocks of the rejected nodes' rows stay the sequence's (within what it reserved): the next
        # tree takes them again. Given back at each rewind, they came back to other sequences and every
        # step rewrote every block table (0.2 ms of a batch-64 chained step's host time, both services).
        tree, seq.tree = seq.tree, None  # (the feed's features: gathered on the device before the copy)
        return Verified(seq, node_tokens + [bonus], start, tree, [c - 1 for c in path[1:]], features, i)
