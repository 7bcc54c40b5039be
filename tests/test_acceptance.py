"""Tree verification (greedy and lossless sampling) and KV compaction of the accepted path."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.tree import CandidateTree
from kernels.acceptance import greedy_accept_ref, sampling_accept_ref, seeded_accept_ref
from kernels.kv_compaction import compact_kv_ref, compaction_slots_ref

TRAP = 99  # padding columns carry this token and parent 0: accepting them would be a bug


def pack(trees, width=None):
    """(node_tokens, parents, num_nodes) in the kernel layout; padding columns are traps."""
    width = width or 1 + max(t.num_nodes for t in trees)
    tokens = torch.full((len(trees), width), TRAP, dtype=torch.int64)
    parents = torch.zeros((len(trees), width), dtype=torch.int64)
    parents[:, 0] = -1
    for b, tree in enumerate(trees):  # test set-up only
        n = tree.num_nodes
        tokens[b, 1:n + 1] = torch.from_numpy(tree.tokens)
        parents[b, 1:n + 1] = torch.from_numpy(tree.parents) + 1
    num_nodes = torch.tensor([t.num_nodes + 1 for t in trees])
    return tokens, parents, num_nodes


def one_hot(argmax, vocab):
    return torch.nn.functional.one_hot(argmax, vocab).float()


def assert_result(res, path, num_accepted, bonus):
    assert res.path.tolist() == path
    assert res.num_accepted.tolist() == num_accepted
    assert res.bonus.tolist() == bonus


# ---------------------------------------------------------------- greedy, hand-built


def hand_batch():
    trees = [CandidateTree.from_lists([5, 6, 7, 8, 9], [-1, -1, 0, 0, 1]),  # tree.py's picture
             CandidateTree.chain([1, 2, 3]),
             CandidateTree.from_lists([3, 4], [-1, -1])]
    tokens, parents, num_nodes = pack(trees)  # width 6
    argmax = torch.tensor([[6, 0, 9, 0, 0, 42],  # root -> col 2 ("the"), col 2 -> col 5, bonus 42
                           [1, 2, 7, 0, TRAP, TRAP],  # 1, 2 accepted, 3 rejected (7 wanted)
                           [11, 0, 0, TRAP, TRAP, TRAP]])  # nothing matches 11
    return argmax, tokens, parents, num_nodes


HAND_EXPECTED = ([[0, 2, 5, -1], [0, 1, 2, -1], [0, -1, -1, -1]], [2, 2, 0], [42, 7, 11])


def test_greedy_hand_built_batch():
    argmax, tokens, parents, num_nodes = hand_batch()
    assert_result(greedy_accept_ref(argmax, tokens, parents, num_nodes, 3), *HAND_EXPECTED)


def test_greedy_all_wrong_gives_root_argmax():
    tokens, parents, num_nodes = pack([CandidateTree.from_lists([1, 2, 3, 4], [-1, -1, 0, 1])])
    argmax = torch.tensor([[0, 3, 4, 0, 0]])  # root wants 0: no child has it
    assert_result(greedy_accept_ref(argmax, tokens, parents, num_nodes, 2), [[0, -1, -1]], [0], [0])


def test_greedy_full_chain_accepted():
    tokens, parents, num_nodes = pack([CandidateTree.chain([4, 5, 6, 7])])
    argmax = torch.tensor([[4, 5, 6, 7, 8]])
    assert_result(greedy_accept_ref(argmax, tokens, parents, num_nodes, 4), [[0, 1, 2, 3, 4]], [4], [8])


def test_sampling_one_hot_equals_greedy_hand_built():
    argmax, tokens, parents, num_nodes = hand_batch()
    gen = torch.Generator().manual_seed(1)
    uniforms, noise = torch.rand(3, 6, generator=gen), torch.empty(3, 100).exponential_(generator=gen)
    res = sampling_accept_ref(one_hot(argmax, 100), tokens, parents, num_nodes, 3, uniforms, noise)
    assert_result(res, *HAND_EXPECTED)


# ---------------------------------------------------------------- greedy, property-based

VOCAB = 3  # small, so random targets often match


@st.composite
def trees(draw, max_nodes=10):
    """A valid CandidateTree: parents first, distinct tokens among siblings."""
    parents, tokens, used = [], [], {}
    for i in range(draw(st.integers(0, max_nodes))):
        parent = draw(st.sampled_from([p for p in range(-1, i) if len(used.get(p, ())) < VOCAB]))
        token = draw(st.sampled_from(sorted(set(range(VOCAB)) - used.get(parent, set()))))
        used.setdefault(parent, set()).add(token)
        parents.append(parent)
        tokens.append(token)
    return CandidateTree.from_lists(tokens, parents)


@st.composite
def greedy_cases(draw):
    batch = draw(st.lists(trees(), min_size=1, max_size=4))
    tokens, parents, num_nodes = pack(batch)
    argmax = torch.tensor(draw(st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=tokens.shape[1],
                                                 max_size=tokens.shape[1]),
                                        min_size=len(batch), max_size=len(batch))))
    tokens = torch.where(tokens == TRAP, argmax[:, :1], tokens)  # padding looks like a match
    max_depth = draw(st.integers(0, 1 + max(t.max_depth for t in batch)))
    return batch, argmax, tokens, parents, num_nodes, max_depth


def walk_greedy(tree, argmax, max_depth):
    """Per-sequence reference: columns of the path, accepted count, bonus."""
    path, cur = [0], -1
    while len(path) <= max_depth:
        want = argmax[cur + 1]
        hit = [i for i in range(tree.num_nodes) if tree.parents[i] == cur and tree.tokens[i] == want]
        if not hit:
            break
        cur = hit[0]
        path.append(cur + 1)
    return path + [-1] * (max_depth + 1 - len(path)), len(path) - 1, argmax[cur + 1]


@settings(max_examples=200, deadline=None)
@given(greedy_cases())
def test_greedy_matches_python_walk(case):
    batch, argmax, tokens, parents, num_nodes, max_depth = case
    expected = [walk_greedy(t, argmax[b].tolist(), max_depth) for b, t in enumerate(batch)]
    res = greedy_accept_ref(argmax, tokens, parents, num_nodes, max_depth)
    assert_result(res, *[list(col) for col in zip(*expected)])


@settings(max_examples=100, deadline=None)
@given(greedy_cases(), st.integers(0, 2**31 - 1))
def test_sampling_one_hot_equals_greedy(case, seed):
    _, argmax, tokens, parents, num_nodes, max_depth = case
    gen = torch.Generator().manual_seed(seed)
    uniforms = torch.rand(tokens.shape, generator=gen)
    noise = torch.empty(tokens.shape[0], VOCAB).exponential_(generator=gen)
    res = sampling_accept_ref(one_hot(argmax, VOCAB), tokens, parents, num_nodes, max_depth, uniforms, noise)
    want = greedy_accept_ref(argmax, tokens, parents, num_nodes, max_depth)
    assert_result(res, want.path.tolist(), want.num_accepted.tolist(), want.bonus.tolist())


# ---------------------------------------------------------------- sampling is lossless
# Power: for n samples from a distribution at total variation delta from p, Pearson's statistic
# is noncentral chi-square with lambda = n * sum_x d(x)^2 / p(x) >= n * (sum_x |d(x)|)^2 = 4 n delta^2
# (Cauchy-Schwarz, sum p = 1). A 5% difference (delta = 0.05) gives lambda >= 0.01 n: 2,000 at the
# root (n = 200,000) and >= 200 for every conditional group of >= 20,000 rows (asserted below),
# against a 0.001 critical value of ~20.5 (5 d.o.f.): power ~ 1. Even delta = 0.01 at the root
# gives lambda >= 80 (power > 0.99). Fixed seeds make the test deterministic.

V, B = 6, 200_000
# root ─┬─ c1 (0) ─┬─ c4 (3) ── c7 (1)
#       │          └─ c5 (0)
#       ├─ c2 (1) ─── c6 (4)
#       └─ c3 (2)
LOSSLESS_TREE = CandidateTree.from_lists([0, 1, 2, 3, 0, 4, 1], [-1, -1, -1, 0, 0, 1, 3])


def chi2_pvalue(counts, probs):
    expected = counts.sum() * probs
    stat = ((counts - expected) ** 2 / expected).sum()
    return torch.special.gammaincc(torch.tensor((len(probs) - 1) / 2.0, dtype=torch.float64), stat / 2).item()


def assert_distributed_as(samples, probs, tv_max):
    counts = torch.bincount(samples, minlength=len(probs)).double()
    probs = probs.double()
    tv = 0.5 * (counts / counts.sum() - probs).abs().sum().item()
    assert chi2_pvalue(counts, probs) > 1e-3 and tv < tv_max, (counts / counts.sum(), probs, tv)
    shifted = probs.clone()  # power sanity check: a 5% shift of mass must be rejected
    shifted[probs.argmax()] -= 0.05
    shifted[probs.argmin()] += 0.05
    assert chi2_pvalue(counts, shifted) < 1e-6


def committed_tokens(res, node_tokens, max_depth):
    """int64 [B, D+1]: the tokens committed in order (path tokens, then bonus), -1 after."""
    k = torch.arange(1, max_depth + 2)[None, :]  # (1, D+1)
    acc = res.num_accepted[:, None]
    path_tokens = node_tokens.gather(1, res.path[:, 1:].clamp(min=0))  # (B, D)
    path_tokens = torch.cat([path_tokens, path_tokens[:, :1]], dim=1)  # (B, D+1), last col unused
    out = torch.where(k <= acc, path_tokens, -1)
    return torch.where(k == acc + 1, res.bonus[:, None], out)


def test_sampling_is_lossless():
    gen = torch.Generator().manual_seed(1234)
    tokens, parents, num_nodes = pack([LOSSLESS_TREE])
    width, depth = tokens.shape[1], LOSSLESS_TREE.max_depth
    node_probs = torch.softmax(0.7 * torch.randn(width, V, generator=gen), dim=1)  # (N+1, V)
    uniforms, noise = torch.rand(B, width, generator=gen), torch.empty(B, V).exponential_(generator=gen)
    res = sampling_accept_ref(node_probs.expand(B, width, V), tokens.expand(B, width),
                              parents.expand(B, width), num_nodes.expand(B), depth, uniforms, noise)
    x = committed_tokens(res, tokens.expand(B, width), depth)  # (B, D+1)
    # (a) first committed token ~ p(root)
    assert_distributed_as(x[:, 0], node_probs[0], tv_max=0.01)
    # (b) joint (x1, x2) over x1 in the root's children: p_root(x1) * p_{node(x1)}(x2); one more
    # cell for "x1 not a child" (then x1 was the bonus, drawn from the residual).
    children = [1, 2, 3]
    assert torch.equal(res.num_accepted >= 1, torch.isin(x[:, 0], tokens[0, children]))
    cell = torch.full((B,), len(children) * V, dtype=torch.int64)
    joint = torch.zeros(len(children) * V + 1, dtype=torch.float64)
    for i, c in enumerate(children):
        on = res.path[:, 1] == c
        cell[on] = i * V + x[on, 1]
        joint[i * V:(i + 1) * V] = node_probs[0, tokens[0, c]] * node_probs[c].double()
    joint[-1] = 1 - joint[:-1].sum()
    assert chi2_pvalue(torch.bincount(cell, minlength=len(joint)).double(), joint) > 1e-3
    # (c) after every tree node the walk reached, the next committed token ~ p(that node)
    node_depth = torch.from_numpy(LOSSLESS_TREE.depths)
    for c in range(1, width):
        d = int(node_depth[c - 1])
        on = res.path[:, d] == c
        n = int(on.sum())
        if d == 1:
            assert n >= 20_000  # the power claim above
        tv_max = 0.02 if n >= 20_000 else 1.0  # small groups: the chi-square alone
        assert_distributed_as(x[on, d], node_probs[c], tv_max)


# ---------------------------------------------------------------- seeded: the target's own samples


def column_depths(tree, width):
    d = torch.zeros(1, width, dtype=torch.int64)
    d[0, 1:tree.num_nodes + 1] = torch.from_numpy(tree.depths)
    return d


def plain_decoding(node_probs, noise, tokens_of_path):
    """What plain decoding draws at each depth, given the tree's rows along a committed path."""
    return [int((node_probs[c] / noise[d]).argmax()) for d, c in enumerate(tokens_of_path)]


