"""Tree kernels (masks, positions, draft top-k) and the dynamic / static tree builders."""

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.errors import InvalidRequestError, ModelNotFoundError
from draft_service.tree_builders import DynamicTreeBuilder, StaticTreeBuilder, StaticTreeSpec
from kernels import REFERENCE
from kernels.tree import draft_topk_ref, tree_mask_ref, tree_positions_ref

FAST = settings(max_examples=60, deadline=None)


# ---------------------------------------------------------------- kernels


@st.composite
def padded_parents(draw):
    """(parents [B, N], num_nodes [B]): valid trees (parents[i] < i), garbage in the padding."""
    b, n = draw(st.integers(1, 4)), draw(st.integers(1, 20))
    sizes = [draw(st.integers(0, n)) for _ in range(b)]
    reach = [draw(st.sampled_from([2, n])) for _ in range(b)]  # 2: parent i-1 or i-2, deep trees
    parents = [[draw(st.integers(max(-1, i - r), i - 1)) if i < size else draw(st.integers(-3, n + 3))
                for i in range(n)] for size, r in zip(sizes, reach)]
    return torch.tensor(parents), torch.tensor(sizes)


def naive_ancestor_mask(parents: list[int]) -> np.ndarray:
    """bool [N+1, N+1] over (root, nodes), node by node: each row walks up its parent chain."""
    n = len(parents)
    mask = np.zeros((n + 1, n + 1), dtype=bool)
    mask[:, 0] = True
    for i in range(n):
        node = i
        while node >= 0:
            mask[i + 1, node + 1] = True
            node = parents[node]
    mask[0, 0] = True
    return mask


@FAST
@given(padded_parents())
def test_tree_mask_matches_a_walk_up_the_parents(case):
    parents, num_nodes = case
    mask = tree_mask_ref(parents, num_nodes)
    n = parents.shape[1]
    assert mask.shape == (parents.shape[0], n + 1, n + 1) and mask.dtype == torch.bool
    for b, size in enumerate(num_nodes.tolist()):
        assert np.array_equal(mask[b, :size + 1, :size + 1].numpy(), naive_ancestor_mask(parents[b, :size].tolist()))
        assert not mask[b, :size + 1, size + 1:].any()  # real nodes never see padding
        pad = mask[b, size + 1:]  # padding rows: the root and themselves only
        assert np.array_equal(pad.numpy(), np.eye(n + 1, dtype=bool)[size + 1:] | (np.arange(n + 1) == 0))


@pytest.mark.parametrize("n", range(1, 20))
def test_tree_mask_of_a_chain(n):
    mask = tree_mask_ref(torch.arange(n)[None, :] - 1, torch.tensor([n]))[0]
    assert np.array_equal(mask.numpy(), np.tril(np.ones((n + 1, n + 1), dtype=bool)))


def test_tree_mask_by_hand():
    # root ─┬─ 0 ─┬─ 2      rows over (root, 0..4)
    #       │     └─ 3
    #       └─ 1 ─── 4
    mask = tree_mask_ref(torch.tensor([[-1, -1, 0, 0, 1, 7]]), torch.tensor([5]))[0].int()
    assert mask.tolist() == [[1, 0, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0, 0],
                             [1, 0, 1, 0, 0, 0, 0],
                             [1, 1, 0, 1, 0, 0, 0],
                             [1, 1, 0, 0, 1, 0, 0],
                             [1, 0, 1, 0, 0, 1, 0],
                             [1, 0, 0, 0, 0, 0, 1]]  # padding node 5


def test_tree_positions():
    depths = torch.tensor([[1, 1, 2, 2, 3], [1, 2, 9, 9, 9]])
    pos = tree_positions_ref(depths, torch.tensor([5, 2]), torch.tensor([10, 0]))
    assert pos.dtype == torch.int64
    assert pos.tolist() == [[10, 11, 11, 12, 12, 13], [0, 1, 2, 0, 0, 0]]  # padding at the root's


