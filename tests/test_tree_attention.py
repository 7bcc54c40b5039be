"""Tree attention through the paged cache: every node's logits equal those of its own path
run as a plain sequence (target verification, and draft-style level-by-level feeding)."""

import numpy as np
import pytest
import torch

from kernels.tree import tree_mask_ref
from runtime.tree import CandidateTree
from tiny_models import target_for, make_model_dir, tolerance
from verify_service.model_runner import SeqChunk

PREFIX = [(5 * i + 2) % 90 for i in range(20)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tree") / "m", "qwen2", seed=4)


def path_logits(model_dir, tokens):
    """Logits after the last token of ``tokens`` run as an ordinary sequence."""
    target = target_for(model_dir)
    target.blocks.ensure_capacity(0, len(tokens))
    return target.runner.step([SeqChunk(tokens, 0, target.blocks.block_table(0), (len(tokens) - 1,))]).logits[0]


def prefilled(model_dir, n_extra):
    target = target_for(model_dir)
    target.blocks.ensure_capacity(0, len(PREFIX) + n_extra)
    target.runner.step([SeqChunk(PREFIX, 0, target.blocks.block_table(0))])
    return target


def ancestor_mask(tree: CandidateTree) -> np.ndarray:
    """bool [N+1, N+1] over (root, nodes), from the tree-mask kernel."""
    return tree_mask_ref(torch.from_numpy(tree.parents)[None], torch.tensor([tree.num_nodes]))[0].numpy()


def test_verification_tree_logits_equal_each_path_alone(model_dir):
    tree = CandidateTree.from_lists(tokens=[11, 12, 13, 14, 15, 16], parents=[-1, -1, 0, 0, 1, 4])
    root = 42
    target = prefilled(model_dir, tree.num_nodes + 1)
    n = len(PREFIX)
    chunk = SeqChunk([root, *tree.tokens.tolist()], n, target.blocks.block_table(0),
                     logits_rows=tuple(range(tree.num_nodes + 1)),
                     positions=np.concatenate(([n], n + tree.depths)), custom_mask=ancestor_mask(tree))
    logits = target.runner.step([chunk]).logits
    paths = {-1: [root]}
    for i in range(tree.num_nodes):
        paths[i] = paths[int(tree.parents[i])] + [int(tree.tokens[i])]
    for row, node in enumerate([-1, *range(tree.num_nodes)]):
        torch.testing.assert_close(logits[row], path_logits(model_dir, PREFIX + paths[node]), **tolerance())


def test_draft_style_levels_see_only_their_ancestors(model_dir):
    """Level 2 sits after level 1 in the cache but must not see level-1 nodes off its path."""
    target = prefilled(model_dir, 4)
    n, table = len(PREFIX), target.blocks.block_table(0)
    level1 = SeqChunk([31, 32], n, table, logits_rows=(0, 1), positions=[n, n], custom_mask=np.eye(2, dtype=bool))
    first = target.runner.step([level1]).logits
    level2 = SeqChunk([33, 34], n + 2, table, logits_rows=(0, 1), positions=[n + 1, n + 1], mask_start=n,
                      custom_mask=np.array([[1, 0, 1, 0], [0, 1, 0, 1]], dtype=bool))
    second = target.runner.step([level2]).logits
    torch.testing.assert_close(first[0], path_logits(model_dir, PREFIX + [31]), **tolerance())
    torch.testing.assert_close(first[1], path_logits(model_dir, PREFIX + [32]), **tolerance())
    torch.testing.assert_close(second[0], path_logits(model_dir, PREFIX + [31, 33]), **tolerance())
    torch.testing.assert_close(second[1], path_logits(model_dir, PREFIX + [32, 34]), **tolerance())


def test_tree_and_plain_chunks_share_one_batch(model_dir):
    tree = CandidateTree.from_lists(tokens=[7, 8, 9], parents=[-1, -1, 0])
    target = prefilled(model_dir, 4)
    target.blocks.ensure_capacity(1, 5)
    n = len(PREFIX)
    tree_chunk = SeqChunk([42, 7, 8, 9], n, target.blocks.block_table(0), logits_rows=(3,),
                          positions=[n, n + 1, n + 1, n + 2], custom_mask=ancestor_mask(tree))
    plain = SeqChunk([3, 4, 5, 6, 7], 0, target.blocks.block_table(1), logits_rows=(4,))
    logits = target.runner.step([tree_chunk, plain]).logits
    torch.testing.assert_close(logits[0], path_logits(model_dir, PREFIX + [42, 7, 9]), **tolerance())
    torch.testing.assert_close(logits[1], path_logits(model_dir, [3, 4, 5, 6, 7]), **tolerance())
