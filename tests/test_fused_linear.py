"""The small-step projections with a layer's norms, activation and residual adds in their epilogues
(``kernels/fused_linear_triton.py``) against their references (``kernels/fused_linear.py``) and the
separate kernels they replace.

Inputs are strided views, sizes ragged (K not a multiple of the K tile, N not of the column tile),
row counts filling one or two row tiles of each size (16, 32, 64), and every output the kernels
allocate starts as NaN (``poisoned_empty``), so an element left unwritten fails. On a CPU the
kernels run through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), whose
float32 -> bfloat16 rounding is toward zero: bfloat16 is compared within a tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kernels import REFERENCE, select_kernels  # noqa: E402
from kernels.fused_linear import linear_add_norm_ref, scaled_gate_up_silu_ref, scaled_linear_ref  # noqa: E402
from kernels.fused_linear_triton import (MAX_ROWS, WIDE_FROM_PROGRAMS, WIDE_ROW_TILE, RowLinearConfig,  # noqa: E402
                                         linear_add_norm_triton, row_linear_config, row_tile,
                                         scaled_gate_up_silu_triton, scaled_linear_triton)
from kernels.norm import rms_norm_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
ROWS = [1, 3, 16, 17, 40, 70]  # row tiles of 16, 32 and 64; 70: two of 64 (few programs: ``row_tile``)
SHAPES = [(96, 64), (80, 200)]  # (N, K)


def randn(*shape, seed, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype).to(DEVICE)


def row_view(rows, width, dtype, seed):
    """[rows, width] as columns 5 .. 5 + width of a wider buffer: strided rows."""
    return randn(rows, width + 9, seed=seed, dtype=dtype)[:, 5:5 + width]


def as_f32(*ts):
    return [None if t is None else t.float() for t in ts]


def partial_sums(h, parts):
    """sum(h^2) of each row as ``parts`` partial sums [parts, rows], as a producer's programs leave them."""
    return torch.stack([c.float().pow(2).sum(-1) for c in h.chunk(parts, dim=-1)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("scaled, with_bias", [(True, False), (False, False), (True, True)])
def test_scaled_linear_is_rms_norm_then_linear(poisoned_empty, dtype, rows, n, k, scaled, with_bias):
    """Fed h * norm_w and the partial sums of h^2, it equals F.linear(rms_norm(h), w) + b."""
    h = row_view(rows, k, dtype, seed=rows + k)
    norm_w = (1.0 + 0.1 * randn(k, seed=2)).to(dtype)
    w = randn(n, k, seed=3, dtype=dtype, scale=0.1)
    bias = randn(n, seed=4, dtype=dtype) if with_bias else None
    hn, ss = (h * norm_w, partial_sums(h, 3)) if scaled else (h, None)
    got = scaled_linear_triton(hn, ss, 1e-6, w, bias)
    assert got.shape == (rows, n) and got.dtype == dtype
    normed = rms_norm_ref(h.float(), norm_w.float(), 1e-6)[0] if scaled else h.float()
    want = F.linear(normed, w.float(), None if bias is None else bias.float())
    torch.testing.assert_close(got.float(), want, **TOL[dtype])
    torch.testing.assert_close(got.float(), scaled_linear_ref(*as_f32(hn), None if ss is None else ss, 1e-6,
                                                              *as_f32(w, bias)), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n, k", SHAPES)
def test_scaled_gate_up_silu_matches_the_reference(poisoned_empty, dtype, rows, n, k):
    h = row_view(rows, k, dtype, seed=rows * 3 + k)
    w = randn(2 * n, k, seed=5, dtype=dtype, scale=0.1)  # [gate; up]
    ss = partial_sums(h, 2)
    got = scaled_gate_up_silu_triton(h, ss, 1e-5, w)
    assert got.shape == (rows, n) and got.dtype == dtype
    torch.testing.assert_close(got.float(), scaled_gate_up_silu_ref(h.float(), ss, 1e-5, w.float()), **TOL[dtype])
    plain = scaled_gate_up_silu_triton(h, None, 1e-5, w)
    torch.testing.assert_close(plain.float(), scaled_gate_up_silu_ref(h.float(), None, 1e-5, w.float()), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n, k", SHAPES)
def test_linear_add_norm_leaves_what_the_next_projection_needs(poisoned_empty, dtype, rows, n, k):
    x = row_view(rows, k, dtype, seed=rows + 11 * k)
    w = randn(n, k, seed=6, dtype=dtype, scale=0.1)
    residual = row_view(rows, n, dtype, seed=7)
    norm_w = (1.0 + 0.1 * randn(n, seed=8)).to(dtype)
    h, hn, ss = linear_add_norm_triton(x, w, residual, norm_w)
    want_h, want_hn, want_ss = linear_add_norm_ref(*as_f32(x, w, residual, norm_w))
    assert h.shape == hn.shape == (rows, n) and h.dtype == hn.dtype == dtype and ss.dtype == torch.float32
    torch.testing.assert_close(h.float(), want_h, **TOL[dtype])
    torch.testing.assert_close(hn.float(), want_hn, **TOL[dtype])
    torch.testing.assert_close(ss.sum(0), want_ss.sum(0), **TOL[dtype])
    # the partials add up to the rows' sum of the h it wrote, whatever the split
    torch.testing.assert_close(ss.sum(0), h.float().pow(2).sum(-1), atol=1e-3, rtol=1e-5)
    part = row_linear_config(n, k).block_n  # one partial sum a few-row column tile, whatever the row tile
    assert ss.shape == (-(-n // part), rows)
    groups = torch.stack([h[:, j:j + part].float().pow(2).sum(-1) for j in range(0, n, part)])
    torch.testing.assert_close(ss, groups, atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_wide_row_tiles_chain_as_the_references_do(poisoned_empty, dtype):
    """140 rows: two programs of 128 rows (WIDE_ROW_TILE, asked for: so few columns take the 64-row
    tile by themselves) a column tile, the last one ragged, through the three epilogues a layer chains."""
    rows, n, k = 140, 96, 200
    x, residual = row_view(rows, k, dtype, seed=21), row_view(rows, n, dtype, seed=22)
    w, norm_w = randn(n, k, seed=23, dtype=dtype, scale=0.1), (1.0 + 0.1 * randn(n, seed=24)).to(dtype)
    w_next = randn(2 * 40, n, seed=25, dtype=dtype, scale=0.1)
    wide = dict(block_m=WIDE_ROW_TILE)
    h, hn, ss = linear_add_norm_triton(x, w, residual, norm_w, **wide)
    want_h, want_hn, want_ss = linear_add_norm_ref(*as_f32(x, w, residual, norm_w))
    torch.testing.assert_close(h.float(), want_h, **TOL[dtype])
    torch.testing.assert_close(ss.sum(0), want_ss.sum(0), **TOL[dtype])
    torch.testing.assert_close(scaled_gate_up_silu_triton(hn, ss, 1e-5, w_next, **wide).float(),
                               scaled_gate_up_silu_ref(*as_f32(hn), ss, 1e-5, w_next.float()), **TOL[dtype])
    torch.testing.assert_close(scaled_linear_triton(hn, ss, 1e-5, w_next, **wide).float(),
                               scaled_linear_ref(*as_f32(hn), ss, 1e-5, w_next.float()), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 17, 70])
def test_linear_add_without_a_norm_is_the_sum_alone(poisoned_empty, dtype, rows):
    x, w = row_view(rows, 200, dtype, seed=rows), randn(80, 200, seed=9, dtype=dtype, scale=0.1)
    residual = row_view(rows, 80, dtype, seed=10)
    h, hn, ss = linear_add_norm_triton(x, w, residual, None)
    assert hn is None and ss is None and h.shape == (rows, 80) and h.dtype == dtype
    torch.testing.assert_close(h.float(), linear_add_norm_ref(*as_f32(x, w, residual), None)[0], **TOL[dtype])


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_unscaled_linear_is_f_linear_over_leading_dims(poisoned_empty, rows, with_bias):
    x = randn(rows, 2, 72, seed=rows)  # leading dims fold into rows: 2 * rows of them
    w = randn(40, 72, seed=1, scale=0.1)
    bias = randn(40, seed=2) if with_bias else None
    got = scaled_linear_triton(x, None, 0.0, w, bias)
    assert got.shape == (rows, 2, 40)
    torch.testing.assert_close(got, F.linear(x, w, bias), **TOL[torch.float32])


@pytest.mark.parametrize("cfg", [RowLinearConfig(16, 32), RowLinearConfig(32, 128, 4, 3), RowLinearConfig(64, 256, 8, 2)])
def test_every_tile_matches(cfg):
    x, residual, norm_w = randn(5, 300, seed=1), randn(5, 70, seed=2), randn(70, seed=3)
    w, w_next = randn(70, 300, seed=4, scale=0.1), randn(2 * 40, 70, seed=5, scale=0.1)
    h, hn, ss = linear_add_norm_triton(x, w, residual, norm_w, config=cfg)
    want_h, want_hn, want_ss = linear_add_norm_ref(x, w, residual, norm_w)
    torch.testing.assert_close(h, want_h, **TOL[torch.float32])
    torch.testing.assert_close(hn, want_hn, **TOL[torch.float32])
    assert ss.shape[0] == -(-70 // cfg.block_n)
    torch.testing.assert_close(scaled_gate_up_silu_triton(hn, ss, 1e-5, w_next, config=cfg),
                               scaled_gate_up_silu_ref(want_hn, want_ss, 1e-5, w_next), **TOL[torch.float32])
    torch.testing.assert_close(scaled_linear_triton(hn, ss, 1e-5, w_next, config=cfg),
                               scaled_linear_ref(want_hn, want_ss, 1e-5, w_next), **TOL[torch.float32])


@pytest.mark.parametrize("n, k, tiles", [(6144, 4096, 1), (4096, 4096, 1), (14336, 4096, 2), (4096, 14336, 1),
                                         (960, 576, 1), (576, 576, 1), (1536, 576, 2), (576, 1536, 1)])
@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
@pytest.mark.parametrize("elem_bytes", [2, 4])
def test_tiles_fit_shared_memory_and_cover_the_sms(n, k, tiles, block_m, elem_bytes):
    """Llama-3-8B's and SmolLM2's projections, every row tile, bf16 and float32 (the float32 copies
    of a 64-row tile once asked for 240 KB, over an H200's 227): the copies in flight fit the
    budget, and a one-tile projection of the 8B runs one wave on the 132 SMs of an H100/H200, on
    most of them."""
    from kernels.fused_linear_triton import SHARED_BUDGET

    cfg = row_linear_config(n, k, tiles, block_m, elem_bytes)
    assert cfg.num_stages >= 2
    assert cfg.num_stages * (block_m + tiles * cfg.block_n) * cfg.block_k * elem_bytes <= SHARED_BUDGET
    if elem_bytes == 2 and block_m < 64:  # bf16's tiles as the sweep chose them
        assert cfg == row_linear_config(n, k, tiles, block_m)
    if k >= 4096 and tiles == 1 and block_m < 128:
        assert 88 <= -(-n // cfg.block_n) <= 132
    if block_m == 128:  # partial sums of h^2 over the few-row tile's columns
        assert cfg.block_n % cfg.partial_columns == 0
        assert cfg.partial_columns == row_linear_config(n, k, tiles, 16, elem_bytes).block_n


@pytest.mark.parametrize("n, k, tiles", [(14336, 4096, 2), (128256, 4096, 1), (49152, 576, 1)])
@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_projections_of_more_than_a_wave_take_short_k_steps(n, k, tiles, block_m):
    """The 8B's gate_up and LM heads: column tiles that take more than a wave even at their widest
    get 64 columns and 128-long K steps (copies small enough for several programs an SM)."""
    from kernels.fused_linear_triton import ONE_WAVE

    assert -(-n // (32 if tiles == 2 else 64)) > ONE_WAVE
    cfg = row_linear_config(n, k, tiles, block_m)
    assert (cfg.block_n, cfg.block_k) == (64, 128)


@pytest.mark.parametrize("rows", [1, 17])
def test_a_gate_up_of_more_than_a_wave_matches_the_reference(poisoned_empty, rows):
    """Just over a wave of 32-column tiles (133 of them), on the multi-wave tile."""
    n, k = 133 * 32, 64
    assert row_linear_config(n, k, 2).block_n == 64
    h = row_view(rows, k, torch.float32, seed=rows)
    w = randn(2 * n, k, seed=6, scale=0.1)
    ss = partial_sums(h, 2)
    got = scaled_gate_up_silu_triton(h, ss, 1e-5, w)
    torch.testing.assert_close(got, scaled_gate_up_silu_ref(h, ss, 1e-5, w), **TOL[torch.float32])


def test_no_rows():
    w = torch.randn(8, 16, device=DEVICE)
    assert scaled_linear_triton(torch.empty(0, 16, device=DEVICE), None, 1e-6, w).shape == (0, 8)
    assert scaled_gate_up_silu_triton(torch.empty(0, 16, device=DEVICE), None, 1e-6, w).shape == (0, 4)
    h, hn, ss = linear_add_norm_triton(torch.empty(0, 16, device=DEVICE), w, torch.empty(0, 8, device=DEVICE),
                                       torch.ones(8, device=DEVICE))
    assert h.shape == hn.shape == (0, 8)


def test_the_sets_pick_their_fused_entries(monkeypatch):
    triton_set = select_kernels(DEVICE, "triton")
    assert triton_set.scaled_linear is scaled_linear_triton and triton_set.linear_add_norm is linear_add_norm_triton
    assert triton_set.fused_rows(4096) == MAX_ROWS and triton_set.fused_rows(576) == 64
    assert REFERENCE.fused_rows(576) == 0 and REFERENCE.scaled_linear is scaled_linear_ref
    # The batch-invariant set takes the fused path in every step, with the sums of h^2 in fixed
    # point: a decoded row then rounds as the same row inside a tree or a prefill chunk. Off the GPU
    # (the interpreter), on one fixed row tile.
    if DEVICE == "cpu":  # (set on a GPU, it would make every kernel first imported now interpreted)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    exact = select_kernels(DEVICE, "triton", exact=True)
    assert exact.fused_rows(4096) >= 1 << 30 and exact.scaled_linear.__wrapped__ is scaled_linear_triton


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3"])
def test_a_decode_step_through_the_fused_layers_matches_the_references(tmp_path, family):
    """The target's few-row path (every norm but the first and last in a projection's epilogue; RoPE
    and the KV write in the q/k/v projection's, except under Qwen3's per-head q/k norms) gives the
    logits, the captured layer inputs and the KV cache of the separate reference kernels."""
    import dataclasses

    from runtime.step_layout import SeqChunk, layout_step
    from tiny_models import TRITON_DEVICE, make_model_dir, target_for

    target = target_for(make_model_dir(tmp_path / "m", family, seed=3, std=0.3), kernels="triton",
                        max_model_len=64, device=TRITON_DEVICE, enforce_eager=True)
    prompts = [list(range(3, 20)), list(range(40, 45)), list(range(7, 16))]
    for sid, p in enumerate(prompts):  # prefilled through the separate kernels (more than MAX_ROWS rows or not)
        target.blocks.ensure_capacity(sid, len(p) + 4)
        target.runner.step([SeqChunk(p, 0, target.blocks.block_table(sid), logits_rows=(len(p) - 1,))])
    chunks = [SeqChunk([5 + sid], len(p), target.blocks.block_table(sid), logits_rows=(0,))
              for sid, p in enumerate(prompts)]
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return target.runner.kernels.linear_add_norm(*args, **kwargs)

    rope_calls = []

    def counted_rope(*args, **kwargs):
        rope_calls.append(1)
        return target.runner.kernels.scaled_qkv_rope(*args, **kwargs)

    fused = dataclasses.replace(target.runner.kernels, linear_add_norm=counted, scaled_qkv_rope=counted_rope)
    layers = target.model_config.num_layers
    capture = (0, layers // 2, layers - 1)
    saved = target.kv_cache.data.clone()
    outs = {}
    with torch.inference_mode():
        for name, kernels in (("fused", fused), ("reference", REFERENCE)):
            target.kv_cache.data.copy_(saved)
            step = layout_step(chunks, target.kv_cache.block_size, target.device, kernels)
            out = target.model(step.input_ids, step.meta, target.kv_cache, kernels, capture)
            outs[name] = (target.model.compute_logits(out.hidden), out.captured, target.kv_cache.data.clone())
    assert len(calls) == 2 * layers - 1  # o_proj in every layer, down in all but the last
    # q/k/v projected, rotated and written to the cache in one kernel a layer (Qwen3: its q/k norms between)
    assert len(rope_calls) == (0 if family == "qwen3" else layers)
    torch.testing.assert_close(outs["fused"][0], outs["reference"][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs["fused"][1], outs["reference"][1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs["fused"][2], outs["reference"][2], atol=1e-4, rtol=1e-4, equal_nan=True)
    assert torch.isfinite(outs["fused"][0]).all()


def test_stage_cap_leaves_tiles_and_bits_alone(monkeypatch):
    """EAGLE3_ROW_LINEAR_STAGES (an experiment: shared memory left for a resident dependent
    program) caps the stages of copies only: the column and K tiles, and so every result's bits,
    stay those of the default."""
    import kernels.fused_linear_triton as flt

    for n, k, tiles in [(6144, 4096, 1), (14336, 4096, 2), (4096, 14336, 1), (960, 576, 1)]:
        full = flt.row_linear_config(n, k, tiles)
        monkeypatch.setattr(flt, "MAX_STAGES", 2)
        capped = flt.row_linear_config(n, k, tiles)
        monkeypatch.undo()
        assert (capped.block_n, capped.block_k) == (full.block_n, full.block_k)
        assert capped.num_stages == 2 < full.num_stages


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 17, 70])
def test_exact_sums_match_the_references_in_any_order(poisoned_empty, dtype, rows):
    """``exact_sums`` (the batch-invariant set's): the row scale from the partial sums of h^2 in
    fixed point. Right against the references, and the same bits with the partials in another
    order (a plain sum's bits follow its order, and its order the tile's layout)."""
    n, k = 80, 200
    h = row_view(rows, k, dtype, seed=rows + 1)
    norm_w = (1.0 + 0.1 * randn(k, seed=2)).to(dtype)
    w = randn(2 * n, k, seed=3, dtype=dtype, scale=0.1)
    hn, ss = h * norm_w, partial_sums(h, 7) * torch.logspace(0, 6, 7, device=DEVICE)[:, None]  # far-apart terms
    order = torch.randperm(7, generator=torch.Generator().manual_seed(rows))
    got = scaled_linear_triton(hn, ss, 1e-6, w, exact_sums=True)
    torch.testing.assert_close(got.float(), scaled_linear_ref(hn.float(), ss, 1e-6, w.float()), **TOL[dtype])
    assert torch.equal(scaled_linear_triton(hn, ss[order], 1e-6, w, exact_sums=True), got)
    act = scaled_gate_up_silu_triton(hn, ss, 1e-6, w, exact_sums=True)
    torch.testing.assert_close(act.float(), scaled_gate_up_silu_ref(hn.float(), ss, 1e-6, w.float()), **TOL[dtype])
    assert torch.equal(scaled_gate_up_silu_triton(hn, ss[order], 1e-6, w, exact_sums=True), act)

    x = torch.zeros(rows, 16, dtype=dtype, device=DEVICE)  # one input column: each h is one product, exact
    x[:, 0] = randn(rows, seed=4, dtype=dtype)
    w1, res, nw = randn(n, 16, seed=5, dtype=dtype), randn(rows, n, seed=6, dtype=dtype), randn(n, seed=7, dtype=dtype)
    h1, hn1, ss1 = linear_add_norm_triton(x, w1, res, nw, exact_sums=True)
    torch.testing.assert_close(ss1.sum(0), h1.float().pow(2).sum(-1), atol=1e-3, rtol=1e-5)
    tile = row_linear_config(n, 16).block_n
    cols = torch.cat([torch.arange(tile).flip(0), torch.arange(tile, n)]).to(DEVICE)  # the first tile reversed
    h2, _, ss2 = linear_add_norm_triton(x, w1[cols], res[:, cols], nw[cols], exact_sums=True)
    assert torch.equal(h2, h1[:, cols]) and torch.equal(ss2, ss1)


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # (the interpreter's NaN casts)
def test_exact_sums_pass_nan_through(poisoned_empty):
    h = row_view(3, 64, torch.float32, seed=1)
    ss = partial_sums(h, 4)
    ss[2, 1] = float("nan")
    out = scaled_linear_triton(h, ss, 1e-6, randn(32, 64, seed=2), exact_sums=True)
    assert out[1].isnan().all() and not out[[0, 2]].isnan().any()


@pytest.mark.parametrize("kind", ["add_norm", "gate_up", "scaled"])
def test_grouped_program_order_gives_the_same_bits(poisoned_empty, kind):
    """``group_m``: the 128-row tile's programs ordered in groups of row tiles a column tile (one
    launch axis; the last group short) compute every tile as the 2-D grid does, bit for bit."""
    import dataclasses

    rows, n, k = 300, 96, 200  # three row tiles of 128: groups of two, the second of one
    x, residual = row_view(rows, k, torch.bfloat16, seed=31), row_view(rows, n, torch.bfloat16, seed=32)
    w = randn(n, k, seed=33, dtype=torch.bfloat16, scale=0.1)
    norm_w = (1.0 + 0.1 * randn(n, seed=34)).to(torch.bfloat16)
    ss = torch.rand(7, rows, generator=torch.Generator().manual_seed(35)).to(DEVICE)
    tiles = 2 if kind == "gate_up" else 1
    plain = row_linear_config(n // tiles, k, tiles, 128)
    grouped = dataclasses.replace(plain, group_m=2)

    def run(cfg):
        if kind == "add_norm":
            return linear_add_norm_triton(x, w, residual, norm_w, config=cfg, exact_sums=True)
        if kind == "gate_up":
            return (scaled_gate_up_silu_triton(x, ss, 1e-5, w, config=cfg, exact_sums=True),)
        return (scaled_linear_triton(x, ss, 1e-5, w, config=cfg, exact_sums=True),)

    for got, want in zip(run(grouped), run(plain)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("rows, n, k, tiles, want", [
    (20, 576, 576, 1, 32),
    (128, 576, 576, 1, 64),      # SmolLM2's o_proj: 36 column tiles of 16, two row tiles
    (256, 1536, 576, 2, 64),     # its gate and up: 48 x 4 programs
    (960, 576, 576, 1, 128),     # 36 x 15 programs of 64 rows: more than WIDE_FROM_PROGRAMS
    (128, 4096, 14336, 1, 64),   # the 8B's down: 128 x 2
    (256, 4096, 4096, 1, 128),   # its o_proj: 128 x 4
    (128, 14336, 4096, 2, 128),  # its gate and up: 224 column tiles of 64 x 2
])
def test_above_64_rows_the_wide_tile_only_where_the_64_row_tile_launches_many_programs(rows, n, k, tiles, want):
    assert row_tile(rows, n, k, tiles) == want
    if rows > 64:
        few = row_linear_config(n, k, tiles, 64)
        assert (-(-n // few.block_n) * -(-rows // 64) > WIDE_FROM_PROGRAMS) == (want == WIDE_ROW_TILE)
    assert row_tile(rows) == (want if rows <= 64 else WIDE_ROW_TILE)  # (no shape: the 128-row tile)


def test_wide_tiles_partial_sums_cover_ragged_column_groups(poisoned_empty):
    """200 float32 columns on the 128-row tile's 64-column tiles: the fourth tile's last column groups
    lie past N and are not written (the partials' buffer holds 13 groups of 16, the few-row tile's),
    the rest are the groups' sums of h^2."""
    rows, n, k = 70, 200, 64
    x, residual = row_view(rows, k, torch.float32, seed=41), row_view(rows, n, torch.float32, seed=42)
    w, norm_w = randn(n, k, seed=43, scale=0.1), 1.0 + 0.1 * randn(n, seed=44)
    h, hn, ss = linear_add_norm_triton(x, w, residual, norm_w, block_m=WIDE_ROW_TILE)
    part = row_linear_config(n, k).block_n
    assert row_linear_config(n, k, 1, 128, 4).block_n == 64 and ss.shape == (-(-n // part), rows)
    groups = torch.stack([h[:, j:j + part].pow(2).sum(-1) for j in range(0, n, part)])
    torch.testing.assert_close(ss, groups, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 17])
@pytest.mark.parametrize("heads, kv_heads, head_dim, with_bias",
                         [(4, 2, 32, False), (3, 1, 64, True), (2, 2, 16, False)])
def test_qkv_projection_with_rope_and_kv_write_in_its_epilogue(poisoned_empty, dtype, rows, heads, kv_heads,
                                                               head_dim, with_bias):
    """``scaled_qkv_rope_triton``: rotated q, and k and v in the cache slots (a negative slot: none
    written), what ``scaled_linear_triton`` then ``rope_write_kv_triton`` give (bit for bit through
    the interpreter and in bfloat16; in float32 on an H200 the compiler contracts the rotation's
    multiply-adds differently in the two kernels: within a few ulp), and the reference's within
    rounding; cache entries of other slots stay as they were."""
    from kernels.fused_linear import scaled_qkv_rope_ref
    from kernels.fused_linear_triton import scaled_qkv_rope_triton
    from kernels.fused_triton import rope_write_kv_triton
    from common.config import RopeScaling
    from runtime.rope import rope_tables

    k_in = 96
    n = (heads + 2 * kv_heads) * head_dim
    h = row_view(rows, k_in, dtype, seed=rows)
    w = randn(n, k_in, seed=3, dtype=dtype, scale=0.1)
    bias = randn(n, seed=4, dtype=dtype) if with_bias else None
    ss = partial_sums(h, 3)
    cos, sin = rope_tables(head_dim, 10000.0, RopeScaling(), 64, torch.device(DEVICE))
    positions = torch.randint(0, 64, (rows,), generator=torch.Generator().manual_seed(rows)).to(DEVICE)
    block = 4
    slots = torch.randperm(6 * block, generator=torch.Generator().manual_seed(7))[:rows].to(DEVICE)
    slots[::3] = -1  # padding rows
    caches = [torch.full((6, block, kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE) for _ in range(4)]

    got_q = scaled_qkv_rope_triton(h, ss, 1e-5, w, bias, positions, cos, sin, caches[0], caches[1], slots,
                                   heads, kv_heads, head_dim)
    qkv = scaled_linear_triton(h, ss, 1e-5, w, bias)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    want_q = rope_write_kv_triton(q.view(rows, heads, head_dim), k.view(rows, kv_heads, head_dim),
                                  v.view(rows, kv_heads, head_dim), positions, cos, sin, caches[2], caches[3], slots)
    assert got_q.shape == (rows, heads, head_dim) and got_q.is_contiguous()
    same = dict(atol=0.0, rtol=0.0) if DEVICE == "cpu" or dtype == torch.bfloat16 else dict(atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_q, want_q, **same)
    for got, want in zip(caches[:2], caches[2:]):
        torch.testing.assert_close(got, want, equal_nan=True, **same)
    written = slots[slots >= 0]
    assert not caches[0].view(-1, kv_heads, head_dim)[written].isnan().any()
    assert int((~caches[0].isnan()).any(-1).any(-1).sum()) == len(written)  # no slot but these

    ref = [torch.full_like(caches[0], float("nan"), dtype=torch.float32) for _ in range(2)]
    ref_q = scaled_qkv_rope_ref(*as_f32(h, ss), 1e-5, *as_f32(w, bias), positions, cos, sin, *ref, slots,
                                heads, kv_heads, head_dim)
    torch.testing.assert_close(got_q.float(), ref_q, **TOL[dtype])
    for got, want in zip(caches[:2], ref):
        torch.testing.assert_close(got.float(), want, equal_nan=True, **TOL[dtype])
