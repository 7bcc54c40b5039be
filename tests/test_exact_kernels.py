"""The batch-invariant kernels (``--exact``): right, and bitwise the same whatever the step.

A token's attention output and a row's matmul result must not change in their last bit when
the step around them changes: a tree step against the decode steps that target-only decoding
runs after compaction, a prefill chunk, other sequences in the batch, either launch shape.
On a CPU the kernels run through Triton's interpreter; on a GPU natively, where the tile
instructions are the real ones (``pytest -m gpu`` on the device).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from kernels import REFERENCE, select_kernels  # noqa: E402
from kernels.attention import paged_attention_ref  # noqa: E402
from kernels.attention_exact import CHUNK, ancestor_table, paged_attention_exact  # noqa: E402
from kernels.exact_set import EXACT  # noqa: E402
from kernels.linear_triton import linear_exact  # noqa: E402
from kernels.tree import tree_mask_ref  # noqa: E402
from runtime.step_layout import SeqChunk, layout_step  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 16
TREE = [-1, -1, 0, 0, 1, 4, 2]  # 7 nodes below the root; node 5's path: root, 1, 4, 5
PATH = [0, 2, 5, 6]  # tree columns (root = 0, node i = i + 1) of that path


def tree_mask(parents: list[int]) -> np.ndarray:
    return tree_mask_ref(torch.tensor([parents]), torch.tensor([len(parents)]))[0].numpy()


class Cache:
    """Paged caches filled sequence by sequence in shuffled blocks; NaN in every slot no sequence owns."""

    def __init__(self, kv: list[torch.Tensor], seed: int):
        kvh, d = kv[0].shape[2:]
        need = [-(-t.shape[1] // BLOCK) + 1 for t in kv]  # a spare block each: room for new tokens
        order = torch.randperm(sum(need), generator=torch.Generator().manual_seed(seed)).tolist()
        self.k = torch.full((sum(need), BLOCK, kvh, d), float("nan"), dtype=kv[0].dtype)
        self.v = self.k.clone()
        self.tables, at = [], 0
        for t, blocks in zip(kv, need):
            table = order[at:at + blocks]
            at += blocks
            slots = [table[i // BLOCK] * BLOCK + i % BLOCK for i in range(t.shape[1])]
            self.k.view(-1, kvh, d)[slots] = t[0]
            self.v.view(-1, kvh, d)[slots] = t[1]
            self.tables.append(table)
        self.k, self.v = self.k.to(DEVICE), self.v.to(DEVICE)


def attend(cache: Cache, chunks: list[SeqChunk], q: torch.Tensor, mode: str = "auto") -> torch.Tensor:
    meta = layout_step(chunks, BLOCK, torch.device(DEVICE), EXACT).meta
    return paged_attention_exact(q.to(DEVICE), cache.k, cache.v, meta, q.shape[-1] ** -0.5, mode)


def scenario(prefix: int, kvh: int, g: int, d: int, dtype, seed: int):
    """A prefix, a tree step's 8 tokens after it, and the same sequence after the path is kept."""
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, prefix + 8, kvh, d, generator=gen).to(dtype)  # prefix + root + 7 nodes
    q = torch.randn(8, kvh * g, d, generator=gen).to(dtype)
    compacted = torch.cat([kv[:, :prefix], kv[:, [prefix + c for c in PATH]]], dim=1)
    other = torch.randn(2, 300, kvh, d, generator=gen).to(dtype)  # a neighbour in the batch
    return kv, q, compacted, other


@pytest.mark.parametrize("prefix", [37, 60, 509, 700])  # within a tile, across tiles, across a chunk
@pytest.mark.parametrize("kvh, g, d, dtype", [(2, 3, 64, torch.bfloat16), (1, 4, 32, torch.float32)])
def test_tree_rows_equal_decode_rows_bitwise(prefix, kvh, g, d, dtype):
    """The accepted path's rows of a tree step are bit for bit the rows target-only decoding
    computes at the same positions after compaction: alone, in a prefill chunk, beside another
    sequence, in either launch shape."""
    check_tree_rows(prefix, kvh, g, d, dtype)


@pytest.mark.parametrize("prefix", [60, 700])
@pytest.mark.parametrize("kvh, g, d, dtype", [(2, 3, 64, torch.bfloat16), (1, 4, 32, torch.float32)])
def test_tree_rows_equal_decode_rows_bitwise_on_64_row_tiles(prefix, kvh, g, d, dtype, monkeypatch):
    """The same with 64 query rows a tile (the tile before 16; ``decode_baseline.py
    --exact-attention-rows 64`` measures it): any fixed tile keeps the invariance, 21 tokens of 3
    heads or 16 of 4 a tile."""
    from kernels import attention_exact

    monkeypatch.setattr(attention_exact, "BLOCK_M", 64)
    check_tree_rows(prefix, kvh, g, d, dtype)


@pytest.mark.parametrize("prefix", [60, 382])
def test_tree_rows_equal_decode_rows_bitwise_on_128_key_chunks(prefix, monkeypatch):
    """The same with folding chunks of 128 keys (``decode_baseline.py --exact-chunk 128`` times
    it): any fixed chunk keeps the invariance, with a tree across a chunk's end at 382 (384)."""
    from kernels import attention_exact

    monkeypatch.setattr(attention_exact, "CHUNK", 128)
    check_tree_rows(prefix, 2, 3, 64, torch.bfloat16)


@pytest.mark.parametrize("prefix", [382, 700])
@pytest.mark.parametrize("per_sm, tree_per_sm, tree_tiles", [(0, 0, 2), (1, 1, 2), (3, 1, 2), (0, 2, 2), (3, 1, 1)])
def test_split_programs_that_walk_several_chunks_give_the_same_bits(prefix, per_sm, tree_per_sm, tree_tiles,
                                                                    monkeypatch):
    """The split launch with fewer programs than chunks (each walking every ``chunk_programs``-th
    chunk; 0: one a chunk), for decode and tree steps alike or apart, a tree's whole-chunk programs
    taking two query tiles at once or one (``TREE_TILES``): the tree and decode rows are still the
    fold launch's bits, on 128-key chunks (6 of them at 700 keys; the tree across a chunk's end at
    382)."""
    from kernels import attention_exact

    monkeypatch.setattr(attention_exact, "CHUNK", 128)
    monkeypatch.setattr(attention_exact, "SPLIT_PROGRAMS_PER_SM", per_sm)
    monkeypatch.setattr(attention_exact, "TREE_SPLIT_PROGRAMS_PER_SM", tree_per_sm)
    monkeypatch.setattr(attention_exact, "TREE_TILES", tree_tiles)
    check_tree_rows(prefix, 2, 3, 64, torch.bfloat16)


def test_a_tree_of_several_query_tiles_gives_the_fold_launchs_bits(monkeypatch):
    """A 24-token tree after 300 keys (five query tiles of five tokens at three query heads a KV
    head: two pairs and one more) beside a decoding neighbour: the split launch gives the fold
    launch's bits whether its whole-chunk programs take two query tiles at once or one, and however
    many walk the chunks (128-key chunks)."""
    from kernels import attention_exact

    monkeypatch.setattr(attention_exact, "CHUNK", 128)
    cache, step, q = binary_tree_step(24, 300, 2, 3, 64, torch.bfloat16, seed=4)
    want = attend(cache, step, q, "fold")
    for tiles, per_sm in ((2, 0), (2, 1), (1, 0), (1, 1)):
        monkeypatch.setattr(attention_exact, "TREE_TILES", tiles)
        monkeypatch.setattr(attention_exact, "TREE_SPLIT_PROGRAMS_PER_SM", per_sm)
        assert torch.equal(attend(cache, step, q, "split"), want), (tiles, per_sm)


