"""A chained step's draft kernels, each implementation against its reference: the extend's layout
(``extend_layout``), the packing of its fed rows (``pack_rows``), a proposal's KV layout
(``proposal_layout``), a tree level's inputs (``level_input``) and a dynamic tree's final nodes
(``best_nodes``).

The Triton kernels (kernels/draft_rows_triton.py, kernels/tree_triton.py) run through Triton's
interpreter on a CPU (tests/conftest.py sets TRITON_INTERPRET=1) and natively on a GPU. Outputs
start poisoned (``torch.empty`` filled with NaN or -7), pools are column slices of wider buffers.
"""

import numpy as np
import pytest
import torch

from kernels.draft_rows import extend_layout_ref, level_input_ref, pack_rows_ref, proposal_layout_ref
from kernels.tree import best_nodes_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.usefixtures("poisoned_empty")  # tests/conftest.py


def triton_or_skip(name: str):
    try:
        from kernels import triton_set
    except ImportError:
        pytest.skip("triton does not import")
    return getattr(triton_set.TRITON, name)


@pytest.mark.parametrize("B,D", [(1, 1), (1, 8), (3, 9), (17, 4), (64, 8), (200, 2)])
def test_extend_layout_equals_the_reference(B, D):
    """Random row counts (zeros among them: padding sequences; a batch whose rows fill every slot),
    first rows and block tables: every field of the Triton layout equals the reference's, the slots
    past the last row write nothing (-1)."""
    fn = triton_or_skip("extend_layout")
    rng = np.random.default_rng(B * 100 + D)
    block_size, W = 16, 6
    for trial in range(4):
        counts = rng.integers(0, D + 1, B) if trial < 3 else np.full(B, D)
        starts = rng.integers(0, W * block_size - D, B)
        tables = rng.integers(0, 1000, (B, W))
        args = [torch.as_tensor(x, dtype=torch.int64, device=DEVICE) for x in (starts, counts, tables)]
        want = extend_layout_ref(*args, block_size, D)
        got = fn(*args, block_size, D)
        assert set(got) == set(want)
        for key in want:
            assert got[key].dtype == torch.int64 and torch.equal(got[key].cpu(), want[key].cpu()), (key, trial)
        assert (got["slots"][int(counts.sum()):] == -1).all()


@pytest.mark.parametrize("B,widths", [(1, [10] * 6), (4, [3, 5, 2]), (64, [10] * 6), (300, [4])])
def test_proposal_layout_equals_the_reference(B, widths):
    """A proposal's levels laid out as the proposal lays them (sequence, KV row past the committed
    ones, depth), random committed rows, padding sequences among them (not live: slot -1) and block
    tables: slots, positions and every level's lengths equal the reference's."""
    fn = triton_or_skip("proposal_layout")
    rng = np.random.default_rng(B * 10 + len(widths))
    block_size, W = 16, 40
    seq, row, step, lens, fed = [], [], [], [], 0
    for i, F in enumerate(widths):
        seq.append(np.repeat(np.arange(B), F))
        row.append(np.tile(fed + np.arange(F), B))
        step.append(np.full(B * F, i))
        fed += F
        lens.append(fed)
    rows = rng.integers(0, W * block_size - fed, B)
    live = (rng.random(B) > 0.2).astype(np.int64)
    tables = rng.integers(0, 5000, (B, W))
    args = [torch.as_tensor(x, dtype=torch.int64, device=DEVICE)
            for x in (rows, live, tables, np.concatenate(seq), np.concatenate(row), np.concatenate(step), lens)]
    want, got = proposal_layout_ref(*args, block_size), fn(*args, block_size)
    for w, g in zip(want, got):
        assert g.dtype == torch.int64 and torch.equal(g.cpu(), w.cpu())
    padding = torch.as_tensor(live == 0)[torch.as_tensor(np.concatenate(seq))]
    assert (got[0].cpu()[padding] == -1).all() and (got[0].cpu()[~padding] >= 0).all()


