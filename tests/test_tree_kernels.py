"""The tree layout kernels on the device, each implementation against the reference: the
chained trees' check (``sanitize_trees``) and the packed ancestor masks (``packed_tree_mask``).

The Triton kernels (kernels/tree_triton.py) run through Triton's interpreter on a CPU
(tests/conftest.py sets TRITON_INTERPRET=1) and natively on a GPU. Outputs start poisoned
(``torch.empty`` filled with -7), inputs are slices of wider buffers.
"""

import numpy as np
import pytest
import torch

from kernels.tree import packed_tree_mask_ref, sanitize_trees_ref, split_sanitized, tree_mask_ref
from runtime.tree import CandidateTree, invalid_trees

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def implementations():
    """(name, sanitize_trees, packed_tree_mask): the reference, and the Triton kernels where triton imports."""
    impls = [pytest.param(sanitize_trees_ref, packed_tree_mask_ref, id="reference")]
    try:
        from kernels.tree_triton import packed_tree_mask_triton, sanitize_trees_triton
    except ImportError:
        return impls
    return impls + [pytest.param(sanitize_trees_triton, packed_tree_mask_triton, id="triton")]


pytestmark = pytest.mark.usefixtures("poisoned_empty")  # tests/conftest.py


def broken_trees(rng, count: int, vocab: int, n: int) -> list[tuple[np.ndarray, ...]]:
    """(tokens, parents, depths, score bits) of ``count`` random trees of n nodes: valid ones and ones
    broken in every way (tokens, parents, depths, duplicate siblings, garbage)."""
    rows = []
    for _ in range(count):
        parents = np.array([int(rng.integers(-1, i)) for i in range(n)], dtype=np.int64)
        depths = np.ones(n, dtype=np.int64)
        for i in range(n):
            depths[i] = 1 if parents[i] < 0 else depths[parents[i]] + 1
        tokens = rng.permutation(vocab * 2)[:n] % vocab  # often distinct siblings, not always
        kind, j = int(rng.integers(0, 8)), int(rng.integers(0, n))
        if kind == 1:
            tokens[j] = int(rng.choice([-1, vocab, 2**40]))
        elif kind == 2:
            parents[j] = int(rng.choice([j, j + 1, -2, 2**40]))
        elif kind == 3:
            depths[j] += int(rng.choice([-1, 1]))
        elif kind == 4:
            depths[:] = rng.integers(-(2**62), 2**62, n)
        rows.append((tokens, parents, depths, rng.integers(0, 2**31, n)))
    return rows


@pytest.mark.parametrize("sanitize,_", implementations())
def test_sanitized_trees_are_the_valid_ones_and_well_formed_stand_ins(sanitize, _):
    """``sanitize_trees`` (trees another process wrote, on the device) keeps exactly the trees that
    ``invalid_trees`` accepts, unchanged, and puts a well-formed tree of as many nodes in place of
    every other: random trees of one size, valid ones and ones broken in every way (tokens, parents,
    depths, duplicate siblings, too deep, garbage), read from a slice of a wider buffer."""
    rng = np.random.default_rng(3)
    vocab, n, max_depth = 11, 6, 4
    rows = broken_trees(rng, 300, vocab, n)
    packed = torch.tensor(np.array(rows).transpose(1, 0, 2))  # [4, B, n]
    wide = torch.full((4, len(rows) + 3, n + 5), -9, dtype=torch.int64)
    wide[:, 1:len(rows) + 1, 2:n + 2] = packed
    trees = [CandidateTree(t, p, d, np.zeros(n, np.float32)) for t, p, d, _ in rows]
    bad = set(invalid_trees(trees, vocab, [n] * len(trees), [max_depth] * len(trees)))
    assert 50 < len(bad) < 250
    flat = sanitize(wide[:, 1:len(rows) + 1, 2:n + 2].to(DEVICE), vocab, max_depth).cpu()
    assert flat.shape == (4 * len(rows) * n + len(rows),) and set(flat[-len(rows):].tolist()) == {0, 1}
    clean, valid = split_sanitized(flat, len(rows), n)
    assert valid.dtype == torch.bool and clean.shape == packed.shape
    assert [i for i in range(len(rows)) if not valid[i]] == sorted(bad)
    assert torch.equal(clean[:, valid], packed[:, valid])
    stand_ins = [CandidateTree(*(clean[k, i].numpy() for k in range(3)), np.zeros(n, np.float32)) for i in sorted(bad)]
    assert invalid_trees(stand_ins, vocab, [n] * len(bad), [1] * len(bad)) == []
    assert torch.equal(clean[3, ~valid], torch.zeros_like(clean[3, ~valid]))
    again = split_sanitized(sanitize(clean.to(DEVICE), vocab, max_depth).cpu(), len(rows), n)[1]
    assert torch.equal(again, torch.ones(len(rows), dtype=torch.bool))