@pytest.mark.parametrize("g, d, dtype", [(3, 64, torch.bfloat16), (4, 32, torch.float32)])
@pytest.mark.parametrize("per_sm", [0, 1])
def test_a_trees_wide_whole_chunk_tile_attends_as_the_narrow_one(g, d, dtype, per_sm, monkeypatch):
    """A 24-token tree after 700 keys (whole chunks before the tree's) beside a decoding neighbour,
    its whole-chunk programs forced onto the wide rows (``tile="tree"``: 20 or 16 tokens a tile),
    however many programs walk the chunks: attention (against the reference), and on a GPU where the
    probe says so the narrow tiles' bits (in Triton's interpreter a dot's rounding depends on the
    tile's shape). The fold launch never takes the wide rows."""
    from kernels import attention_exact

    monkeypatch.setattr(attention_exact, "CHUNK", 128)
    monkeypatch.setattr(attention_exact, "TREE_WIDE_PROGRAMS_PER_SM", per_sm)
    cache, step, q = binary_tree_step(24, 700, 2, g, d, dtype, seed=6)
    q = q.to(DEVICE)
    meta = layout_step(step, BLOCK, torch.device(DEVICE), EXACT).meta
    scale = d ** -0.5
    wide = paged_attention_exact(q, cache.k, cache.v, meta, scale, "split", tile="tree")
    assert torch.equal(paged_attention_exact(q, cache.k, cache.v, meta, scale, "fold", tile="tree"),
                       paged_attention_exact(q, cache.k, cache.v, meta, scale, "fold", tile="narrow"))
    ref_meta = layout_step(step, BLOCK, torch.device(DEVICE), REFERENCE).meta
    want = paged_attention_ref(q, cache.k.nan_to_num(0.0), cache.v.nan_to_num(0.0), ref_meta, scale)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    torch.testing.assert_close(wide.float(), want.float(), atol=tol, rtol=tol)
    if DEVICE == "cuda" and attention_exact.probe_wide_tile(torch.device(DEVICE), dtype, g, d, tile="tree"):
        narrow = paged_attention_exact(q, cache.k, cache.v, meta, scale, "split", tile="narrow")
        assert torch.equal(wide, narrow)
        monkeypatch.setattr(attention_exact, "TREE_WIDE_MIN_KEYS", 0)  # (auto: the wide rows from any length)
        assert torch.equal(paged_attention_exact(q, cache.k, cache.v, meta, scale, "split"), narrow)


def test_a_wide_trees_loop_a_chunk_gives_the_one_loops_bits(monkeypatch):
    """``TREE_NESTED``: the wide rows' whole-chunk programs walking a loop a chunk (on ``NESTED_STAGES``
    stages) give the bits of one loop over all their key tiles: a 24-token tree after 700 keys beside a
    decoding neighbour, 128-key chunks (five whole ones before the tree's), programs that walk every
    few chunks."""
    from kernels import attention_exact

    monkeypatch.setattr(attention_exact, "CHUNK", 128)
    monkeypatch.setattr(attention_exact, "TREE_WIDE_PROGRAMS_PER_SM", 1)
    cache, step, q = binary_tree_step(24, 700, 2, 3, 64, torch.bfloat16, seed=6)
    q = q.to(DEVICE)
    meta = layout_step(step, BLOCK, torch.device(DEVICE), EXACT).meta
    got = {}
    for nested in (0, 1):
        monkeypatch.setattr(attention_exact, "TREE_NESTED", nested)
        got[nested] = paged_attention_exact(q, cache.k, cache.v, meta, 64 ** -0.5, "split", tile="tree")
    assert torch.equal(got[0], got[1])


def test_a_trees_wide_rows_without_selects_give_their_bits(monkeypatch):
    """``OPEN_TILES``: a tree's whole-chunk programs on the wide rows attend their key tiles without
    ``_tile``'s visibility and activity selects (every row there sees every key) and give the bits of
    the tiles with them, walking a loop a chunk or one loop: trees after 700 keys beside a decoding
    neighbour, 128-key chunks, programs that walk every few chunks; a 12-token tree (one wide tile: 16
    columns of ones in the row sums) and a 24-token one (two: ``ROWSUM_COLS``, 8 or 16; ``nested_tile``).
    Breaking ``_tile_seen`` (its weights' exponent taken in another order) fails it."""
    from kernels import attention_exact

    monkeypatch.setattr(attention_exact, "CHUNK", 128)
    monkeypatch.setattr(attention_exact, "TREE_WIDE_PROGRAMS_PER_SM", 1)
    assert attention_exact.probe_tree_tokens(3) == (20, 40)  # (the wide tile's tokens for three query heads)
    for tokens, cols in ((12, 8), (24, 8), (24, 16)):
        monkeypatch.setattr(attention_exact, "ROWSUM_COLS", cols)
        cache, step, q = binary_tree_step(tokens, 700, 2, 3, 64, torch.bfloat16, seed=6)
        q = q.to(DEVICE)
        meta = layout_step(step, BLOCK, torch.device(DEVICE), EXACT).meta
        for nested in (0, 1):
            monkeypatch.setattr(attention_exact, "TREE_NESTED", nested)
            got = {}
            for open_tiles in (0, 1):
                monkeypatch.setattr(attention_exact, "OPEN_TILES", open_tiles)
                got[open_tiles] = paged_attention_exact(q, cache.k, cache.v, meta, 64 ** -0.5, "split", tile="tree")
            assert torch.equal(got[0], got[1]), (tokens, cols, nested)