def test_draft_topk_by_hand():
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.7, 0.05, 0.05, 0.2]])
    d2t = torch.tensor([5, 0, 7, 3])  # offsets: draft 0 -> 5, 1 -> 1, 2 -> 9, 3 -> 6
    ids, lp = draft_topk_ref(probs.log() + 3.0, 2, d2t)  # unnormalised logits are fine
    assert ids.tolist() == [[1, 6], [5, 6]] and ids.dtype == torch.int64
    torch.testing.assert_close(lp, torch.tensor([[0.4, 0.3], [0.7, 0.2]]).log())
    assert lp.dtype == torch.float32


# ---------------------------------------------------------------- dynamic builder


def random_d2t(gen, vd, vocab):
    """Offsets of a random injective draft -> target map."""
    targets = torch.randperm(vocab, generator=gen)[:vd]
    return targets - torch.arange(vd)


def run_builder(builder, root, feed):
    """Drive a builder; ``feed(level, F)`` gives the log-probs [B, F, Vd] at each frontier."""
    frontiers, frontier = [], builder.start(root)
    while frontier is not None:
        frontiers.append((frontier, builder.feed_mask(frontier)))
        frontier = builder.expand(feed(len(frontiers), frontier.pool_idx.shape[1]))
    return frontiers, builder.finish()


def naive_eagle2(root, levels, k, d2t):
    """One sequence, node by node: pool [(path, score, parent)] and the frontiers (pool indices).

    ``root`` [Vd] and ``levels`` [[F, Vd]] are log-probs, normalised exactly as the builder does.
    """
    def children(lp):
        lp = lp.clamp(max=0).numpy()
        best = sorted(range(len(lp)), key=lambda d: -lp[d])[:k]
        return [(d + int(d2t[d]), lp[d]) for d in best]

    pool = [((tok,), lp, -1) for tok, lp in children(root)]
    frontiers = [list(range(k))]
    for level in levels:
        cands = []
        for slot, p in enumerate(frontiers[-1]):
            for tok, lp in children(level[slot]):
                cands.append(len(pool))
                pool.append((pool[p][0] + (tok,), np.float32(pool[p][1] + lp), p))
        frontiers.append(sorted(cands, key=lambda c: -pool[c][1])[:k])
    return pool, frontiers


def tree_paths(tree):
    paths = []
    for tok, parent in zip(tree.tokens.tolist(), tree.parents.tolist()):
        paths.append((paths[parent] if parent >= 0 else ()) + (tok,))
    return paths


def check_sibling_order(tree):
    for parent in set(tree.parents.tolist()):
        lp = tree.log_probs[tree.parents == parent]
        assert (lp[1:] <= lp[:-1]).all(), "siblings must follow the draft's ranking"
    assert (np.diff(tree.depths) >= 0).all()


@settings(max_examples=40, deadline=None)
@given(k=st.integers(1, 4), depth=st.integers(1, 4), max_nodes=st.integers(1, 40), b=st.integers(1, 3),
       vd=st.integers(4, 12), extra_vocab=st.integers(0, 20), seed=st.integers(0, 2**31))
