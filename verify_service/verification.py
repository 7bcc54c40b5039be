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

from dataclasses import dataclass

import numpy as np
import torch

from kernels.tree import tree_positions_ref
from link.protocol import DraftFeed
from runtime.step_layout import SeqChunk, Staging
from runtime.tree import CandidateTree, ancestor_masks
from verify_service.model_runner import StepOutput
from verify_service.replay import AcceptanceReplay
from verify_service.sampler import Sampler
from verify_service.sequence import Sequence
from verify_service.target import Target


@dataclass(frozen=True, slots=True)
class Verified:
    seq: Sequence
    tokens: list[int]  # accepted node tokens, then the bonus token
    feed: DraftFeed  # features of r, a_1..a_k paired with a_1..a_k, b
    tree: CandidateTree  # the tree verified
    accepted: list[int]  # its accepted nodes a_1..a_k (node indices, root excluded)


def tree_chunks(seqs: list[Sequence], tables: list[list[int]]) -> list[SeqChunk]:
    """The verification inputs of ``seqs``: each newest token followed by its tree's nodes.

    The step layout is built on the host, so are the masks and positions: one batched call each
    for every tree of the step (trees arrive validated: parents before children).
    """
    trees = [s.tree for s in seqs]
    width = max(t.num_nodes for t in trees)
    parents = np.full((len(trees), width), -1, dtype=np.int64)
    depths = np.zeros((len(trees), width), dtype=np.int64)
    for i, t in enumerate(trees):
        parents[i, :t.num_nodes], depths[i, :t.num_nodes] = t.parents, t.depths
    num_nodes = torch.tensor([t.num_nodes for t in trees])
    masks = ancestor_masks(parents, num_nodes.numpy())  # (B, N+1, N+1)
    starts = torch.tensor([s.num_cached for s in seqs])
    positions = tree_positions_ref(torch.from_numpy(depths), num_nodes, starts).numpy()  # (B, N+1)
    return [SeqChunk(np.concatenate(([s.output_ids[-1]], t.tokens)), s.num_cached, table,
                     logits_rows=np.arange(t.num_nodes + 1), positions=positions[i, :t.num_nodes + 1],
                     custom_mask=masks[i, :t.num_nodes + 1, :t.num_nodes + 1])
            for i, (s, t, table) in enumerate(zip(seqs, trees, tables))]


@dataclass(frozen=True, slots=True)
class PendingVerification:
    """Acceptance launched on the device, waiting for the step's one device-to-host copy."""

    seqs: list[Sequence]
    result: object  # kernels.acceptance.AcceptResult
    features: torch.Tensor  # [B, max_depth + 1, k * hidden]: the captured rows along each accepted path

    def device_values(self) -> torch.Tensor:
        """What the host needs, flat: every path, then the accepted counts, then the bonus tokens."""
        r = self.result
        return torch.cat([r.path.flatten(), r.num_accepted, r.bonus])


class TreeVerifier:
    def __init__(self, target: Target, sampler: Sampler, replay: AcceptanceReplay | None = None):
        """``replay``: BENCHMARKS ONLY, acceptance taken from a recorded trace (outputs meaningless)."""
        self.target = target
        self.sampler = sampler
        self.replay = replay
        self.kernels = target.runner.kernels
        self.staging = Staging(target.device)  # the acceptance inputs: one host-to-device copy

    def accept(self, seqs: list[Sequence], logits_start: list[int], row_start: list[int],
               out: StepOutput) -> PendingVerification:
        """Launch acceptance, KV compaction and the gather of the draft's features, all on the
        device; nothing waits. ``logits_start[i]``/``row_start[i]``: where sequence i's rows begin
        in ``out.logits`` and in the flat batch (``out.captured``)."""
        eng = self.target
        sizes = [s.tree.num_nodes + 1 for s in seqs]
        width = max(sizes)
        tokens, host_parents, num_nodes, depths = self._padded_trees(seqs, width)
        cols = np.minimum(np.arange(width)[None, :], np.asarray(sizes)[:, None] - 1)
        idx = np.asarray(logits_start)[:, None] + cols  # (B, N+1); padding repeats a row
        tables = [eng.blocks.block_table(s.seq_id) for s in seqs]
        table = np.zeros((len(seqs), max(len(t) for t in tables)), dtype=np.int64)
        for i, t in enumerate(tables):
            table[i, :len(t)] = t
        prefix = np.array([s.num_cached for s in seqs], dtype=np.int64)
        rows = np.asarray(row_start, dtype=np.int64)
        idx, tokens, parents, num_nodes, table, prefix, rows, depths = self.staging.upload(
            [idx, tokens, host_parents, num_nodes, table, prefix, rows, depths])
        max_depth = max(s.tree.max_depth for s in seqs)
        if self.replay is not None:  # REPLAY (benchmarks only): the trace says how many nodes are accepted
            result = self.replay.accept([s.seq_id for s in seqs], host_parents, sizes, out.logits[idx])
        else:
            result = self._accept(seqs, out.logits[idx], tokens, parents, num_nodes, max_depth, depths)
        src, dst = self.kernels.compaction_slots(result.path, result.num_accepted, prefix, table,
                                                 eng.kv_cache.block_size)
        self.kernels.compact_kv(eng.kv_cache.data, src, dst)
        features = out.captured[rows[:, None] + result.path.clamp(min=0)] if out.captured is not None else None
        return PendingVerification(seqs, result, features)

    def finish(self, pending: PendingVerification, host: list[int]) -> list[Verified]:
        """Commit what acceptance chose; ``host`` is ``pending.device_values()`` on the host."""
        B, D1 = pending.result.path.shape
        out = []
        for i, seq in enumerate(pending.seqs):
            path, k, bonus = host[i * D1:(i + 1) * D1], host[B * D1 + i], host[B * D1 + B + i]
            out.append(self._finish_one(seq, path[:k + 1], bonus, pending.features, i))
        return out

    @staticmethod
    def _padded_trees(seqs: list[Sequence], width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Trees as [B, N+1] arrays with the root in column 0 (kernel convention): tokens, parents,
        node counts (with the root) and depths (root 0)."""
        B = len(seqs)
        tokens = np.zeros((B, width), dtype=np.int64)
        parents = np.full((B, width), -1, dtype=np.int64)
        depths = np.zeros((B, width), dtype=np.int64)
        for i, s in enumerate(seqs):
            n = s.tree.num_nodes
            tokens[i, 0] = s.output_ids[-1]
            tokens[i, 1:n + 1] = s.tree.tokens
            parents[i, 1:n + 1] = s.tree.parents + 1
            depths[i, 1:n + 1] = s.tree.depths
        return tokens, parents, np.array([s.tree.num_nodes + 1 for s in seqs], dtype=np.int64), depths

    def _accept(self, seqs, logits, tokens, parents, num_nodes, max_depth, depths):
        k = self.kernels
        if all(s.params.greedy for s in seqs):
            return k.greedy_accept(logits.argmax(dim=-1), tokens, parents, num_nodes, max_depth)
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
        self.target.blocks.truncate(seq.seq_id, seq.num_cached)
        committed = node_tokens + [bonus]
        feats = features[i, :k + 1] if features is not None else None  # a view: gathered before the copy
        feed = DraftFeed(seq.seq_id, start, feats, np.asarray(committed, dtype=np.int64))
        tree, seq.tree = seq.tree, None
        return Verified(seq, committed, feed, tree, [c - 1 for c in path[1:]])