def test_a_few_token_tree_takes_the_one_token_launch_shape(monkeypatch):
    """``TREE_FEW_TOKENS``: a tree step of at most that many tokens a sequence keeps the narrow tile
    where the wide rows are wanted and allowed, and sizes its chunks' programs as a one-token step
    does (``SPLIT_PROGRAMS_PER_SM``); the split launch still gives the fold launch's bits (a 5-token
    tree after 700 keys beside a decoding neighbour, 128-key chunks). Off (0), the tree's own."""
    from kernels import attention_exact

    monkeypatch.setattr(attention_exact, "CHUNK", 128)
    monkeypatch.setattr(attention_exact, "SPLIT_PROGRAMS_PER_SM", 1)  # (programs that walk several chunks)
    monkeypatch.setattr(attention_exact, "ONE_TILE_TREES", 0)  # (the 5-token tree is one tile: its own test)
    cache, step, q = binary_tree_step(5, 700, 2, 3, 64, torch.bfloat16, seed=9)
    want = attend(cache, step, q, "fold")
    asked, real = [], attention_exact.chunk_programs
    monkeypatch.setattr(attention_exact, "chunk_programs",
                        lambda *a, per_sm=None, tree=False, floor=False: asked.append((per_sm, tree)) or
                        real(*a, per_sm=per_sm, tree=tree, floor=floor))
    monkeypatch.setattr(attention_exact, "TREE_WIDE_MIN_KEYS", 0)  # the wide rows wanted at any length ...
    monkeypatch.setattr(attention_exact, "wide_tile_ok", lambda *a, **k: True)  # ... and allowed
    wide = attention_exact.TREE_WIDE_PROGRAMS_PER_SM
    for few, per_sm in ((0, wide), (4, wide), (5, 1)):  # (the wide rows' programs an SM, else a one-token step's)
        monkeypatch.setattr(attention_exact, "TREE_FEW_TOKENS", few)
        asked.clear()
        got = attend(cache, step, q, "split")
        assert asked == [(per_sm, True)], (few, asked)
        if few >= 5:  # the narrow tile: the fold launch's bits (the wide rows' are the probe's matter)
            assert torch.equal(got, want)
    # The wide rows' programs rounded down (TREE_WIDE_FLOOR): other programs, the same bits (10 SMs, one
    # program an SM for 4 pairs: 3 a pair rounded up, 2 down, of 6 chunks of 128 keys).
    monkeypatch.setattr(attention_exact, "TREE_FEW_TOKENS", 0)
    monkeypatch.setattr(attention_exact, "CHUNK", 128)
    monkeypatch.setattr(attention_exact, "TREE_WIDE_PROGRAMS_PER_SM", 1)
    monkeypatch.setattr(attention_exact, "_sms", lambda device: 10)
    monkeypatch.setattr(attention_exact, "TREE_WIDE_FLOOR", 0)
    floors = []
    monkeypatch.setattr(attention_exact, "chunk_programs",
                        lambda *a, floor=False, **k: floors.append((a[1], floor, real(*a, floor=floor, **k))) or
                        floors[-1][2])
    wide_bits = attend(cache, step, q, "split")
    monkeypatch.setattr(attention_exact, "TREE_WIDE_FLOOR", 1)
    assert torch.equal(attend(cache, step, q, "split"), wide_bits)
    assert [(pairs, f, n) for pairs, f, n in floors] == [(4, False, 3), (4, True, 2)]
    meta = layout_step(step, BLOCK, torch.device(DEVICE), EXACT).meta
    monkeypatch.setattr(attention_exact, "TREE_FEW_TOKENS", 5)
    assert attention_exact.few_tree(meta)
    monkeypatch.setattr(attention_exact, "TREE_FEW_TOKENS", 4)
    assert not attention_exact.few_tree(meta)


@pytest.mark.parametrize("tokens, g", [(2, 3), (5, 3), (4, 4)])
def test_a_one_tile_tree_takes_the_one_token_launch_shape_a_tile_a_program(tokens, g, monkeypatch):
    """``ONE_TILE_TREES``: a tree whose sequences each fit one narrow query tile (five tokens at three
    query heads a KV head, four at four) takes the narrow tile where the wide rows are wanted and
    allowed, a one-token step's programs for its chunks, and one query tile a whole-chunk program;
    its rows keep the fold launch's bits and those of the tree launch shapes (off). A tree of one
    token more is two tiles and keeps the tree's own."""
    from kernels import attention_exact

    monkeypatch.setattr(attention_exact, "CHUNK", 128)
    monkeypatch.setattr(attention_exact, "SPLIT_PROGRAMS_PER_SM", 1)  # (programs that walk several chunks)
    cache, step, q = binary_tree_step(tokens, 700, 2, g, 64, torch.bfloat16, seed=tokens)
    want = attend(cache, step, q, "fold")
    monkeypatch.setattr(attention_exact, "ONE_TILE_TREES", 0)
    assert torch.equal(attend(cache, step, q, "split"), want)  # (TREE_TILES: two tiles a program, one empty)
    monkeypatch.setattr(attention_exact, "ONE_TILE_TREES", 1)
    asked, real = [], attention_exact.chunk_programs
    monkeypatch.setattr(attention_exact, "chunk_programs",
                        lambda *a, per_sm=None, tree=False, floor=False: asked.append((a[1], per_sm)) or
                        real(*a, per_sm=per_sm, tree=tree, floor=floor))
    monkeypatch.setattr(attention_exact, "TREE_WIDE_MIN_KEYS", 0)  # the wide rows wanted at any length ...
    monkeypatch.setattr(attention_exact, "wide_tile_ok", lambda *a, **k: True)  # ... and allowed
    assert torch.equal(attend(cache, step, q, "split"), want)
    # one program a (query tile, KV head) pair of the tree's sequence and of its decoding neighbour: 2 x 2
    assert asked == [(4, 1)], asked
    meta = layout_step(step, BLOCK, torch.device(DEVICE), EXACT).meta
    assert attention_exact.one_tile_tree(meta, g) and attention_exact.few_tree(meta, g)
    assert not attention_exact.few_tree(meta)  # (TREE_FEW_TOKENS 0: no group, no rule)
    bigger = layout_step(binary_tree_step(attention_exact.narrow_tokens(g) + 1, 700, 2, g, 64, torch.bfloat16,
                                          seed=1)[1], BLOCK, torch.device(DEVICE), EXACT).meta
    assert not attention_exact.one_tile_tree(bigger, g) and not attention_exact.few_tree(bigger, g)
    monkeypatch.setattr(attention_exact, "ONE_TILE_TREES", 0)
    assert not attention_exact.one_tile_tree(meta, g)


def test_trees_ask_for_the_wide_rows_over_long_prefixes_or_long_chunks(monkeypatch):
    """``tree_wide_wanted``: launches over at least ``TREE_WIDE_MIN_KEYS`` keys (in a graph, the
    cache's capacity), or over any number on fold chunks of at least ``TREE_WIDE_ANY_CHUNK`` keys (the
    8B's 512, not SmolLM2's 128); not with ``TREE_WIDE`` off; off the GPU the probe's answer keeps them
    narrow."""
    from kernels import attention_exact

    keys = attention_exact.TREE_WIDE_MIN_KEYS
    assert attention_exact.TREE_WIDE_ANY_CHUNK == 512
    for chunk in (128, 256):
        assert attention_exact.tree_wide_wanted(keys, chunk) and attention_exact.tree_wide_wanted(4 * keys, chunk)
        assert not attention_exact.tree_wide_wanted(keys - 1, chunk)
    assert attention_exact.tree_wide_wanted(100, 512) and attention_exact.tree_wide_wanted(100, 1024)
    assert attention_exact.tree_wide_wanted(100) == (attention_exact.CHUNK >= 512)  # (the module's chunk)
    # below TREE_WIDE_MIN_KEYS, only trees past one narrow whole-chunk program's two tiles (the 8B's
    # four query heads a KV head: four tokens a tile, so more than eight tokens)
    assert not attention_exact.tree_wide_wanted(4096, 512, tokens=8, group=4)
    assert attention_exact.tree_wide_wanted(4096, 512, tokens=9, group=4)
    assert attention_exact.tree_wide_wanted(keys, 512, tokens=8, group=4)  # (long prefixes: any tree)
    monkeypatch.setattr(attention_exact, "TREE_WIDE_ANY_CHUNK", 0)
    assert not attention_exact.tree_wide_wanted(keys - 1, 512) and attention_exact.tree_wide_wanted(keys, 512)
    monkeypatch.setattr(attention_exact, "TREE_WIDE", False)
    assert not attention_exact.tree_wide_wanted(4 * keys) and not attention_exact.tree_wide_wanted(100, 512)
    if DEVICE != "cuda":
        assert not attention_exact.wide_tile_ok(torch.zeros(1, 4, 32), 4, tile="tree")