def test_dynamic_builder_properties(k, depth, max_nodes, b, vd, extra_vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    vocab = vd + extra_vocab
    d2t = random_d2t(gen, vd, vocab)
    root = torch.randn(b, vd, generator=gen) * 2
    levels = [torch.randn(b, k, vd, generator=gen) * 2 for _ in range(depth - 1)]
    builder = DynamicTreeBuilder(k, depth, max_nodes, d2t, REFERENCE)
    frontiers, trees = run_builder(builder, root, lambda lvl, f: levels[lvl - 1][:, :f])
    assert len(frontiers) == depth - 1 and len(trees) == b
    # Same op on the same shapes as the builder's, so the naive scores match bit for bit.
    root_lp = torch.log_softmax(root, -1)
    levels_lp = [torch.log_softmax(lv.reshape(b * k, vd), -1).view(b, k, vd) for lv in levels]
    for s, tree in enumerate(trees):
        pool, naive_fronts = naive_eagle2(root_lp[s], [lv[s] for lv in levels_lp], k, d2t)
        # The pool, node for node, and every frontier: the top-k of its level's candidates.
        assert builder.pool_tokens[s].tolist() == [p[0][-1] for p in pool]
        assert builder.pool_parents[s].tolist() == [p[2] for p in pool]
        assert builder.pool_scores[s].tolist() == [float(p[1]) for p in pool]
        fed = []  # pool index of each feed column
        for (front, anc), want in zip(frontiers, naive_fronts):
            assert front.pool_idx[s].tolist() == want
            assert front.tokens[s].tolist() == [pool[i][0][-1] for i in want]
            fed += want
            check_ancestor_mask(anc[s], builder.pool_parents[s], want, fed)
        tree.validate(vocab_size=vocab, max_nodes=max_nodes, max_depth=depth)
        assert tree.num_nodes == min(max_nodes, len(pool))
        # Kept = the best max_nodes by (score desc, depth asc, pool index asc), ancestors included.
        ranked = sorted(range(len(pool)), key=lambda i: (-pool[i][1], len(pool[i][0]), i))
        kept = {pool[i][0]: pool[i][1] for i in ranked[:tree.num_nodes]}
        paths = tree_paths(tree)
        assert set(paths) == set(kept) and all(p[:-1] in kept for p in kept if len(p) > 1)
        assert tree.log_probs.tolist() == [float(kept[p]) for p in paths]
        assert set(tree.tokens.tolist()) <= set((torch.arange(vd) + d2t).tolist())
        check_sibling_order(tree)


def check_ancestor_mask(mask, pool_parents, frontier, fed):
    """``mask`` [F, len(fed)]: a frontier's feed mask; ``fed``: the pool index of every feed column."""
    for row, node in zip(mask.tolist(), frontier):
        want = set()
        while node >= 0:
            want.add(node)
            node = int(pool_parents[node])
        assert {fed[i] for i, seen in enumerate(row) if seen} == want


def test_dynamic_builder_by_hand():
    """k=2, depth=3, draft vocab 4 -> target ids 0, 3, 5, 8. Scores as probabilities (products)."""
    d2t = torch.tensor([0, 2, 3, 5])
    lg = lambda rows: torch.tensor(rows).log()
    builder = DynamicTreeBuilder(top_k=2, depth=3, max_nodes=6, d2t=d2t, kernels=REFERENCE)
    # root: draft 1 (.6) -> n0 "3", draft 2 (.3) -> n1 "5"
    f1 = builder.start(lg([[0.05, 0.6, 0.3, 0.05]]))
    assert f1.tokens.tolist() == [[3, 5]] and f1.depth == 1
    # n0: d0 .55 -> n2 "0" (.33), d3 .3 -> n3 "8" (.18); n1: d2 .7 -> n4 "5" (.21), d1 .15 -> n5 "3" (.045)
    f2 = builder.expand(lg([[[0.55, 0.1, 0.05, 0.3], [0.05, 0.15, 0.7, 0.1]]]))
    assert f2.pool_idx.tolist() == [[2, 4]] and f2.tokens.tolist() == [[0, 5]]
    assert f2.parent_slot.tolist() == [[0, 1]] and f2.depth == 2
    # n2: d3 .45 -> n6 "8" (.1485), d2 .25 -> n7 "5" (.0825)
    # n4: d0 .8 -> n8 "0" (.168), d1 .1 -> n9 "3" (.021)
    assert builder.expand(lg([[[0.1, 0.2, 0.25, 0.45], [0.8, 0.1, 0.06, 0.04]]])) is None
    torch.testing.assert_close(builder.pool_scores.exp(), torch.tensor(
        [[0.6, 0.3, 0.33, 0.18, 0.21, 0.045, 0.1485, 0.0825, 0.168, 0.021]]))
    # best 6: n0 .6, n2 .33, n1 .3, n4 .21, n3 .18, n8 .168; by depth, then score
    (tree,) = builder.finish()
    assert tree.tokens.tolist() == [3, 5, 0, 5, 8, 0]
    assert tree.parents.tolist() == [-1, -1, 0, 1, 0, 3]
    assert tree.depths.tolist() == [1, 1, 2, 2, 2, 3]
    np.testing.assert_allclose(np.exp(tree.log_probs), [0.6, 0.3, 0.33, 0.21, 0.18, 0.168], rtol=1e-5)


@pytest.mark.parametrize("max_nodes", [1, 2, 3, 5, 10])
def test_dynamic_ties_keep_parents(max_nodes):
    """Certain children (log p = 0) tie with their parents: the tie must go to the parent."""
    one_hot = torch.tensor([0.0, -math.inf, -math.inf])  # the draft is sure of draft id 0
    builder = DynamicTreeBuilder(top_k=2, depth=3, max_nodes=max_nodes, d2t=torch.zeros(3, dtype=torch.int64),
                                 kernels=REFERENCE)
    _, (tree,) = run_builder(builder, torch.tensor([[0.0, -1.0, -math.inf]]),
                             lambda lvl, f: one_hot.expand(1, f, 3))
    tree.validate(vocab_size=3, max_nodes=max_nodes, max_depth=3)
    assert tree.num_nodes == max_nodes  # validate() above rejects any orphan (depth mismatch)
    if max_nodes <= 3:  # the best nodes: the chain of draft id 0, all with the root's best score
        assert tree.parents.tolist() == [-1, 0, 1][:max_nodes] and not tree.tokens.any()
    check_sibling_order(tree)


# ---------------------------------------------------------------- static builder

SPEC = [[0, 0, 0], [1], [0, 1], [0], [1, 0], [0, 0]]  # shuffled: spec order is by depth, then ranks


def test_static_spec_order_and_levels():
    spec = StaticTreeSpec.from_paths(SPEC)
    assert spec.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)) and spec.depth == 3
    assert StaticTreeSpec.chain(3).paths == ((0,), (0, 0), (0, 0, 0))