def test_seeded_commits_exactly_the_plain_decoding_samples():
    """Along whatever path is accepted, every committed token is the exponential race of plain
    decoding with that depth's noise row: the same text with and without a draft."""
    gen = torch.Generator().manual_seed(7)
    tree = LOSSLESS_TREE
    tokens, parents, num_nodes = pack([tree])
    width, depth = tokens.shape[1], tree.max_depth
    depths = column_depths(tree, width)
    for trial in range(300):
        node_probs = torch.softmax(1.5 * torch.randn(width, V, generator=gen), dim=1)
        noise = torch.empty(depth + 1, V).exponential_(generator=gen)
        res = seeded_accept_ref(node_probs[None], tokens, parents, num_nodes, depth, depths, noise[None])
        path = [c for c in res.path[0].tolist() if c >= 0]
        committed = committed_tokens(res, tokens, depth)[0]
        want = plain_decoding(node_probs, noise, path)
        assert committed[:len(path)].tolist() == want, (trial, path)
        # the walk stopped because the sample after the last node is none of its children
        last = path[-1]
        kids = [c for c in range(1, width) if parents[0, c] == last and c < num_nodes[0]]
        if len(path) <= depth:
            assert want[-1] not in tokens[0, kids].tolist()


def test_seeded_one_hot_equals_greedy():
    argmax, tokens, parents, num_nodes = hand_batch()
    noise = torch.empty(3, 4, 100).exponential_(generator=torch.Generator().manual_seed(0))
    depths = torch.zeros_like(tokens)
    res = seeded_accept_ref(one_hot(argmax, 100), tokens, parents, num_nodes, 3, depths, noise)
    assert_result(res, *HAND_EXPECTED)