@pytest.mark.parametrize("B,F,P,H,words", [(1, 10, 1, 64, 1), (1, 10, 10, 64, 2), (3, 4, 7, 96, 3), (8, 10, 10, 576, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("first", [True, False])
def test_level_input_equals_the_reference(B, F, P, H, words, dtype, first):
    """Parents at random slots (-1, the root, at a first level, whose parents' outputs are one row a
    sequence and which has no mask rows yet), tokens over a table wider than the model's rows: the
    gathered features and mask rows equal the reference's bit for bit, the normed input within a
    rounding (the norm's scale as rms_norm_triton takes it, 1 / sqrt)."""
    fn = triton_or_skip("level_input")
    gen = torch.Generator().manual_seed(B * 100 + F * 10 + H + first)
    P = 1 if first else P
    parent_out = (torch.randn(B, P, H, generator=gen) * 3).to(dtype)
    slot = torch.full((B, F), -1) if first else torch.randint(0, P, (B, F), generator=gen)
    embed = torch.randn(50, H + 8, generator=gen).to(dtype)[:, :H]  # rows strided wider than H
    tokens = torch.randint(0, 50, (B, F), generator=gen)
    emb_w, hid_w = (torch.randn(H, generator=gen).to(dtype) for _ in range(2))
    mask = None if first else torch.randint(-2 ** 31, 2 ** 31 - 1, (B, P, words), generator=gen, dtype=torch.int32)
    own = torch.randint(-2 ** 31, 2 ** 31 - 1, (F, words), generator=gen, dtype=torch.int32)
    args = [parent_out, slot, tokens, embed, emb_w, 1e-5, hid_w, 1e-6, mask, own]
    args = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
    want, got = level_input_ref(*args), fn(*args)
    x, h, rows = (t.cpu() for t in got)
    assert torch.equal(h, want[1].cpu()) and torch.equal(rows, want[2].cpu())
    assert x.dtype == dtype and x.shape == (B * F, 2 * H)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(x.float(), want[0].cpu().float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("B,D,width", [(1, 8, 24), (3, 9, 40), (16, 4, 1100), (130, 2, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_rows_equals_the_reference(B, D, width, dtype):
    """Random row counts (zeros among them), tokens out of the vocabulary (clamped when a vocabulary is
    given, as another process's ids are), features whose unfed rows hold NaN and inf: the packed ids
    and features equal the reference's bit for bit, zero past the last row."""
    fn = triton_or_skip("pack_rows")
    gen = torch.Generator().manual_seed(B * 1000 + D * 10 + width)
    vocab = 50
    for trial in range(3):
        counts = torch.randint(0, D + 1, (B,), generator=gen)
        tokens = torch.randint(-20, 2 * vocab, (B, D), generator=gen)
        features = torch.randn(B, D, width, generator=gen).to(dtype)
        unfed = torch.arange(D)[None, :] >= counts[:, None]
        features[unfed] = float("nan")
        features[unfed & (torch.arange(D)[None, :] % 2 == 0)] = float("inf")
        rows = B * D + trial  # (a few slots more than rows: zero)
        args = [t.to(DEVICE) for t in (counts, tokens, features)]
        for v in (0, vocab):
            want = pack_rows_ref(*args, rows, v)
            got = fn(*args, rows, v)
            for w, g in zip(want, got):
                assert g.dtype == w.dtype and torch.equal(g.cpu(), w.cpu())
            total = int(counts.sum())
            assert (got[0][total:] == 0).all() and (got[1][total:] == 0).all()
            assert torch.isfinite(got[1][:total].float()).all()  # fed rows only: never the NaN padding
            if v:
                assert ((got[0] >= 0) & (got[0] < v)).all()


def pools(rng, B: int, k: int, depth: int, ties: bool):
    """Dynamic-tree pools [B, P] in level order, as a builder fills them: depth 1 the root's k children,
    each later level k candidates per node of the last level's k best; scores the parent's plus a
    log-prob <= 0 (drawn from a few values with ``ties``: many equal scores)."""
    P = k + (depth - 1) * k * k
    tokens = rng.integers(0, 49152, (B, P))
    parents, depths, scores = np.full((B, P), -1), np.ones((B, P), dtype=np.int64), np.zeros((B, P), np.float32)
    for b in range(B):
        lp = (-rng.choice([0.0, 0.5, 1.25, 3.0], P) if ties else -rng.exponential(1.0, P)).astype(np.float32)
        scores[b, :k] = lp[:k]
        frontier, lo = list(range(k)), k
        for d in range(2, depth + 1):
            for j, parent in enumerate(frontier):
                for c in range(k):
                    i = lo + j * k + c
                    parents[b, i], depths[b, i], scores[b, i] = parent, d, scores[b, parent] + lp[i]
            level = range(lo, lo + k * k)
            frontier = sorted(level, key=lambda i: (-scores[b, i], i))[:k]
            lo += k * k
    return tokens, parents, depths, scores


@pytest.mark.parametrize("B,k,depth,n", [(1, 10, 7, 59), (3, 4, 3, 10), (2, 8, 6, 60), (5, 3, 4, 30), (1, 2, 2, 6)])
@pytest.mark.parametrize("ties", [False, True])
def test_best_nodes_equals_the_reference(B, k, depth, n, ties):
    """A dynamic tree's final nodes from builder-like pools (with and without many equal scores), read
    from column slices of wider buffers: the Triton kernels' tokens, parents, depths and scores equal
    the sorts' (the reference) exactly; the trees are parents first, ancestor-closed, depths one below
    the parent's."""
    fn = triton_or_skip("best_nodes")
    rng = np.random.default_rng(B * 1000 + k * 10 + depth + ties)
    tokens, parents, depths, scores = pools(rng, B, k, depth, ties)
    P = tokens.shape[1]
    wide = [torch.full((B, P + 5), fill, dtype=dt) for fill, dt in ((-3, torch.int64), (-4, torch.int64),
                                                                    (99, torch.int64), (7.0, torch.float32))]
    for w, x in zip(wide, (tokens, parents, depths, scores)):
        w[:, 2:2 + P] = torch.as_tensor(x)
    args = [w.to(DEVICE)[:, 2:2 + P] for w in wide]
    want = best_nodes_ref(*args, n)
    got = fn(*args, n)
    for w, g in zip(want, got):
        assert g.dtype == w.dtype and torch.equal(g.cpu(), w.cpu())
    t, p, d, _ = (x.cpu().numpy() for x in got)
    for b in range(B):
        assert ((p[b] < np.arange(n)) & (p[b] >= -1)).all()
        assert (np.where(p[b] >= 0, d[b][np.maximum(p[b], 0)] + 1, 1) == d[b]).all()


def test_best_nodes_of_garbage_pools_equal_the_reference():
    """Pools no builder writes (random parents and depths, scores rising along paths, NaN and inf among
    them): the kernels still agree with the reference (NaN ranks as +inf; a parent not kept reads -1)
    and every output is written."""
    fn = triton_or_skip("best_nodes")
    gen = torch.Generator().manual_seed(5)
    B, P, n = 4, 150, 40
    scores = torch.randn(B, P, generator=gen)
    scores[0, ::7] = float("nan")
    scores[1, ::5] = float("inf")
    scores[2, ::3] = float("-inf")
    args = [torch.randint(0, 1000, (B, P), generator=gen), torch.randint(-3, P + 3, (B, P), generator=gen),
            torch.randint(0, 9, (B, P), generator=gen), scores]
    args = [a.to(DEVICE) for a in args]
    want = best_nodes_ref(*args, n)
    got = fn(*args, n)
    for w, g in zip(want, got):
        assert torch.equal(g.cpu(), w.cpu()) if not g.is_floating_point() else \
            torch.equal(g.cpu().nan_to_num(1e9), w.cpu().nan_to_num(1e9))