def test_static_builder_ranks_and_structure():
    d2t = torch.tensor([4, 4, 4, 4])  # draft d -> target d + 4
    lg = lambda rows: torch.tensor(rows).log()
    builder = StaticTreeBuilder(StaticTreeSpec.from_paths(SPEC), d2t, REFERENCE)
    # root ranks: 0 -> draft 2 (.5), 1 -> draft 0 (.3)
    f1 = builder.start(lg([[0.3, 0.1, 0.5, 0.1]]))
    assert f1.pool_idx.tolist() == [[0, 1]] and f1.tokens.tolist() == [[6, 4]]
    # (0,): ranks 0, 1 -> drafts 3 (.6), 1 (.2); (1,): rank 0 -> draft 0 (.7)
    f2 = builder.expand(lg([[[0.1, 0.2, 0.1, 0.6], [0.7, 0.1, 0.1, 0.1]]]))
    assert f2.pool_idx.tolist() == [[2]] and f2.parent_slot.tolist() == [[0]] and f2.tokens.tolist() == [[7]]
    # (0, 0): rank 0 -> draft 1 (.9)
    assert builder.expand(lg([[[0.05, 0.9, 0.025, 0.025]]])) is None
    (tree,) = builder.finish()
    assert tree.parents.tolist() == [-1, -1, 0, 0, 1, 2] and tree.depths.tolist() == [1, 1, 2, 2, 2, 3]
    assert tree.tokens.tolist() == [6, 4, 7, 5, 4, 5]
    np.testing.assert_allclose(np.exp(tree.log_probs), [0.5, 0.3, 0.3, 0.1, 0.21, 0.27], rtol=1e-4)
    tree.validate(vocab_size=8)


def test_static_chain_is_greedy_path():
    builder = StaticTreeBuilder(StaticTreeSpec.chain(3), torch.zeros(5, dtype=torch.int64), REFERENCE)
    gen = torch.Generator().manual_seed(0)
    root = torch.randn(2, 5, generator=gen)
    levels = torch.randn(3, 2, 1, 5, generator=gen)
    _, trees = run_builder(builder, root, lambda lvl, f: levels[lvl - 1])
    for s, tree in enumerate(trees):
        assert tree.parents.tolist() == [-1, 0, 1]
        greedy = [root[s].argmax().item()] + [levels[i, s, 0].argmax().item() for i in range(2)]
        assert tree.tokens.tolist() == greedy