def test_a_tree_on_the_wide_rows_always_takes_the_split_launch():
    """``_mode``: a step with more than two programs an SM folds in its programs, unless it is a tree
    on the wide rows (only the split launch shares key tiles among them), whose partials fit."""
    from types import SimpleNamespace

    from kernels import attention_exact

    cpu = torch.device("cpu")  # (8 SMs counted off the GPU)
    meta = SimpleNamespace(max_seq_len=16504, num_seqs=4)
    args = (240, 32, 8, 128, 15, cpu, 512)  # T, heads, KV heads, head_dim, query tiles, device, chunk
    assert not attention_exact._mode(meta, *args)  # 480 programs
    assert attention_exact._mode(meta, *args, wide_tree=True)
    huge = SimpleNamespace(max_seq_len=1 << 22, num_seqs=4)  # partials past SPLIT_BYTES
    assert not attention_exact._mode(huge, *args, wide_tree=True)
    one_chunk = SimpleNamespace(max_seq_len=300, num_seqs=4)
    assert not attention_exact._mode(one_chunk, *args, wide_tree=True)


def test_chunk_programs(monkeypatch):
    from kernels import attention_exact

    cpu = torch.device("cpu")  # (8 SMs counted off the GPU)
    assert attention_exact.chunk_programs(64, 192, cpu, per_sm=4) == 1
    assert attention_exact.chunk_programs(64, 3, cpu, per_sm=4) == 11
    assert attention_exact.chunk_programs(5, 3, cpu, per_sm=4) == 5
    assert attention_exact.chunk_programs(64, 3, cpu, per_sm=0) == 64
    assert attention_exact.chunk_programs(64, 3, cpu, per_sm=4, floor=True) == 10  # 32 // 3, not 11
    assert attention_exact.chunk_programs(64, 192, cpu, per_sm=4, floor=True) == 1  # at least one
    monkeypatch.setattr(attention_exact, "SPLIT_PROGRAMS_PER_SM", 1)
    monkeypatch.setattr(attention_exact, "TREE_SPLIT_PROGRAMS_PER_SM", 2)
    assert attention_exact.chunk_programs(64, 3, cpu) == 3
    assert attention_exact.chunk_programs(64, 3, cpu, tree=True) == 6


def binary_tree_step(n: int, prefix: int, kvh: int, g: int, d: int, dtype, seed: int):
    """A step of an ``n``-token binary tree (node j below node (j - 1) // 2) after ``prefix`` keys,
    beside a neighbour decoding its 300th token: (cache, chunks, queries [n + 1, heads, d])."""
    parents = [-1] + [(i - 1) // 2 for i in range(1, n - 1)]
    depths = [0]
    for p in parents:
        depths.append(depths[p + 1] + 1)
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, prefix + n, kvh, d, generator=gen).to(dtype)
    other = torch.randn(2, 300, kvh, d, generator=gen).to(dtype)
    q = torch.randn(n + 1, kvh * g, d, generator=gen).to(dtype)
    cache = Cache([kv, other], seed=3)
    step = [SeqChunk(list(range(n)), prefix, cache.tables[0], positions=[prefix + x for x in depths],
                     custom_mask=tree_mask(parents), mask_start=prefix),
            SeqChunk([0], 299, cache.tables[1])]
    return cache, step, q


def check_tree_rows(prefix, kvh, g, d, dtype):
    kv, q, compacted, other = scenario(prefix, kvh, g, d, dtype, seed=prefix)
    depths = [0, 1, 1, 2, 2, 2, 3, 3]  # by column: root, nodes 0 .. 6
    tree = Cache([kv, other], seed=1)
    step = [SeqChunk(list(range(8)), prefix, tree.tables[0], positions=[prefix + x for x in depths],
                     custom_mask=tree_mask(TREE), mask_start=prefix),
            SeqChunk([0], 299, tree.tables[1])]
    q_other = torch.randn(1, kvh * g, d, generator=torch.Generator().manual_seed(9)).to(dtype)
    got_tree = {mode: attend(tree, step, torch.cat([q, q_other]), mode)[:8] for mode in ("fold", "split")}
    assert torch.equal(got_tree["fold"], got_tree["split"])

    # Sanity against the reference: the tree step is attention at all.
    ref_meta = layout_step(step, BLOCK, torch.device(DEVICE), REFERENCE).meta
    want = paged_attention_ref(torch.cat([q, q_other]).to(DEVICE), tree.k.nan_to_num(0.0), tree.v.nan_to_num(0.0),
                               ref_meta, d ** -0.5)[:8]
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    torch.testing.assert_close(got_tree["fold"].float(), want.float(), atol=tol, rtol=tol)

    after = Cache([compacted, other], seed=2)
    for i, col in enumerate(PATH):  # decode steps, one token each, with and without a neighbour
        alone = attend(after, [SeqChunk([0], prefix + i, after.tables[0])], q[col:col + 1])
        assert torch.equal(alone[0], got_tree["fold"][col]), f"depth {i} alone"
        batched = attend(after, [SeqChunk([0], 299, after.tables[1]), SeqChunk([0], prefix + i, after.tables[0])],
                         torch.cat([q_other, q[col:col + 1]]), "split")
        assert torch.equal(batched[1], got_tree["fold"][col]), f"depth {i} batched"
    chunk = attend(after, [SeqChunk(list(range(4)), prefix, after.tables[0])], q[PATH])  # a prefill chunk
    assert torch.equal(chunk, got_tree["fold"][PATH])


@pytest.mark.parametrize("prefix", [500, 520, 1300])  # 8, 9 and 21 chunks of 64 keys
def test_the_split_fold_over_many_chunks_gives_the_fold_launchs_bits(prefix, monkeypatch):
    """Over many chunks (64 keys each: 8, 9 and 21 for the tree), the split launch's fold kernel and
    the decode steps after the tree give the bits of one program walking the chunks
    (``check_tree_rows``). A fold that skips or repeats a chunk fails here (tried on purpose: a fold
    kernel that stops after eight chunks fails at 9 and 21; one loading eight chunks at a time that
    folds its seventh twice fails at 8)."""
    from kernels import attention_exact

    monkeypatch.setattr(attention_exact, "CHUNK", 64)
    check_tree_rows(prefix, 2, 3, 64, torch.bfloat16)


@pytest.mark.parametrize("mode", ["fold", "split"])
def test_one_loop_over_the_chunks_gives_a_loop_a_chunks_bits(monkeypatch, mode):
    """A step without a tree (decodes ending mid-chunk, on a chunk's end, and a prefill chunk across
    one) walks a program's key tiles in one loop where chunks hold ``FLAT_TILES`` tiles or more:
    the bits of a loop a chunk (128-key chunks of two tiles here)."""
    from kernels import attention_exact

    monkeypatch.setattr(attention_exact, "CHUNK", 128)
    monkeypatch.setattr(attention_exact, "SPLIT_PROGRAMS_PER_SM", 1)  # (split: some programs walk 2 chunks)
    kvh, g, d = 2, 3, 64
    gen = torch.Generator().manual_seed(9)
    lengths = [300, 256, 37, 170]
    cache = Cache([torch.randn(2, n, kvh, d, generator=gen).to(torch.bfloat16) for n in lengths], seed=2)
    step = [SeqChunk([0], n - 1, table) for n, table in zip(lengths[:3], cache.tables)]
    step.append(SeqChunk(list(range(60)), 110, cache.tables[3]))
    q = torch.randn(63, kvh * g, d, generator=gen).to(torch.bfloat16)
    got = {}
    for flat_tiles in (2, 1000):
        monkeypatch.setattr(attention_exact, "FLAT_TILES", flat_tiles)
        got[flat_tiles] = attend(cache, step, q, mode)
    assert torch.equal(got[2], got[1000])
    meta = layout_step(step, BLOCK, torch.device(DEVICE), REFERENCE).meta
    want = paged_attention_ref(q.to(DEVICE), cache.k.nan_to_num(0.0), cache.v.nan_to_num(0.0), meta, d ** -0.5)
    torch.testing.assert_close(got[2].float(), want.float(), atol=2e-2, rtol=2e-2)