@pytest.mark.parametrize("sanitize,_", implementations())
@pytest.mark.parametrize("n", [1, 17, 59, 64])
def test_sanitize_equals_the_reference_at_served_sizes(sanitize, _, n):
    """Trees of the sizes a step serves (one node, more than a tile of 16, the default 59, 64), in
    a vocabulary of SmolLM2's size: the reference's trees and verdicts, bit for bit."""
    rng = np.random.default_rng(n)
    rows = broken_trees(rng, 40, 49152, n)
    packed = torch.tensor(np.array(rows).transpose(1, 0, 2))
    want = sanitize_trees_ref(packed, 49152, 7)
    got = sanitize(packed.to(DEVICE), 49152, 7)
    assert torch.equal(got.cpu(), want)


def valid_parents(rng, B: int, N: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(parents [B, N], num_nodes [B]): valid trees of random sizes (parents before children; deep
    chains and bushy trees), garbage in the padding."""
    sizes = rng.integers(0, N + 1, B)
    sizes[0] = N  # one full tree
    parents = rng.integers(-3, N + 3, (B, N))
    for b in range(B):
        reach = 2 if b % 2 else N
        for i in range(sizes[b]):
            parents[b, i] = rng.integers(max(-1, i - reach), i)
    return torch.from_numpy(parents), torch.from_numpy(sizes)


@pytest.mark.parametrize("_,packed_mask", implementations())
@pytest.mark.parametrize("N", [1, 5, 31, 32, 59, 64, 70])
def test_packed_tree_masks_equal_the_reference(_, packed_mask, N):
    """Ancestor masks of trees of N nodes (one word a row up to 31 nodes, two from 32, three past 63),
    padded trees among them: the reference's packed words; unpacked, ``tree_mask_ref`` itself."""
    from kernels.attention import unpack_mask

    rng = np.random.default_rng(N)
    parents, num_nodes = valid_parents(rng, 6, N)
    wide = torch.full((6, N + 4), 99, dtype=torch.int64)
    wide[:, :N] = parents
    want = packed_tree_mask_ref(parents, num_nodes)
    got = packed_mask(wide[:, :N].to(DEVICE), num_nodes.to(DEVICE)).cpu()
    assert got.dtype == torch.int32 and got.shape == (6 * (N + 1), -(-(N + 1) // 32))
    assert torch.equal(got, want)
    dense = unpack_mask(got)[:, :N + 1].reshape(6, N + 1, N + 1)
    assert torch.equal(dense, tree_mask_ref(parents, num_nodes))


@pytest.mark.parametrize("sanitize,packed_mask", implementations())
def test_no_trees(sanitize, packed_mask):
    """A step of no trees gives empty results (and launches nothing)."""
    trees, valid = split_sanitized(sanitize(torch.zeros(4, 0, 5, dtype=torch.int64, device=DEVICE), 10, 3), 0, 5)
    assert trees.shape == (4, 0, 5) and valid.shape == (0,)
    assert packed_mask(torch.zeros(0, 5, dtype=torch.int64, device=DEVICE),
                       torch.zeros(0, dtype=torch.int64, device=DEVICE)).shape == (0, 1)


def level_implementations(name: str):
    """The reference (None) and, where triton imports, the Triton kernel ``name`` of kernels/tree_triton.py."""
    impls = [pytest.param(None, id="reference")]
    try:
        import kernels.tree_triton as tree_triton
    except ImportError:
        return impls
    return impls + [pytest.param(getattr(tree_triton, name), id="triton")]


@pytest.mark.parametrize("expand", level_implementations("expand_frontier_triton"))
@pytest.mark.parametrize("batch,frontier,k,keep", [(1, 10, 10, 10), (3, 4, 3, 4), (2, 1, 8, 5), (5, 7, 9, 9),
                                                    (2, 16, 16, 16)])  # (the last: beyond MAX_EXPAND, by a sort)
def test_expand_frontier_keeps_the_stable_sorts_best(expand, batch, frontier, k, keep):
    """A dynamic tree's level (``expand_frontier``): every candidate's score, token and parent written to
    the pool at its index, the rest of the pool untouched, and the best ``keep`` candidates in a
    stable descending sort's order, with many equal scores (log-probs drawn from a few values, some
    -inf) so the order of ties decides. The reference is the sort itself, on a copy of the pool."""
    from kernels.tree import expand_frontier_ref

    gen = torch.Generator().manual_seed(batch * 100 + frontier * 10 + k)
    cap, lo = frontier * k + 13, 7
    choices = torch.tensor([0.0, -0.5, -1.25, -3.0, float("-inf")])
    fs = choices[torch.randint(0, 4, (batch, frontier), generator=gen)]  # finite: a frontier node's score
    lp = choices[torch.randint(0, 5, (batch, frontier, k), generator=gen)]
    tokens = torch.randint(0, 50_000, (batch, frontier, k), generator=gen)
    fidx = torch.randint(0, lo, (batch, frontier), generator=gen)
    pools = [(torch.full((batch, cap), -3, dtype=torch.int64), torch.full((batch, cap), -4, dtype=torch.int64),
              torch.full((batch, cap), 9.5)) for _ in range(2)]
    args = [t.to(DEVICE) for t in (fs, lp, tokens, fidx)]
    pools = [[t.to(DEVICE) for t in p] for p in pools]
    want = expand_frontier_ref(*args, *pools[0], lo, keep)
    got = (expand or expand_frontier_ref)(*args, *pools[1], lo, keep)
    for w, g in zip(want, got):
        assert g.dtype == w.dtype and torch.equal(g.cpu(), w.cpu())
    for w, g in zip(pools[0], pools[1]):
        assert torch.equal(g.cpu(), w.cpu())
    assert torch.equal(pools[1][1][:, lo:lo + frontier * k].cpu(), fidx.repeat_interleave(k, dim=1))
    assert (pools[1][0][:, :lo] == -3).all() and (pools[1][0][:, lo + frontier * k:] == -3).all()


@pytest.mark.parametrize("level", level_implementations("static_level_triton"))
@pytest.mark.parametrize("batch,fed,k,nodes,frontier,root", [(1, 1, 3, 3, 2, True), (3, 4, 2, 6, 3, False),
                                                              (2, 1, 1, 1, 1, True), (4, 5, 4, 17, 0, False)])
def test_static_level_writes_its_nodes_and_returns_the_frontier(level, batch, fed, k, nodes, frontier, root):
    """A static tree's level (``static_level``), against a loop over every node: node j's token is
    candidate pick[j]'s, its parent ``parent[j]``, its score the candidate's log-prob plus its parent's
    pool score (a child of the root: the log-prob alone), written at lo + j and nowhere else; the
    frontier's tokens are its candidates'. Scores include -inf and parents' scores that are not
    finite, so the add itself is what is compared (bit for bit)."""
    from kernels.tree import static_level_ref

    gen = torch.Generator().manual_seed(batch * 1000 + fed * 100 + k * 10 + nodes)
    lo = 0 if root else 5
    cap = lo + nodes + 6
    choices = torch.tensor([0.0, -0.5, -1.25, -3.0, float("-inf")])
    ids = torch.randint(0, 50_000, (batch, fed, k), generator=gen)
    lp = choices[torch.randint(0, 5, (batch, fed, k), generator=gen)] - torch.rand(batch, fed, k, generator=gen)
    pick = torch.randint(0, fed * k, (nodes,), generator=gen)
    parent = torch.full((nodes,), -1) if root else torch.randint(0, lo, (nodes,), generator=gen)
    fpick = pick[torch.randperm(nodes, generator=gen)[:frontier]]
    pool_scores = torch.full((batch, cap), 9.5)
    pool_scores[:, :lo] = -torch.rand(batch, lo, generator=gen) * 4
    if lo:
        pool_scores[:, 0] = float("-inf")
    pools = [(torch.full((batch, cap), -3, dtype=torch.int64), torch.full((batch, cap), -4, dtype=torch.int64),
              pool_scores.clone()) for _ in range(2)]
    want_pool = [t.clone() for t in pools[0]]
    for b in range(batch):
        for j in range(nodes):
            c = int(pick[j])
            want_pool[0][b, lo + j] = ids.view(batch, -1)[b, c]
            want_pool[1][b, lo + j] = parent[j]
            score = lp.view(batch, -1)[b, c]
            want_pool[2][b, lo + j] = score if parent[j] < 0 else score + pool_scores[b, parent[j]]
    want_front = ids.view(batch, -1)[:, fpick]
    args = [t.to(DEVICE) for t in (ids, lp, pick, parent)]
    pools = [[t.to(DEVICE) for t in p] for p in pools]
    for impl, pool in ((static_level_ref, pools[0]), (level or static_level_ref, pools[1])):
        got = impl(*args, *pool, lo, fpick.to(DEVICE))
        assert got.dtype == torch.int64 and torch.equal(got.cpu(), want_front)
        for w, g in zip(want_pool, pool):
            assert torch.equal(g.cpu(), w)
