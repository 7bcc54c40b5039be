"""Test doubles for the draft side: drafts whose quality is known exactly.

``OracleDrafter`` proposes the target's own greedy continuation (every node accepted under
greedy verification), optionally with wrong siblings beside each correct node;
``WrongDrafter`` proposes tokens that are never the target's choice. Both read the
committed tokens from the engine's sequences (a test-only shortcut) and run the target
with a separate engine to know its greedy continuation.
"""

from __future__ import annotations

import numpy as np

from link.protocol import DraftFeed, ProposeRequest
from common.sampling_params import SamplingParams
from runtime.tree import CandidateTree
from verify_service.engine import Engine


class OracleDrafter:
    def __init__(self, oracle_target, depth: int, siblings: int = 0, wrong: bool = False):
        self.oracle = Engine(oracle_target)
        self.capture_layers = oracle_target.model_config.default_capture_layers()
        self.depth, self.siblings, self.wrong = depth, siblings, wrong
        self.engine: Engine | None = None  # set by the test after building the engine
        self.fed: dict[int, int] = {}  # seq_id -> rows fed (checks the feed protocol)
        self.released: set[int] = set()

    def step(self, feeds: list[DraftFeed], proposals: list[ProposeRequest]) -> dict[int, CandidateTree]:
        for f in feeds:
            assert f.start == self.fed.get(f.seq_id, 0), "draft rows must arrive contiguously"
            assert f.features.shape[0] == len(f.next_tokens) > 0
            self.fed[f.seq_id] = f.start + len(f.next_tokens)
        return {r.seq_id: self._tree(r) for r in proposals}

    def release(self, seq_id: int) -> None:
        self.released.add(seq_id)

    def tree_rejected(self, seq_id: int, reason: str) -> None:
        raise AssertionError(f"the oracle's tree for {seq_id} was refused: {reason}")

    def _tree(self, req: ProposeRequest) -> CandidateTree:
        seq = self.engine.sequences[req.seq_id]
        history = seq.prompt_ids + seq.output_ids
        assert self.fed[req.seq_id] == len(history) - 1, "every committed row must be fed before proposing"
        cont = self.oracle.generate([history], SamplingParams(max_tokens=req.max_depth, ignore_eos=True))[0].token_ids
        vocab = self.oracle.target.model_config.vocab_size
        if self.wrong:
            cont = [(t + 1) % vocab for t in cont]
        return _chain_with_siblings(cont, self.siblings, vocab)


def _chain_with_siblings(chain: list[int], siblings: int, vocab: int) -> CandidateTree:
    """The chain, each node preceded (in rank order) by ``siblings`` wrong alternatives."""
    tokens, parents = [], []
    parent = -1
    for t in chain:
        for s in range(1, siblings + 1):
            tokens.append((t + s) % vocab)
            parents.append(parent)
        tokens.append(t)
        parents.append(parent)
        parent = len(tokens) - 1
    return CandidateTree.from_lists(np.array(tokens), np.array(parents))