def test_prefill_rows_do_not_depend_on_chunking(monkeypatch):
    """A 160-token prompt prefilled whole, in uneven chunks, or token by token: the same bits
    (128-key chunks, so the prompt crosses one: 512 on the GPU)."""
    from kernels import attention_exact

    monkeypatch.setattr(attention_exact, "CHUNK", 128)
    kvh, g, d = 2, 3, 64
    gen = torch.Generator().manual_seed(5)
    kv = torch.randn(2, 160, kvh, d, generator=gen).to(torch.bfloat16)
    q = torch.randn(160, kvh * g, d, generator=gen).to(torch.bfloat16)
    cache = Cache([kv], seed=3)
    whole = attend(cache, [SeqChunk(list(range(160)), 0, cache.tables[0])], q)
    for lo, hi in [(0, 35), (35, 133), (133, 160)]:
        part = attend(cache, [SeqChunk(list(range(hi - lo)), lo, cache.tables[0])], q[lo:hi])
        assert torch.equal(part, whole[lo:hi]), (lo, hi)
    for pos in (0, 63, 64, 127, 128, 159):
        one = attend(cache, [SeqChunk([0], pos, cache.tables[0])], q[pos:pos + 1], "split")
        assert torch.equal(one[0], whole[pos]), pos


@pytest.mark.parametrize("kvh, g, d, dtype", [(2, 3, 64, torch.bfloat16), (1, 4, 32, torch.float32)])
def test_a_ragged_graphed_prompt_step_gives_the_eager_steps_bits(kvh, g, d, dtype):
    """A graphed prompt step's layout (``meta.ragged``: each program finds its chunk and tile from
    query_start_loc, the grid fixed by the layout's capacity of tokens, padding sequences and rows
    past the step's): every real row is bit for bit the eager step's and each chunk's alone. One
    chunk decodes past a 512-key chunk's end. The padding rows' queries are NaN: a program that took
    one for a real row fails the comparison. On a GPU the capacity (96 tokens) takes the wide tile
    where the probe allows it, the eager step the narrow one."""
    from runtime.static_layout import Bucket, StaticLayout

    gen = torch.Generator().manual_seed(17)
    cases = [(0, 19), (5, 1), (21, 40), (0, 3), (600, 2)]  # (cached, new) per sequence
    cache = Cache([torch.randn(2, c + n, kvh, d, generator=gen).to(dtype) for c, n in cases], seed=6)
    chunks = [SeqChunk(list(range(n)), c, table) for (c, n), table in zip(cases, cache.tables)]
    T, capacity = sum(n for _, n in cases), 96
    q = torch.randn(capacity, kvh * g, d, generator=gen).to(dtype)
    q[T:] = float("nan")
    eager = attend(cache, chunks, q[:T])
    lay = StaticLayout(Bucket(8, capacity, False, ragged=True), 48, 1024, BLOCK, torch.device(DEVICE))
    lay.fill(chunks)
    graphed = paged_attention_exact(q.to(DEVICE), cache.k, cache.v, lay.meta, d ** -0.5)[:T]
    assert torch.isfinite(graphed).all()
    assert torch.equal(graphed, eager)
    at = 0
    for chunk in chunks:
        n = len(chunk.token_ids)
        assert torch.equal(attend(cache, [chunk], q[at:at + n]), graphed[at:at + n]), chunk.kv_start
        at += n
    with pytest.raises(ValueError, match="ragged"):
        paged_attention_exact(q.to(DEVICE), cache.k, cache.v, lay.meta, d ** -0.5, "split")


def test_chunk_is_a_whole_number_of_tiles():
    from kernels.attention_exact import BLOCK_N
    assert CHUNK % BLOCK_N == 0


def test_ancestor_table():
    mask = torch.from_numpy(tree_mask(TREE))
    table = ancestor_table(mask)
    assert table[6].tolist() == [0, 2, 5, 6, -1, -1, -1, -1]  # node 5: root, node 1, node 4, itself
    assert table[0].tolist() == [0] + [-1] * 7
    assert table[3].tolist() == [0, 1, 3] + [-1] * 5


@pytest.mark.parametrize("words", [1, 2, 3])
def test_ancestor_table_kernel_gives_the_torch_table(words):
    """``ancestor_table_triton`` (one launch from the packed words, ``EAGLE3_EXACT_TABLE=triton``) gives
    ``ancestor_table`` of the unpacked mask: random rows, an empty row, a full row, bit 31 set."""
    from kernels.attention import pack_mask, unpack_mask
    from kernels.attention_exact import ancestor_table_triton

    gen = torch.Generator().manual_seed(words)
    mask = torch.rand(70, 32 * words, generator=gen) < 0.3
    mask[0] = False
    mask[1] = True
    mask[2, 31::32] = True
    packed = pack_mask(mask)
    assert torch.equal(unpack_mask(packed), mask)
    got = ancestor_table_triton(packed.to(DEVICE)).cpu()
    assert torch.equal(got, ancestor_table(mask))
    assert got[0].tolist() == [-1] * (32 * words) and got[1].tolist() == list(range(32 * words))