@st.composite
def static_specs(draw):
    """Random prefix-closed specs, as paths in a shuffled order."""
    paths = [(r,) for r in range(draw(st.integers(1, 3)))]
    for _ in range(draw(st.integers(0, 8))):
        parent = draw(st.sampled_from(paths))
        rank = draw(st.integers(0, 3))
        if parent + (rank,) not in paths and len(parent) < 4:
            paths.append(parent + (rank,))
    return draw(st.permutations([list(p) for p in paths]))


@FAST
@given(static_specs(), st.integers(1, 3), st.integers(0, 2**31))
def test_static_builder_properties(paths, b, seed):
    gen = torch.Generator().manual_seed(seed)
    vd = 6
    d2t = random_d2t(gen, vd, 20)
    spec = StaticTreeSpec.from_paths(paths)
    logits = {}  # (level, slot) -> [B, Vd] fed at that frontier slot

    def feed(level, f):
        x = torch.randn(b, f, vd, generator=gen)
        logits.update({(level, i): x[:, i] for i in range(f)})
        return x

    root = torch.randn(b, vd, generator=gen)
    builder = StaticTreeBuilder(spec, d2t, REFERENCE)
    frontiers, trees = run_builder(builder, root, feed)
    assert len(frontiers) == max(len(p) for p in paths) - 1
    for s, tree in enumerate(trees):
        tree.validate(vocab_size=20, max_depth=spec.depth)
        check_sibling_order(tree)
        fed = []  # each frontier sees its ancestors and itself among the nodes fed so far
        for front, anc in frontiers:
            fed += front.pool_idx[s].tolist()
            check_ancestor_mask(anc[s], builder.pool_parents[s], front.pool_idx[s].tolist(), fed)
        # Node (r1..rd) is the rd-th best draft token at its parent, fed at the parent's frontier slot.
        slot_of = {}
        for level, (front, _) in enumerate(frontiers, start=1):
            slot_of.update({int(i): (level, j) for j, i in enumerate(front.pool_idx[s])})
        for i, path in enumerate(spec.paths):
            parent = int(tree.parents[i])
            x = root[s] if parent < 0 else logits[slot_of[parent]][s]
            draft = x.argsort(descending=True)[path[-1]].item()
            assert int(tree.tokens[i]) == draft + int(d2t[draft])
            assert parent == (spec.paths.index(path[:-1]) if len(path) > 1 else -1)


@pytest.mark.parametrize("paths", [[], [[]], [[-1]], [[0.5]], [[True]], [[0], [0]], [[0], [0, 1, 0]],
                                   "abc", [0, 1], [[1, 0]]])
def test_static_spec_rejects_bad_paths(paths):
    with pytest.raises(InvalidRequestError) as err:
        StaticTreeSpec.from_paths(paths)
    assert err.value.field == "static_tree"


def test_static_spec_files(tmp_path):
    good = tmp_path / "tree.json"
    good.write_text(json.dumps({"paths": SPEC}))
    assert StaticTreeSpec.from_file(good) == StaticTreeSpec.from_paths(SPEC)
    with pytest.raises(ModelNotFoundError):
        StaticTreeSpec.from_file(tmp_path / "missing.json")
    bad = ["{not json", json.dumps([[0]]), json.dumps({"choices": [[0]]}), json.dumps({"paths": [[0, 0]]})]
    for text in bad:
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(InvalidRequestError) as err:
            StaticTreeSpec.from_file(tmp_path / "bad.json")
        assert err.value.field == "static_tree"


def test_static_rank_beyond_draft_vocab():
    builder = StaticTreeBuilder(StaticTreeSpec.from_paths([[0], [4]]), torch.zeros(4, dtype=torch.int64), REFERENCE)
    with pytest.raises(InvalidRequestError):
        builder.start(torch.zeros(1, 4))


def test_host_ancestor_masks_equal_the_device_kernel():
    """runtime.tree.ancestor_masks (verification's host masks) against kernels.tree.tree_mask_ref,
    on random valid trees of a padded batch."""
    from runtime.tree import ancestor_masks
    gen = np.random.default_rng(3)
    for _ in range(20):
        b, n = int(gen.integers(1, 6)), int(gen.integers(1, 40))
        num = gen.integers(0, n + 1, size=b)
        parents = np.full((b, n), -1, dtype=np.int64)
        for i in range(b):
            for j in range(1, num[i]):
                parents[i, j] = gen.integers(-1, j)
            parents[i, num[i]:] = gen.integers(-1, n, size=n - num[i])  # padding: any value
        want = tree_mask_ref(torch.from_numpy(parents), torch.from_numpy(num)).numpy()
        assert np.array_equal(ancestor_masks(parents, num), want)
        depth = _chain_depth(parents, num)
        assert np.array_equal(ancestor_masks(parents, num, depth), want)  # the step count given