def test_seeded_acceptance_rate_equals_the_residual_rule():
    """P(some child of the root accepted) = sum of the children's target probabilities under both
    rules (seeded samples the same distribution, sample by sample differently)."""
    gen = torch.Generator().manual_seed(99)
    tokens, parents, num_nodes = pack([LOSSLESS_TREE])
    width, depth = tokens.shape[1], LOSSLESS_TREE.max_depth
    node_probs = torch.softmax(0.7 * torch.randn(width, V, generator=gen), dim=1)
    n = 100_000
    noise = torch.empty(n, depth + 1, V).exponential_(generator=gen)
    res = seeded_accept_ref(node_probs.expand(n, width, V), tokens.expand(n, width), parents.expand(n, width),
                            num_nodes.expand(n), depth, column_depths(LOSSLESS_TREE, width).expand(n, width), noise)
    residual = sampling_accept_ref(node_probs.expand(n, width, V), tokens.expand(n, width), parents.expand(n, width),
                                   num_nodes.expand(n), depth, torch.rand(n, width, generator=gen), noise[:, 0])
    want = node_probs[0, tokens[0, 1:4]].sum().item()
    for r in (res, residual):
        assert abs((r.num_accepted >= 1).double().mean().item() - want) < 0.01
    assert abs(res.num_accepted.double().mean() - residual.num_accepted.double().mean()) < 0.03