def test_the_table_builder_switch(monkeypatch):
    """``prepare_attention_exact`` builds the table with one kernel where ``TABLE_BUILDER`` is ``triton``
    and the packed mask is on CUDA, with torch ops otherwise: the same table either way."""
    from kernels import attention_exact
    from kernels.attention import pack_mask
    from kernels.metadata import AttentionMetadata

    mask = torch.from_numpy(tree_mask(TREE))
    ints = [torch.zeros(n, dtype=torch.int64, device=DEVICE) for n in (2, 1, 8)]
    meta = AttentionMetadata(query_start_loc=ints[0], seq_lens=ints[1], block_tables=ints[1][:, None],
                             slot_mapping=ints[2], positions=ints[2], token_seq=ints[2], token_q_idx=ints[2],
                             max_query_len=8, max_seq_len=8, custom_mask=pack_mask(mask).to(DEVICE),
                             mask_start=ints[1])
    calls = []
    kernel = attention_exact.ancestor_table_triton
    monkeypatch.setattr(attention_exact, "ancestor_table_triton", lambda words: calls.append(1) or kernel(words))
    want = ancestor_table(torch.cat([mask, mask.new_zeros(8, 24)], 1))  # (the packed mask's 32 columns)
    for builder in ("torch", "triton"):
        monkeypatch.setattr(attention_exact, "TABLE_BUILDER", builder)
        assert torch.equal(attention_exact.prepare_attention_exact(meta).custom_mask.cpu(), want)
    assert len(calls) == (1 if DEVICE == "cuda" else 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_exact_rows_do_not_depend_on_row_count(dtype):
    """Rows computed in calls of 1, 7, 64 and 300 rows: bit for bit the same, bias included."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(300, 96, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(80, 96, generator=gen) * 0.1).to(dtype).to(DEVICE)
    bias = torch.randn(80, generator=gen).to(dtype).to(DEVICE)
    full = linear_exact(x, w, bias)
    torch.testing.assert_close(full.float(), torch.nn.functional.linear(x.float(), w.float(), bias.float()),
                               atol=2e-2 if dtype == torch.bfloat16 else 1e-4, rtol=2e-2)
    for rows in (1, 7, 64):
        for start in (0, 5, 200):
            assert torch.equal(linear_exact(x[start:start + rows], w, bias), full[start:start + rows]), (rows, start)


def projection_rows_differ(kernels, dtype) -> list:
    """Rows of a kernel set's projections (norm, activation and residual adds in their epilogues)
    computed in calls of 1, 7, 20, 64 and 300 rows: the (output, rows, start) whose bits differ
    from the 300-row call's."""
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(300, 1100, generator=gen).to(dtype).to(DEVICE)  # K over 1024: K tiles from the row tile
    residual = torch.randn(300, 80, generator=gen).to(dtype).to(DEVICE)
    w, w_up = ((torch.randn(n, k, generator=gen) * 0.1).to(dtype).to(DEVICE) for n, k in ((80, 1100), (2 * 48, 80)))
    norm_w = (1 + 0.1 * torch.randn(80, generator=gen)).to(dtype).to(DEVICE)
    w_qkv = (torch.randn(64, 80, generator=gen) * 0.1).to(dtype).to(DEVICE)  # 2 q heads, 1 KV head of 16
    h, hn, ss = kernels.linear_add_norm(x, w, residual, norm_w)
    act = kernels.scaled_gate_up_silu(hn, ss, 1e-5, w_up)
    qkv = kernels.scaled_linear(hn, ss, 1e-5, w_up)
    tables = _rope_tables()  # one pair for every call: the kernel's rows are what is compared
    rope = _qkv_rope(kernels, hn, ss, w_qkv, range(300), tables)
    differ = []
    for rows in (1, 7, 20, 64):
        for start in (0, 5, 200):
            part = slice(start, start + rows)
            h2, hn2, ss2 = kernels.linear_add_norm(x[part], w, residual[part], norm_w)
            outputs = {"h": (h2, h[part]), "hn": (hn2, hn[part]), "ss": (ss2, ss[:, part]),
                       "gate_up": (kernels.scaled_gate_up_silu(hn2, ss2, 1e-5, w_up), act[part]),
                       "qkv": (kernels.scaled_linear(hn2, ss2, 1e-5, w_up), qkv[part])}
            if rope is not None:  # (q, k and v of the rows' slots)
                got = _qkv_rope(kernels, hn2, ss2, w_qkv, range(start, start + rows), tables)
                outputs["qkv_rope"] = (got, tuple(t[part] for t in rope))
            differ += [(name, rows, start) for name, (got, want) in outputs.items() if not _equal(got, want)]
    return differ


def _equal(got, want) -> bool:
    """Bit for bit: two tensors, or two tuples of them."""
    if isinstance(got, tuple):
        return all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    return torch.equal(got, want)


def _rope_tables():
    """cos, sin for 300 positions of 16-wide heads: one pair for every call of a comparison, so that
    only the kernel's rows are compared (``runtime.rope.rope_table`` says why tables once differed)."""
    from common.config import RopeScaling
    from runtime.rope import rope_tables

    return rope_tables(16, 10000.0, RopeScaling(), 300, torch.device(DEVICE))


def _qkv_rope(kernels, hn, ss, w_qkv, positions, tables):
    """A set's ``scaled_qkv_rope`` (None: it has none) on rows at ``positions`` (their slots too, in a
    NaN cache) with RoPE ``tables`` (cos, sin): rotated q, and the k and v written at the rows' slots."""
    if kernels.scaled_qkv_rope is None:
        return None
    cos, sin = tables
    slots = torch.tensor(list(positions), device=DEVICE)
    k_cache, v_cache = (torch.full((19, 16, 1, 16), float("nan"), dtype=hn.dtype, device=DEVICE) for _ in range(2))
    q = kernels.scaled_qkv_rope(hn, ss, 1e-5, w_qkv, None, slots, cos, sin, k_cache, v_cache, slots, 2, 1, 16)
    return q, k_cache.view(-1, 1, 16)[slots], v_cache.view(-1, 1, 16)[slots]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_projections_rows_do_not_depend_on_row_count(dtype):
    """The exact set's projections: rows computed in calls of 1, 7, 20, 64 and 300 rows, bit for bit
    the same, the q/k/v projection with RoPE and the KV write in its epilogue too. On a GPU the calls
    take row tiles of 16, 32 and 64 rows, and K steps that follow the tile."""
    assert EXACT.scaled_qkv_rope is not None
    assert projection_rows_differ(EXACT, dtype) == []
    assert EXACT.fused_rows(4096) > 1 << 30  # every step, prefill chunks too


def test_the_row_count_check_catches_a_split_k_projection():
    """The check above, on a set broken on purpose: its qkv projection splits K in two and adds the
    halves (as a split-K matmul does) in calls of more than 16 rows. The check must see it."""
    import dataclasses

    def split_k_when_many_rows(x, ss, eps, w, **kwargs):
        if x.shape[0] <= 16:
            return EXACT.scaled_linear(x, ss, eps, w, **kwargs)
        half = w.shape[1] // 2
        return (EXACT.scaled_linear(x[:, :half].contiguous(), ss, eps, w[:, :half].contiguous(), **kwargs)
                + EXACT.scaled_linear(x[:, half:].contiguous(), ss, eps, w[:, half:].contiguous(), **kwargs))

    broken = dataclasses.replace(EXACT, scaled_linear=split_k_when_many_rows)
    differ = projection_rows_differ(broken, torch.bfloat16)
    assert differ and {name for name, _, _ in differ} == {"qkv"}, differ
    assert {rows for _, rows, _ in differ} <= {1, 7}  # the 20- and 64-row calls split as the 300-row call does


def test_kernel_set():
    assert EXACT.name == "exact" and EXACT.linear is linear_exact and EXACT.paged_attention is paged_attention_exact


def test_a_long_prefill_chunk_beside_a_tree(monkeypatch):
    """A masked step (a tree beside a 150-token prefill chunk, whose rows get causal mask rows) is
    right and gives the prefill rows the bits of the same chunk without a tree; the split launch,
    whose gathered tiles span at most two chunks, refuses masked chunks longer than one chunk
    (128-key chunks here: 512 on the GPU)."""
    from kernels import attention_exact

    monkeypatch.setattr(attention_exact, "CHUNK", 128)
    kvh, g, d = 1, 4, 32
    kv, q, _, other = scenario(40, kvh, g, d, torch.bfloat16, seed=6)
    q_long = torch.randn(150, kvh * g, d, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    long_kv = torch.randn(2, 150, kvh, d, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    cache = Cache([kv, long_kv], seed=4)
    tree = SeqChunk(list(range(8)), 40, cache.tables[0], positions=[40 + x for x in [0, 1, 1, 2, 2, 2, 3, 3]],
                    custom_mask=tree_mask(TREE), mask_start=40)
    prefill = SeqChunk(list(range(150)), 0, cache.tables[1])
    mixed = attend(cache, [tree, prefill], torch.cat([q, q_long]))
    alone = attend(cache, [prefill], q_long)
    assert torch.equal(mixed[8:], alone)
    meta = layout_step([tree, prefill], BLOCK, torch.device(DEVICE), REFERENCE).meta
    want = paged_attention_ref(torch.cat([q, q_long]).to(DEVICE), cache.k.nan_to_num(0.0), cache.v.nan_to_num(0.0),
                               meta, d ** -0.5)
    torch.testing.assert_close(mixed.float(), want.float(), atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="split launch"):
        attend(cache, [tree, prefill], torch.cat([q, q_long]), "split")


def test_the_launch_shape_rules(monkeypatch):
    """``auto``'s choice (speed only): few programs split; with the ``waves`` rule, a fold launch that
    would leave most of its last wave of program slots empty splits too (here, off a GPU: 8 SMs of
    ``PROGRAMS_PER_SM`` programs); one chunk, or partials over ``SPLIT_BYTES``, never split."""
    from types import SimpleNamespace

    from kernels import attention_exact as ex

    def split(num_seqs, seq_len=2000):  # decode steps: one token a sequence, one KV head of 4 query heads
        meta = SimpleNamespace(num_seqs=num_seqs, max_seq_len=seq_len)
        return ex._mode(meta, num_seqs, 4, 1, 32, 1, torch.device("cpu"), ex.CHUNK)

    monkeypatch.setattr(ex, "PROGRAMS_PER_SM", 3)  # 24 slots
    assert split(15) and not split(30) and not split(40)  # "few": under 2 programs an SM
    assert not split(15, seq_len=ex.CHUNK)  # one chunk
    monkeypatch.setattr(ex, "SPLIT_RULE", "waves")
    assert split(15) and split(30) and not split(40)  # 30 of 48 slots: 0.625; 40: 0.83
    monkeypatch.setattr(ex, "SPLIT_BYTES", 1024)
    assert not split(30)


@pytest.mark.parametrize("k, invariant", [(576, True), (1152, False)])
def test_the_row_tile_probe(k, invariant, monkeypatch, caplog):
    """``probe_row_tiles`` finds whether a layer's projections keep a row's bits across row tiles.
    Triton's interpreter rounds each dot per K step: with K under 1024 every row tile takes the same
    K step and the rows keep their bits; with K over 1024 the K step follows the row tile and they do
    not, which the probe must see (and the set then keeps its fixed tile off the GPU anyway). In
    float32, whose outputs keep the last bits a bf16 output would round away."""
    from kernels import exact_set

    monkeypatch.setattr(exact_set, "_ROW_COUNT_TILES", {})
    gen = torch.Generator().manual_seed(3)

    def w(n, kk):
        return (torch.randn(n, kk, generator=gen) * kk ** -0.5).to(DEVICE)

    norm = (1 + 0.1 * torch.randn(96, generator=gen)).to(DEVICE)
    got = exact_set.probe_row_tiles(w(96, k), w(2 * 48, 96), w(96, 48), w(80, 96), norm, 1e-5, heads=(3, 1, 16))
    if DEVICE == "cpu":
        assert got is invariant
        assert ("change a row's bits" in caplog.text) is not invariant
    else:  # (the GPU: the tensor cores accumulate in K order whatever the tiles, H200)
        assert got
    assert exact_set._ROW_COUNT_TILES == {(w(1, 1).device, torch.float32): got}


def test_the_row_tile_probe_sees_a_rope_epilogue_that_changes_bits(monkeypatch, caplog):
    """The probe with the qkv projection's RoPE epilogue (``heads``), against that kernel broken on
    purpose in calls of more than 16 rows (one element of q nudged): the verdict is no, and the set
    then runs its projections on the fixed tile. The same weights without ``heads`` pass."""
    from kernels import exact_set

    real = exact_set.scaled_qkv_rope_triton

    def nudged(x, *args, **kwargs):
        q = real(x, *args, **kwargs)
        if x.shape[0] > 16:
            q.view(-1)[3] = torch.nextafter(q.view(-1)[3], torch.tensor(1e9, device=q.device, dtype=q.dtype))
        return q

    monkeypatch.setattr(exact_set, "_ROW_COUNT_TILES", {})
    monkeypatch.setattr(exact_set, "scaled_qkv_rope_triton", nudged)
    gen = torch.Generator().manual_seed(4)

    def w(n, kk):
        return (torch.randn(n, kk, generator=gen) * kk ** -0.5).to(DEVICE)

    weights = (w(96, 96), w(2 * 48, 96), w(96, 48), w(80, 96), (1 + 0.1 * torch.randn(96, generator=gen)).to(DEVICE))
    assert exact_set.probe_row_tiles(*weights, 1e-5)
    assert not exact_set.probe_row_tiles(*weights, 1e-5, heads=(3, 1, 16))
    assert "change a row's bits" in caplog.text


def test_the_default_fold_chunk_is_chosen_by_the_kv_width(monkeypatch):
    """Unset, ``EAGLE3_EXACT_CHUNK`` means ``auto``: 128-key chunks for SmolLM2's narrow KV, 512 for the 8B's."""
    from kernels import exact_set

    if "EAGLE3_EXACT_CHUNK" in os.environ:
        pytest.skip("EAGLE3_EXACT_CHUNK is set for this run")
    assert (exact_set.fold_chunk(3, 64), exact_set.fold_chunk(8, 128)) == (128, 512)


@pytest.mark.parametrize("setting, kvh, d, want", [
    ("auto", 3, 64, 128),  # SmolLM2: 192-wide KV
    ("auto", 8, 128, 512),  # the 8B
    ("auto", 4, 64, 128),
    ("512", 3, 64, 512), ("256", 8, 128, 256), ("1024", 1, 32, 1024),
])
def test_fold_chunk_by_setting_and_geometry(setting, kvh, d, want):
    from kernels.exact_set import fold_chunk
    assert fold_chunk(kvh, d, setting) == want


@pytest.mark.parametrize("setting", ["", "fast", "100", "0", "-64", "32", str(1 << 17)])
def test_a_fold_chunk_setting_that_is_not_one_is_refused(setting):
    from kernels.exact_set import fold_chunk
    with pytest.raises(ValueError, match="EAGLE3_EXACT_CHUNK"):
        fold_chunk(8, 128, setting)


def test_a_set_with_its_own_chunk_folds_as_the_module_chunk_does(monkeypatch):
    """``select_kernels(exact=True, exact_chunk=128)``'s attention gives the bits the module's CHUNK set
    to 128 gives (the tests above check that chunk's invariance), and the default set keeps CHUNK."""
    from kernels import attention_exact
    from kernels.exact_set import EXACT
    assert select_kernels(DEVICE, "triton", exact=True) is EXACT
    custom = select_kernels(DEVICE, "triton", exact=True, exact_chunk=128)
    assert custom.name == "exact" and custom.paged_attention.keywords == {"chunk": 128}
    kv, q, _, other = scenario(382, 2, 3, 64, torch.float32, seed=5)  # (bf16 outputs round the chunks alike)
    cache = Cache([kv, other], seed=2)
    step = [SeqChunk(list(range(8)), 382, cache.tables[0], positions=[382 + x for x in (0, 1, 1, 2, 2, 2, 3, 3)],
                     custom_mask=tree_mask(TREE), mask_start=382), SeqChunk([0], 299, cache.tables[1])]
    q = torch.cat([q, torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(1))])
    meta = layout_step(step, BLOCK, torch.device(DEVICE), EXACT).meta
    got = custom.paged_attention(q.to(DEVICE), cache.k, cache.v, meta, 0.125)
    monkeypatch.setattr(attention_exact, "CHUNK", 128)
    want = paged_attention_exact(q.to(DEVICE), cache.k, cache.v, meta, 0.125)
    assert torch.equal(got, want)
    monkeypatch.setattr(attention_exact, "CHUNK", 512)
    assert not torch.equal(paged_attention_exact(q.to(DEVICE), cache.k, cache.v, meta, 0.125), want)


@pytest.mark.parametrize("g, d, dtype", [(4, 32, torch.bfloat16), (3, 64, torch.float32)])
def test_the_wide_tile_attends_as_the_reference_does(g, d, dtype):
    """``WIDE_TILE`` forced on a 600-token prompt, whole and in a ragged chunk beside a decode
    row: attention (against the reference); on a GPU where the probe says so, the narrow tile's
    bits too (in Triton's interpreter a dot's rounding depends on the tile's shape)."""
    from kernels import attention_exact

    kvh = 2
    gen = torch.Generator().manual_seed(21)
    kv = torch.randn(2, 600, kvh, d, generator=gen).to(dtype)
    other = torch.randn(2, 40, kvh, d, generator=gen).to(dtype)
    q = torch.randn(600, kvh * g, d, generator=gen).to(dtype)
    q_other = torch.randn(1, kvh * g, d, generator=gen).to(dtype)
    cache = Cache([kv, other], seed=4)
    chunks = [SeqChunk(list(range(600)), 0, cache.tables[0])]
    meta = layout_step(chunks, BLOCK, torch.device(DEVICE), EXACT).meta
    scale = d ** -0.5
    wide = paged_attention_exact(q.to(DEVICE), cache.k, cache.v, meta, scale, "fold", tile="wide")
    ref_meta = layout_step(chunks, BLOCK, torch.device(DEVICE), REFERENCE).meta
    want = paged_attention_ref(q.to(DEVICE), cache.k.nan_to_num(0.0), cache.v.nan_to_num(0.0), ref_meta, scale)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    torch.testing.assert_close(wide.float(), want.float(), atol=tol, rtol=tol)
    mixed = [SeqChunk([0], 39, cache.tables[1]), SeqChunk(list(range(130, 517)), 130, cache.tables[0])]
    meta2 = layout_step(mixed, BLOCK, torch.device(DEVICE), EXACT).meta
    part = paged_attention_exact(torch.cat([q_other, q[130:517]]).to(DEVICE), cache.k, cache.v, meta2, scale,
                                 tile="wide")[1:]
    torch.testing.assert_close(part.float(), want[130:517].float(), atol=tol, rtol=tol)
    if DEVICE == "cuda":  # (the narrow tile's bits: in Triton's interpreter they differ, so only here)
        assert attention_exact.probe_wide_tile(torch.device(DEVICE), dtype, g, d)  # (an H200 does)
        narrow = paged_attention_exact(q.to(DEVICE), cache.k, cache.v, meta, scale, "fold", tile="narrow")
        assert torch.equal(wide, narrow) and torch.equal(part, narrow[130:517])


def test_the_wide_tile_probe_sees_a_tile_that_changes_bits(monkeypatch, caplog):
    """``probe_wide_tile`` against a wide tile broken on purpose (one output element nudged), and one
    that agrees: the verdict, the warning, and what ``paged_attention_exact`` then picks."""
    from kernels import attention_exact

    real = attention_exact.paged_attention_exact

    def nudged(q, k, v, meta, scale, mode="auto", chunk=None, tile="auto"):
        out = real(q, k, v, meta, scale, mode, chunk, tile="narrow")
        if tile == "wide":
            out.view(-1)[7] = torch.nextafter(out.view(-1)[7].float(), torch.tensor(1e9, device=out.device)).to(out.dtype)
        return out

    monkeypatch.setattr(attention_exact, "_WIDE_OK", {})
    monkeypatch.setattr(attention_exact, "WIDE_PROBE_TOKENS", 80)
    monkeypatch.setattr(attention_exact, "paged_attention_exact", nudged)
    assert not attention_exact.probe_wide_tile(torch.device(DEVICE), torch.float32, 4, 32)
    assert "changes a row's bits" in caplog.text
    monkeypatch.setattr(attention_exact, "paged_attention_exact",
                        lambda q, k, v, meta, scale, mode="auto", chunk=None, tile="auto":
                        real(q, k, v, meta, scale, mode, chunk, tile="narrow"))
    assert attention_exact.probe_wide_tile(torch.device(DEVICE), torch.float32, 4, 32)
    assert attention_exact._WIDE_OK == {(torch.zeros(1, device=DEVICE).device, torch.float32, 4, 32, "wide"): True}


def test_the_tree_tile_probe_sees_a_tree_step_that_changes_bits(monkeypatch, caplog):
    """``probe_wide_tile(..., "tree")`` also attends a tree step over its prompt in the split launch on
    the wide rows and on the narrow tiles (its whole-chunk programs: ``_shared_chunks``, the selects
    left out): a tree step broken on purpose (one output element nudged) while the prompt agrees is
    caught; agreeing, the tile is taken."""
    from kernels import attention_exact

    real = attention_exact.paged_attention_exact
    calls = []

    def nudged(q, k, v, meta, scale, mode="auto", chunk=None, tile="auto"):
        calls.append((mode, tile, meta.custom_mask is not None, meta.max_query_len))
        out = real(q, k, v, meta, scale, mode, chunk, tile="narrow")
        if tile == "tree" and meta.custom_mask is not None:
            out.view(-1)[5] = torch.nextafter(out.view(-1)[5].float(), torch.tensor(1e9, device=out.device)).to(out.dtype)
        return out

    monkeypatch.setattr(attention_exact, "_WIDE_OK", {})
    monkeypatch.setattr(attention_exact, "WIDE_PROBE_TOKENS", 80)
    monkeypatch.setattr(attention_exact, "paged_attention_exact", nudged)
    assert not attention_exact.probe_wide_tile(torch.device(DEVICE), torch.float32, 4, 32, chunk=64, tile="tree")
    assert "changes a row's bits" in caplog.text
    assert ("split", "tree", True, 16) in calls and ("split", "narrow", True, 16) in calls
    calls.clear()
    monkeypatch.setattr(attention_exact, "_WIDE_OK", {})
    monkeypatch.setattr(attention_exact, "paged_attention_exact",
                        lambda q, k, v, meta, scale, mode="auto", chunk=None, tile="auto":
                        calls.append((mode, tile, meta.custom_mask is not None, meta.max_query_len)) or
                        real(q, k, v, meta, scale, mode, chunk, tile="narrow"))
    assert attention_exact.probe_wide_tile(torch.device(DEVICE), torch.float32, 4, 32, chunk=64, tile="tree")
    # agreeing, both of ``nested_tile``'s shapes were compared: one wide tile's 16 tokens and two tiles' 32
    assert {c for c in calls if c[2]} == {(m, t, True, n) for m in ("split",) for t in ("narrow", "tree")
                                          for n in (16, 32)}, calls


def test_no_wide_tile_off_the_gpu():
    """In Triton's interpreter a prefill step keeps the narrow tile, and nothing is probed."""
    from kernels import attention_exact

    if DEVICE == "cuda":
        pytest.skip("the GPU's verdict is the probe's")
    before = dict(attention_exact._WIDE_OK)
    assert not attention_exact.wide_tile_ok(torch.zeros(1, 4, 32), 4)
    assert attention_exact._WIDE_OK == before