def _chain_depth(parents, num):
    """The deepest real node's depth (by walking its chain), 0 for no nodes."""
    deepest = 0
    for row, n in zip(parents, num):
        for i in range(n):
            d, j = 1, i
            while row[j] >= 0:
                d, j = d + 1, row[j]
            deepest = max(deepest, d)
    return deepest


def _random_trees(gen, count, max_nodes=12):
    """Valid trees of 0..max_nodes nodes (distinct sibling tokens: all tokens distinct)."""
    from runtime.tree import CandidateTree
    trees = []
    for _ in range(count):
        n = int(gen.integers(0, max_nodes + 1))
        parents = [int(gen.integers(-1, i)) for i in range(n)]
        trees.append(CandidateTree.from_lists(gen.permutation(100)[:n], parents))
    return trees


@pytest.mark.parametrize("batch", [1, 3, 8, 9, 20])  # a slice per tree, and one scatter for many
@pytest.mark.parametrize("root_column", [False, True])
def test_pad_trees_equals_a_row_per_tree(batch, root_column):
    from runtime.tree import pad_trees
    gen = np.random.default_rng(batch)
    for _ in range(10):
        trees = _random_trees(gen, batch)
        lead = int(root_column)
        width = lead + max(t.num_nodes for t in trees)
        want = (np.zeros((batch, width), np.int64), np.full((batch, width), -1, np.int64),
                np.zeros((batch, width), np.int64))
        for r, t in enumerate(trees):
            n = t.num_nodes
            want[0][r, lead:lead + n], want[1][r, lead:lead + n], want[2][r, lead:lead + n] = \
                t.tokens, t.parents + lead, t.depths
        got = pad_trees(trees, root_column)
        assert all(np.array_equal(g, w) for g, w in zip(got, want))
        assert got[3].tolist() == [t.num_nodes for t in trees]


@pytest.mark.parametrize("batch", [1, 5, 12])
def test_tree_chunks_equal_the_kernel_masks_and_positions(batch):
    """verification.tree_chunks (host masks, positions, padded tokens) against the device references
    ``tree_mask_ref`` and ``tree_positions_ref``, tree by tree, on batches of mixed sizes."""
    from types import SimpleNamespace
    from verify_service.verification import tree_chunks
    gen = np.random.default_rng(batch)
    for _ in range(10):
        trees = _random_trees(gen, batch, 20)
        seqs = [SimpleNamespace(tree=t, output_ids=[int(gen.integers(0, 100))], num_cached=int(gen.integers(0, 50)))
                for t in trees]
        tables = [[int(x) for x in gen.integers(0, 9, size=int(gen.integers(1, 5)))] for _ in seqs]
        for s, table, c in zip(seqs, tables, tree_chunks(seqs, tables)):
            t, n = s.tree, s.tree.num_nodes
            parents, num = torch.from_numpy(t.parents)[None], torch.tensor([n])
            assert c.token_ids.tolist() == [s.output_ids[-1], *t.tokens.tolist()] and c.block_table is table
            assert c.kv_start == s.num_cached and c.logits_rows.tolist() == list(range(n + 1))
            assert np.array_equal(c.custom_mask, tree_mask_ref(parents, num)[0].numpy())
            want = tree_positions_ref(torch.from_numpy(t.depths)[None], num, torch.tensor([s.num_cached]))[0]
            assert c.positions.tolist() == want.tolist()


