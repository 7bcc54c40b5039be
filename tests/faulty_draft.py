"""A draft service whose trees are malformed on purpose (test double for the verify side's checks).

    python tests/faulty_draft.py MODE --draft DIR --verify ADDR --listen ADDR
MODE: parent_after_child | too_many_nodes | token_out_of_vocab (every tree of an ordinary step), or
chained_garbage (ordinary steps' trees sound, every chained step's broken: a token outside the
vocabulary and a parent after its child, on the device or on the host where they are grown)
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.tree import CandidateTree  # noqa: E402
from draft_service import server, server_config  # noqa: E402
from draft_service.drafter import EagleDrafter  # noqa: E402
from cli.main import build_parser  # noqa: E402


def corrupt(tree: CandidateTree, mode: str, vocab: int) -> CandidateTree:
    n = tree.num_nodes
    if mode == "parent_after_child":
        parents = tree.parents.copy()
        parents[0] = n - 1 if n > 1 else 0
        return CandidateTree(tree.tokens, parents, tree.depths, tree.log_probs)
    if mode == "too_many_nodes":
        k = 80
        return CandidateTree(np.arange(k) % vocab, np.arange(k) - 1, np.arange(1, k + 1), np.zeros(k, np.float32))
    tokens = tree.tokens.copy()
    tokens[0] = vocab + 7
    return CandidateTree(tokens, tree.parents, tree.depths, tree.log_probs)


class BrokenChainedTrees:
    """A chained step's trees (``drafter.PendingTrees``) broken as they leave the drafter."""

    def __init__(self, pending, vocab: int):
        self.pending, self.vocab = pending, vocab

    @property
    def on_device(self):
        trees = self.pending.on_device
        if trees is None:
            return None
        trees = trees.clone()
        trees[0, :, 0] = self.vocab + 7
        trees[1, :, 0] = trees.shape[2] - 1
        return trees

    def collect(self):
        return {k: corrupt(corrupt(t, "parent_after_child", self.vocab), "token_out_of_vocab", self.vocab)
                for k, t in self.pending.collect().items()}


class FaultyDrafter:
    def __init__(self, inner: EagleDrafter, mode: str, vocab: int):
        self.inner, self.mode, self.vocab = inner, mode, vocab
        self.capture_layers = inner.capture_layers
        if mode == "chained_garbage":  # takes chained steps (the others: ordinary steps only)
            self.step_on_device, self.settle, self.rows = self._step_on_device, inner.settle, inner.rows

    def _step_on_device(self, *args, **kwargs):
        return BrokenChainedTrees(self.inner.step_on_device(*args, **kwargs), self.vocab)

    def step(self, feeds, proposals):
        trees = self.inner.step(feeds, proposals)
        if self.mode == "chained_garbage":
            return trees
        return {k: corrupt(t, self.mode, self.vocab) for k, t in trees.items()}

    def release(self, seq_id):
        self.inner.release(seq_id)

    def tree_rejected(self, seq_id, reason):
        print(f"REJECTED {seq_id}: {reason}", flush=True)


def main() -> None:
    mode = sys.argv[1]
    args = build_parser().parse_args(["serve-draft", *sys.argv[2:]])
    cfg = server_config.from_args(args)

    def make(spec, target, embedding, max_seqs, max_len, cuda_graphs=True):
        return FaultyDrafter(EagleDrafter.from_checkpoint(spec, target, embedding, max_seqs, max_len,
                                                          cuda_graphs=cuda_graphs), mode, target.vocab_size)

    server.create_server(cfg, make).worker.run()


if __name__ == "__main__":
    main()