# ---------------------------------------------------------------- KV compaction


def test_compaction_slots_hand_computed():
    # prefix 3, block size 4, blocks [5, 2, 7]; path [0, 2, 5]: index 5 -> 4, 8 -> 5
    src, dst = compaction_slots_ref(torch.tensor([[0, 2, 5, -1]]), torch.tensor([2]), torch.tensor([3]),
                                    torch.tensor([[5, 2, 7]]), 4)
    root = 5 * 4 + 3  # entries that need no move copy the root slot onto itself
    assert src.tolist() == [root, 2 * 4 + 1, 7 * 4 + 0, root]
    assert dst.tolist() == [root, 2 * 4 + 0, 2 * 4 + 1, root]


def test_compaction_moves_the_path_in_every_layer():
    block_size = 4
    gen = torch.Generator().manual_seed(7)
    block_tables = torch.randperm(16, generator=gen)[:12].view(3, 4)  # disjoint, 16 tokens each
    prefix = torch.tensor([3, 6, 0])
    path = torch.tensor([[0, 2, 3, 6], [0, 1, 2, -1], [0, 1, 4, -1]])  # 2->1, 3->2 overlap; in place; 4->2
    num_accepted = torch.tensor([3, 2, 2])
    kv = torch.randn(2, 2, 16, block_size, 2, 3, generator=gen)  # [L, 2, blocks, bs, kvh, d]
    before = kv.clone()
    src, dst = compaction_slots_ref(path, num_accepted, prefix, block_tables, block_size)
    real = src != dst
    assert int(real.sum()) == 3 + 0 + 1 and len(set(dst[real].tolist())) == int(real.sum())
    order = torch.randperm(len(src), generator=gen)  # gather-then-scatter: any order is safe
    compact_kv_ref(kv, src[order], dst[order])

    def entry(data, b, idx):  # [L, 2, kvh, d] at KV index idx of sequence b
        return data[:, :, block_tables[b, idx // block_size], idx % block_size]

    for b in range(3):
        p = int(prefix[b])
        for j in range(int(num_accepted[b]) + 1):
            assert torch.equal(entry(kv, b, p + j), entry(before, b, p + int(path[b, j])))
        for idx in range(p):
            assert torch.equal(entry(kv, b, idx), entry(before, b, idx))
    untouched = torch.ones(16 * block_size, dtype=torch.bool)
    untouched[dst[real]] = False
    flat = lambda t: t.view(2, 2, -1, 2, 3)
    assert torch.equal(flat(kv)[:, :, untouched], flat(before)[:, :, untouched])


@settings(max_examples=60, deadline=None)
@given(greedy_cases())
def test_greedy_kernel_equals_the_reference(case):
    """The Triton greedy walk (one program a sequence; the interpreter on a CPU) against the reference,
    padding that looks like a match and a depth past the trees included."""
    pytest.importorskip("triton")
    from kernels.acceptance_triton import greedy_accept_triton
    _, argmax, tokens, parents, num_nodes, max_depth = case
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    want = greedy_accept_ref(argmax, tokens, parents, num_nodes, max_depth)
    got = greedy_accept_triton(*(t.to(dev) for t in (argmax, tokens, parents, num_nodes)), max_depth)
    assert_result(got, want.path.tolist(), want.num_accepted.tolist(), want.bonus.tolist())


@settings(max_examples=60, deadline=None)
@given(greedy_cases(), st.integers(0, 40), st.sampled_from([4, 16]))
def test_compaction_slots_kernel_equals_the_reference(case, prefix, block_size):
    """The Triton compaction moves (one program a sequence) against the reference, on the paths the
    greedy walk accepts, shuffled block tables and a prefix near the table's end (clamped padding)."""
    pytest.importorskip("triton")
    from kernels.acceptance_triton import compaction_slots_triton
    _, argmax, tokens, parents, num_nodes, max_depth = case
    res = greedy_accept_ref(argmax, tokens, parents, num_nodes, max_depth)
    batch = parents.shape[0]
    blocks = -(-(prefix + max_depth + 1) // block_size)
    gen = torch.Generator().manual_seed(prefix + batch)
    tables = torch.randperm(batch * blocks + 3, generator=gen)[:batch * blocks].view(batch, blocks)
    prefixes = torch.full((batch,), prefix, dtype=torch.int64)
    want = compaction_slots_ref(res.path, res.num_accepted, prefixes, tables, block_size)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    got = compaction_slots_triton(res.path.to(dev), res.num_accepted.to(dev), prefixes.to(dev), tables.to(dev),
                                  block_size)
    assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()