def test_batched_validation_agrees_with_each_trees_own():
    """``invalid_trees`` flags exactly the trees ``validate`` refuses: random trees, valid ones and
    ones broken in every way (tokens, parents, depths, duplicate siblings, size, depth, shapes)."""
    from runtime.tree import CandidateTree, InvalidTreeError, invalid_trees

    rng = np.random.default_rng(0)
    vocab = 7

    def random_tree():
        n = int(rng.integers(0, 9))
        parents = np.array([int(rng.integers(-1, i)) for i in range(n)], dtype=np.int64)
        depths = np.ones(n, dtype=np.int64)
        for i in range(n):
            depths[i] = 1 if parents[i] < 0 else depths[parents[i]] + 1
        tokens = rng.permutation(vocab * 3)[:n] % vocab  # often distinct siblings, not always
        t = CandidateTree(tokens.astype(np.int64), parents, depths, np.zeros(n, dtype=np.float32))
        kind = int(rng.integers(0, 9)) if n else 0
        if kind == 1:
            t.tokens[int(rng.integers(0, n))] = int(rng.choice([-1, vocab]))
        elif kind == 2:
            j = int(rng.integers(0, n))
            t.parents[j] = int(rng.choice([j, j + 1, -2]))
        elif kind == 3:
            t.depths[int(rng.integers(0, n))] += 1
        elif kind == 4:
            return CandidateTree(t.tokens, t.parents[:-1], t.depths, t.log_probs)
        return t

    trees = [random_tree() for _ in range(400)]
    max_nodes = [int(rng.integers(3, 10)) for _ in trees]
    max_depths = [int(rng.integers(2, 8)) for _ in trees]

    def refused(i):
        try:
            trees[i].validate(vocab, max_nodes[i], max_depths[i])
            return False
        except InvalidTreeError:
            return True

    want = [i for i in range(len(trees)) if refused(i)]
    assert 50 < len(want) < 350  # both kinds, plenty of each
    assert invalid_trees(trees, vocab, max_nodes, max_depths) == want


def test_depths_of_many_rows_at_once_equal_each_trees_own():
    """``depths_of_rows`` (the link's trees of a step, every slot at once) against one tree at a time
    (the old per-tree walk, written out here), and an end, with depths ``validate`` refuses, for rows
    that are not trees (a cycle, a parent past the row)."""
    from runtime.tree import CandidateTree, InvalidTreeError, depths_of_rows

    def one_tree(parents):  # each node: 1 + its parent's depth, parents before children
        d = np.ones(len(parents), dtype=np.int64)
        for i, p in enumerate(parents):
            d[i] = 1 if p < 0 else d[p] + 1
        return d

    rng = np.random.default_rng(4)
    rows = [np.array([-1 if i < 3 else int(rng.integers(-1, i)) for i in range(12)]) for _ in range(20)]
    rows.append(np.array([1, 2, 0, -1, 40, -1, 5, 6, 7, 8, 9, 10]))  # a cycle, a parent past the row
    parents = np.stack(rows)
    got = depths_of_rows(parents)
    for r in range(len(rows) - 1):
        np.testing.assert_array_equal(got[r], one_tree(parents[r]))
    bad = got[-1]
    assert bad.shape == (12,) and bad[3] == 1 and bad[5] == 1 and bad[6] == 2
    tree = CandidateTree(np.arange(12), parents[-1], bad, np.zeros(12, dtype=np.float32))
    with pytest.raises(InvalidTreeError):
        tree.validate(100)


def test_packed_trees_round_trip():
    """``pack_trees`` / ``unpack_trees``: the device proposal's layout, scores through their bits."""
    from runtime.tree import CandidateTree, pack_trees, unpack_trees

    trees = [CandidateTree(np.array([4, 9, 2]), np.array([-1, 0, 0]), np.array([1, 2, 2]),
                           np.array([-0.5, -1.25, -3.0], np.float32)),
             CandidateTree(np.array([7, 1, 3]), np.array([-1, -1, 1]), np.array([1, 1, 2]),
                           np.array([-0.1, -2.0, -np.inf], np.float32))]
    packed = pack_trees(trees)
    assert packed.shape == (4, 2, 3) and packed.dtype == np.int64
    for want, got in zip(trees, unpack_trees(packed)):
        for field in ("tokens", "parents", "depths", "log_probs"):
            assert np.array_equal(getattr(got, field), getattr(want, field)), field
