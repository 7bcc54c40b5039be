"""Few-row projections in one Triton kernel each, with the elementwise work around them in their
epilogues: the same signatures and semantics as ``kernels/fused_linear.py``.

A decode step has one row a sequence, so a projection is a stream of its weight: one program owns
BLOCK_N output columns of BLOCK_M rows (16, 32 or 64, from the row count; above 64 rows, 128 on a
wider column tile where the 64-row tile would launch many programs: the batch-invariant set's
prefill chunks and batches of trees; ``row_tile``) and walks K in BLOCK_K steps, in
order, accumulating in float32 (no split-K, so no second reduction kernel)::

    grid = (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M))      program -> (column tile, row tile)

(or, with ``group_m``, one axis whose programs take ``group_m`` row tiles a column tile in turn).

Every program reads its rows' whole input, so the engine takes this path while a step's input is
small (``fused_rows``: 16 rows of a 4096-wide model, 32 of SmolLM2's 576) and the separate kernels
(cuBLAS) above.

The main loop only loads and multiplies (elementwise work on a dot operand would run once per
warp on the whole padded row tile). Around it:

    SCALED:    the row's partial sums of h^2 [P, M] are summed in order and the accumulator is
               scaled by rsqrt(sum / K + eps): the RMSNorm of the input, folded out of the matmul.
    SILU_MUL:  the program streams the gate rows and the up rows of its columns (two
               accumulators) and writes silu(gate) * up, each rounded as the references round.
    ADD_NORM:  h = out + residual is written, and hn = h * norm_w, and the partial sums of h^2
               over each PART_N columns to ss[column group, row]: the next projection's SCALED
               input. PART_N is the few-row column tile, whatever tile the program has, so the
               partials are the same sums in a 128-row step as in a 1-row one.
    ADD:       h = out + residual alone.
    ROPE_KV:   the fused [q; k; v] projection (``scaled_qkv_rope``): each program of the q and k
               columns owns pairs of columns (i, i + d/2) of one head, BLOCK_N / 2 of each, so its
               epilogue rotates them (RoPE, from the output rounded as the projection's), writes q
               to a contiguous [rows, heads * d] output and k into the paged cache; the v columns'
               programs write v into the cache. No separate RoPE and KV-write launch.

"""

from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

from kernels.fused_linear import rope_epilogue_fits
from kernels.pdl import PDL_EARLY, dependent, launch_options

MAX_ROWS = 16  # tl.dot's smallest row tile: fused_rows' floor
ROW_ELEMENTS = 65536  # fused_rows: the input elements of a step that takes the fused path
# The most rows of a step on the fused path (EAGLE3_MAX_FUSED_ROWS, 64 by default: SmolLM2's 60-node
# tree steps and its batch-64 decode take it; a 4096-wide model stops at 16 rows, ROW_ELEMENTS).
# Measured on an H200 with every kernel dependent, 64 against 32: a 64-token SmolLM2 verify step at
# 512 keys 1.111 against 1.274 ms, a batch-64 decode step 1.142 against 1.336 ms, a batch-1 chained
# tree step 1.48 against 1.68 ms (2433078, before the dependent launches, had read 1.338 against
# 1.289 for the verify step). Speed only on the fast path, whose bits already depend on the step;
# the batch-invariant set takes every step fused.
MAX_FUSED_ROWS = int(os.environ.get("EAGLE3_MAX_FUSED_ROWS", "64"))
assert MAX_FUSED_ROWS in (16, 32, 64), "EAGLE3_MAX_FUSED_ROWS: 16, 32 or 64"
SHARED_BUDGET = 200 * 1024  # bytes of a program's pipelined copies (an H100/H200 SM has 227 KB)

EPILOGUE_NONE, EPILOGUE_SILU_MUL, EPILOGUE_ADD_NORM, EPILOGUE_ADD, EPILOGUE_ROPE_KV = 0, 1, 2, 3, 4

# The projections launch dependent on the kernel before (``kernels/pdl.py``): the launch and the
# programs' start overlap that kernel's end, and each program waits for its outputs before reading
# any input. (Reading the first weight tile before the wait measured slower: the tile held in
# registers spilled.) Two switches (speed only: neither changes a result's bits; H200, 4aaa390,
# benchmarks/results/pdl_ab2_h200_4aaa390.json):
# - EAGLE3_L2_PREFETCH=N (1 by default; 0 off): before the wait, each program asks L2 for the
#   first N K steps of its weight rows (prefetch.global.L2, one address a 128-byte line: no
#   registers held, unlike the measured early read), so the weight stream starts warm while the
#   kernel before ends. With every kernel dependent, 8B batch-1 step at 4K: none 4.568, 2 steps
#   4.530, 8 steps 4.935 ms (pdl_ab2_h200_4aaa390.json); then 1 step 4.515 against 2 steps 4.556
#   ms at 4K and 5.517 against 5.545 at 32K, alternated (prefetch_ab_h200_52a76bf*.json);
# - EAGLE3_ROW_LINEAR_STAGES caps the stages of copies (4), leaving shared memory for a resident
#   dependent program (with EAGLE3_PDL_EARLY). 3 stages measured slower (8B 4.678 ms).
L2_PREFETCH_STEPS = int(os.environ.get("EAGLE3_L2_PREFETCH", "1"))
MAX_STAGES = int(os.environ.get("EAGLE3_ROW_LINEAR_STAGES", "4"))
assert L2_PREFETCH_STEPS in (0, 1, 2, 4, 8), "EAGLE3_L2_PREFETCH: 0, 1, 2, 4 or 8 K steps"
assert MAX_STAGES >= 2, "EAGLE3_ROW_LINEAR_STAGES: at least 2"


@dataclasses.dataclass(frozen=True, slots=True)
class RowLinearConfig:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4
    part_n: int | None = None  # columns a partial sum of h^2 (ADD_NORM) covers; None: block_n
    group_m: int = 1  # > 1: programs ordered in groups of this many row tiles a column tile (L2 reuse)

    @property
    def partial_columns(self) -> int:
        return self.part_n or self.block_n


def fused_rows(hidden: int) -> int:
    """The most rows of a ``hidden``-wide model a step sends through these kernels: 16 for a
    4096-wide model, 64 for SmolLM2 (576; ``MAX_FUSED_ROWS`` says what was measured)."""
    return max(MAX_ROWS, min(MAX_FUSED_ROWS, ROW_ELEMENTS // hidden))


def row_tile(rows: int, n: int | None = None, k: int | None = None, weight_tiles: int = 1,
             elem_bytes: int = 2) -> int:
    """The row tile a call of ``rows`` rows takes: 16, 32 or 64 rows up to 64; above, the 128-row
    tile (``WIDE_ROW_TILE``) where the 64-row tile's programs for the projection (``n`` columns of
    ``k``, ``weight_tiles`` weight tiles a K step) would be more than ``WIDE_FROM_PROGRAMS``, else
    the 64-row tile (without a shape: the 128-row tile). A function of the shapes alone."""
    if rows <= 64:
        return 16 if rows <= 16 else 32 if rows <= 32 else 64
    if n is None or k is None:
        return WIDE_ROW_TILE
    few = row_linear_config(n, k, weight_tiles, 64, elem_bytes)
    return 64 if triton.cdiv(n, few.block_n) * triton.cdiv(rows, 64) <= WIDE_FROM_PROGRAMS else WIDE_ROW_TILE


# Above 64 rows (the batch-invariant set's prefill chunks and long trees; the fast path sends such
# steps to cuBLAS) a program owns 128 rows of a wider column tile: the 64-row tile read each
# weight tile for 64 rows only and ran the 8B's 4K-token prefill 3.6x slower than cuBLAS (H200,
# eaa4349, ``profile_step.py llama3-8b --batch 4 --context 4096 --prefill --exact``:
# 827 against 230 ms for three steps). A row's products still accumulate in K order, and the
# partial sums of h^2 keep the few-row column groups (``part_n``).
WIDE_ROW_TILE = 128
# ... but only where the 64-row tile would launch more programs than this: with fewer, the 128-row
# tile's wide column tiles leave most SMs idle (SmolLM2's o_proj at 128 rows: 5 programs, 9.3 us
# against 3.5 on 72 programs of the 64-row tile; a whole SmolLM2 layer at 256 rows, a batch of 16
# trees of 16 nodes, 45.4 against 29.6 us; the 8B's o_proj and down at 128 rows 33.6 / 112.7 against
# 24.1 / 69.0 us). Above it the 128-row tile wins (the 8B's o_proj at 256 rows, 512 programs of 64
# rows: 34.2 against 45.9 us). H200, ``benchmarks/fused_linear.py --rows 128 ... --rows 2048``: the
# rule picks the faster tile, or one within 2%, in all 22 (projection, rows) cases measured.
# ``EAGLE3_WIDE_FROM_PROGRAMS=0``: the 128-row tile for every call of more than 64 rows (as before).
WIDE_FROM_PROGRAMS = int(os.environ.get("EAGLE3_WIDE_FROM_PROGRAMS", "320"))


# The batch-invariant set (kernels/exact_set.py) runs every step through these kernels with one
# row tile: a row's sums then run in one order whatever the step (the tiles depend on the shapes
# alone), and the row's scale is applied the same way in a decode step as in a tree or a prefill.
EXACT_ROW_TILE = 64


# Column tiles of one wave: the SMs of an H100 / H200 (the tiles are a function of the shapes alone).
ONE_WAVE = 132


def every_step(hidden: int) -> int:
    """The batch-invariant set's ``fused_rows``: every step takes the fused projections."""
    return 1 << 62


def row_linear_config(n: int, k: int, weight_tiles: int = 1, block_m: int = 16, elem_bytes: int = 2) -> RowLinearConfig:
    """Tiles from the sweep of ``benchmarks/fused_linear.py`` on an H200 (one row, cold weights):
    the narrowest column tile (16, 32, 64; 32 with gate and up, two weight tiles a step) whose
    programs fit one wave of 132 SMs (qkv of Llama-3-8B: 64 columns, 96 programs; o_proj and down:
    32, 128), with K steps of 512 weight-tile bytes a row over the column tile (256 for 64-row
    tiles), 128 for a short K. A projection whose column tiles take more than a wave even so (the
    8B's gate and up: 448 programs of 32; LM heads) takes 64 columns and K steps of 128: a
    program's copies then leave room for more than one program an SM, so the last wave's tail is
    short (8B gate_up at one row 58.8 against 63.0 us, at 64 rows 65.8 against 83.9, floor 54.9;
    ``benchmarks/results/fused_linear/sweep_h200_2b50a5b/``). As many stages of copies as fit
    ``SHARED_BUDGET``, at most ``MAX_STAGES``, at least two (a shorter K step where two stages of
    ``elem_bytes`` elements would not fit: float32). A function of the shapes, the row tile and the
    element size alone: the batch-invariant set relies on it.
    The 128-row tile (``WIDE_ROW_TILE``) takes 128 columns (64 with gate and up; fewer where two
    stages of float32 copies would not fit), K steps of 64 (128 for a short K, as the few-row
    tiles take) and eight warps, its partial sums of h^2 over the few-row tile's columns."""
    if block_m >= WIDE_ROW_TILE:
        part_n = row_linear_config(n, k, weight_tiles, 64, elem_bytes).block_n
        block_n, block_k = 128 // weight_tiles, 128 if k < 1024 else 64

        def stage() -> int:
            return (block_m + weight_tiles * block_n) * block_k * elem_bytes

        while 2 * stage() > SHARED_BUDGET and block_n > part_n:
            block_n //= 2
        while 2 * stage() > SHARED_BUDGET:
            block_k //= 2
        return RowLinearConfig(block_n, block_k, num_warps=8, num_stages=max(2, min(4, SHARED_BUDGET // stage())),
                               part_n=part_n)
    widths = (32,) if weight_tiles == 2 else (16, 32, 64)
    block_n = next((b for b in widths if triton.cdiv(n, b) <= ONE_WAVE), None)
    if block_n is None:  # more column tiles than a wave
        block_n, block_k = 64, 128
    else:
        block_k = 128 if k < 1024 else min(512, 16384 // (block_n * weight_tiles), 16384 // block_m)
    while 2 * (stage_bytes := (block_m + weight_tiles * block_n) * block_k * elem_bytes) > SHARED_BUDGET:
        block_k //= 2
    return RowLinearConfig(block_n, block_k, num_stages=max(2, min(MAX_STAGES, SHARED_BUDGET // stage_bytes)))


def scaled_linear_triton(x: torch.Tensor, ss: torch.Tensor | None, eps: float, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, config: RowLinearConfig | None = None,
                         block_m: int | None = None, exact_sums: bool = False) -> torch.Tensor:
    return _launch(EPILOGUE_NONE, x, weight, bias=bias, ss=ss, eps=eps, config=config, block_m=block_m,
                   exact_sums=exact_sums)[0]


def scaled_gate_up_silu_triton(x: torch.Tensor, ss: torch.Tensor | None, eps: float, weight: torch.Tensor,
                               config: RowLinearConfig | None = None, block_m: int | None = None,
                               exact_sums: bool = False) -> torch.Tensor:
    return _launch(EPILOGUE_SILU_MUL, x, weight, ss=ss, eps=eps, config=config, block_m=block_m,
                   exact_sums=exact_sums)[0]


def scaled_qkv_rope_triton(x: torch.Tensor, ss: torch.Tensor | None, eps: float, weight: torch.Tensor,
                           bias: torch.Tensor | None, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           heads: int, kv_heads: int, head_dim: int, config: RowLinearConfig | None = None,
                           block_m: int | None = None, exact_sums: bool = False) -> torch.Tensor:
    """``scaled_qkv_rope_ref`` in one kernel (``ROPE_KV`` above): rotated q [rows, heads, head_dim],
    k and v in the cache. ``head_dim`` a multiple of 16 (``rope_epilogue_fits``). ``block_m`` and
    ``exact_sums``: as ``_launch``'s (the batch-invariant set's)."""
    assert rope_epilogue_fits(head_dim), f"head_dim {head_dim}: RoPE in the epilogue needs a multiple of 16"
    assert positions.is_contiguous() and slot_mapping.is_contiguous(), "positions and slots: contiguous [rows]"
    assert weight.shape[0] == (heads + 2 * kv_heads) * head_dim, "a fused [q; k; v] weight"
    rope = (positions, cos, sin, k_cache, v_cache, slot_mapping, heads, kv_heads, head_dim)
    q = _launch(EPILOGUE_ROPE_KV, x, weight, bias=bias, ss=ss, eps=eps, config=config, block_m=block_m,
                exact_sums=exact_sums, rope=rope)[0]
    return q.view(-1, heads, head_dim)


def linear_add_norm_triton(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                           norm_weight: torch.Tensor | None, config: RowLinearConfig | None = None,
                           block_m: int | None = None, exact_sums: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    if norm_weight is None:
        return _launch(EPILOGUE_ADD, x, weight, residual=residual, config=config, block_m=block_m)[0], None, None
    return _launch(EPILOGUE_ADD_NORM, x, weight, residual=residual, norm_weight=norm_weight, config=config,
                   block_m=block_m, exact_sums=exact_sums)


def _contiguous_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    t2 = t.reshape(-1, width)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(epilogue: int, x: torch.Tensor, weight: torch.Tensor, *, bias=None, ss=None, eps: float = 0.0,
            residual=None, norm_weight=None, config: RowLinearConfig | None = None, block_m: int | None = None,
            exact_sums: bool = False, rope: tuple | None = None):
    """(out, h, ss_out); h and ss_out only for ADD_NORM (out is then hn). ``block_m``: the row tile
    whatever the row count (the batch-invariant set's), else chosen from it. ``exact_sums``: the
    sums of h^2 (a program's columns, the row's partials) in fixed point, the same bits whatever
    the order and the tile (``_order_free_sum``). ``rope``: ROPE_KV's (positions, cos, sin, k_cache,
    v_cache, slot_mapping, heads, kv_heads, head_dim); out is then q alone, [rows, heads * head_dim]."""
    K = weight.shape[1]
    N = weight.shape[0] // 2 if epilogue == EPILOGUE_SILU_MUL else weight.shape[0]
    assert x.shape[-1] == K, f"input of width {x.shape[-1]} for a weight {tuple(weight.shape)}"
    x2 = _contiguous_rows(x, K)
    M = x2.shape[0]
    block_m = block_m or row_tile(M, N, K, 2 if epilogue == EPILOGUE_SILU_MUL else 1, x.element_size())
    cfg = config or row_linear_config(N, K, 2 if epilogue == EPILOGUE_SILU_MUL else 1, block_m, x.element_size())
    if rope is not None:  # a column tile within one head (tiles then never straddle q, k and v)
        head_dim = rope[8]
        while head_dim % cfg.block_n:
            cfg = dataclasses.replace(cfg, block_n=cfg.block_n // 2)
    grid = triton.cdiv(N, cfg.block_n)
    out = torch.empty(M, N if rope is None else rope[6] * rope[8], dtype=x.dtype, device=x.device)
    add_norm = epilogue == EPILOGUE_ADD_NORM
    r2 = _contiguous_rows(residual, N) if residual is not None else out  # (out: never read)
    part_n = cfg.partial_columns
    assert cfg.block_n % part_n == 0, f"a column tile of {cfg.block_n} in partial sums of {part_n} columns"
    if add_norm:
        h = torch.empty(M, N, dtype=x.dtype, device=x.device)
        ss_out = torch.empty(triton.cdiv(N, part_n), M, dtype=torch.float32, device=x.device)
    else:
        h = ss_out = out  # never written by the kernel
    if M == 0 or N == 0:
        return out.reshape(*x.shape[:-1], out.shape[1]), h, ss_out
    scaled = ss is not None
    fp32 = x.dtype == torch.float32
    pdl = dependent(x)
    block_p = triton.next_power_of_2(ss.shape[0]) if scaled else 1  # the partial sums' tile
    m_tiles = triton.cdiv(M, block_m)
    if rope is not None:
        positions, cos, sin, k_cache, v_cache, slots, heads, kv_heads, head_dim = rope
        rope_args = (positions, cos, sin, slots, k_cache, v_cache, cos.stride(0), sin.stride(0), *k_cache.stride()[:3],
                     *v_cache.stride()[:3], k_cache.shape[1])
        rope_constants = dict(HEAD_DIM=head_dim, Q_TILES=heads * head_dim // cfg.block_n,
                              ROT_TILES=(heads + kv_heads) * head_dim // cfg.block_n, UNFUSED=x.is_cuda)
    else:
        rope_args = (out, out, out, out, out, out, 0, 0, 0, 0, 0, 0, 0, 0, 1)  # (never read)
        rope_constants = dict(HEAD_DIM=16, Q_TILES=0, ROT_TILES=0, UNFUSED=False)
    _row_linear_kernel[(grid * m_tiles, 1) if cfg.group_m > 1 else (grid, m_tiles)](
        x2, weight, out, bias if bias is not None else weight, ss if scaled else out, r2,
        norm_weight if add_norm else weight, h, ss_out, *rope_args, M, N, K, x2.stride(0), weight.stride(0),
        r2.stride(0), eps, ss.shape[0] if scaled else 1, **rope_constants,
        SCALED=scaled, EPILOGUE=epilogue, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, BLOCK_P=block_p, PRECISION="ieee" if fp32 else "tf32",
        DOT_DTYPE=tl.float32 if fp32 or not x.is_cuda else {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[x.dtype],
        EXACT_SUMS=exact_sums, LOG_P=block_p.bit_length() - 1, PART_N=part_n, GROUP_M=cfg.group_m,
        LOG_N=part_n.bit_length() - 1, USE_GDC=pdl, GDC_EARLY=PDL_EARLY, PREFETCH_LINES=(
            L2_PREFETCH_STEPS * cfg.block_k * weight.element_size() // _LINE_BYTES if pdl else 0),
        LINE=_LINE_BYTES // weight.element_size(), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch_options(pdl))
    lead = x.shape[:-1]
    if add_norm:
        return h.reshape(*lead, N), out.reshape(*lead, N), ss_out
    return out.reshape(*lead, out.shape[1]), h, ss_out


@triton.jit(do_not_specialize=["M", "P_IN"])  # 1 row compiles no other kernel than 7 (BLOCK_M: 16, 32, 64 or 128)
def _row_linear_kernel(x_ptr, w_ptr, out_ptr, bias_ptr, ss_in_ptr, res_ptr, nw_ptr, h_ptr, ss_out_ptr,
                       pos_ptr, cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr, stride_cos, stride_sin,
                       stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, block_size,
                       M, N, K, stride_x, stride_w, stride_r, eps, P_IN, HEAD_DIM: tl.constexpr, Q_TILES: tl.constexpr,
                       ROT_TILES: tl.constexpr, UNFUSED: tl.constexpr, SCALED: tl.constexpr, EPILOGUE: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_P: tl.constexpr, PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr,
                       EXACT_SUMS: tl.constexpr, LOG_P: tl.constexpr, PART_N: tl.constexpr, GROUP_M: tl.constexpr,
                       LOG_N: tl.constexpr,
                       USE_GDC: tl.constexpr,
                       GDC_EARLY: tl.constexpr, PREFETCH_LINES: tl.constexpr, LINE: tl.constexpr):
    if GROUP_M > 1:  # one launch axis: GROUP_M row tiles take each column tile in turn (its weights stay in L2)
        pid = tl.program_id(0)
        m_tiles = tl.cdiv(M, BLOCK_M)
        width = GROUP_M * tl.cdiv(N, BLOCK_N)
        first_m = (pid // width) * GROUP_M
        size_m = tl.minimum(m_tiles - first_m, GROUP_M)
        pm = first_m + (pid % width) % size_m
        pn = (pid % width) // size_m
    else:
        pn = tl.program_id(0)
        pm = tl.program_id(1)
    rows = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    if EPILOGUE == 4:  # ROPE_KV: a q or k tile owns columns t*HALF + [0, HALF) of its head and each one's pair + d/2
        HALF: tl.constexpr = BLOCK_N // 2
        j = tl.arange(0, BLOCK_N)
        paired = (pn // (HEAD_DIM // BLOCK_N)) * HEAD_DIM + (pn % (HEAD_DIM // BLOCK_N)) * HALF + j % HALF \
            + (j // HALF) * (HEAD_DIM // 2)
        cols = tl.where(pn < ROT_TILES, paired, cols)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    up_rows = w_ptr + (cols + N).to(tl.int64)[:, None] * stride_w  # SILU_MUL: [gate; up] weight rows
    if PREFETCH_LINES > 0:  # the weights do not depend on the kernel before: warm L2 before the wait
        pf_cols = tl.minimum(cols, N - 1).to(tl.int64)[:, None] * stride_w
        _prefetch_l2(w_ptr + pf_cols, K, PREFETCH_LINES, LINE)
        if EPILOGUE == 1:
            _prefetch_l2(w_ptr + N.to(tl.int64) * stride_w + pf_cols, K, PREFETCH_LINES, LINE)
    if USE_GDC:  # launched dependent (PDL): wait for the kernel before to end and its writes to land
        tl.extra.cuda.gdc_wait()
        if GDC_EARLY:
            tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < K
        a = tl.load(x_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(DOT_DTYPE)
        w = tl.load(w_rows + kk[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(w.to(DOT_DTYPE)), acc, input_precision=PRECISION)
        if EPILOGUE == 1:
            wu = tl.load(up_rows + kk[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc_up = tl.dot(a, tl.trans(wu.to(DOT_DTYPE)), acc_up, input_precision=PRECISION)
    if USE_GDC and not GDC_EARLY:
        tl.extra.cuda.gdc_launch_dependents()  # the next projection's launch may begin
    if SCALED:  # rms_norm's row scale: rsqrt(mean(h^2) + eps), the partial sums added in order
        ps = tl.arange(0, BLOCK_P)
        part = tl.load(ss_in_ptr + ps[:, None] * M + rows[None, :], mask=(ps < P_IN)[:, None] & row_ok[None, :],
                       other=0.0)
        if EXACT_SUMS:
            total = _order_free_sum(part, 0, LOG_P)
        else:
            total = tl.sum(part, 0)
        inv = 1.0 / tl.sqrt(total / K + eps)
        acc *= inv[:, None]
        acc_up *= inv[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    at = rows.to(tl.int64)[:, None] * N + cols[None, :]
    dtype = out_ptr.dtype.element_ty
    if EPILOGUE == 1:  # silu(gate) * up from the rounded projections, in float32, rounded once
        g = acc.to(dtype).to(tl.float32)
        acc = g / (1.0 + tl.exp(-g)) * acc_up.to(dtype).to(tl.float32)
    if EPILOGUE == 2 or EPILOGUE == 3:  # h = out + residual
        r = tl.load(res_ptr + rows.to(tl.int64)[:, None] * stride_r + cols[None, :], mask=ok, other=0.0)
        h = (acc.to(dtype).to(tl.float32) + r.to(tl.float32)).to(dtype)
        acc = h.to(tl.float32)  # ADD: out <- h
        if EPILOGUE == 2:  # ADD_NORM: h to h_ptr; out <- hn = h * norm_w; each PART_N columns' sum of h^2
            tl.store(h_ptr + at, h, mask=ok)
            hf = tl.where(ok, acc, 0.0)
            if BLOCK_N == PART_N:
                if EXACT_SUMS:
                    tl.store(ss_out_ptr + pn * M + rows, _order_free_sum(hf * hf, 1, LOG_N), mask=row_ok)
                else:
                    tl.store(ss_out_ptr + pn * M + rows, tl.sum(hf * hf, 1), mask=row_ok)
            else:
                sq = tl.reshape(hf * hf, [BLOCK_M, BLOCK_N // PART_N, PART_N])
                if EXACT_SUMS:
                    parts = _order_free_sum(sq, 2, LOG_N)
                else:
                    parts = tl.sum(sq, 2)
                group = pn * (BLOCK_N // PART_N) + tl.arange(0, BLOCK_N // PART_N)
                tl.store(ss_out_ptr + group[None, :] * M + rows[:, None], parts,
                         mask=row_ok[:, None] & (group * PART_N < N)[None, :])
            acc = hf * tl.load(nw_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if EPILOGUE == 4:
        _rope_kv_epilogue(acc.to(dtype).to(tl.float32), rows, row_ok, cols, col_ok, pn, N, out_ptr, pos_ptr, cos_ptr,
                          sin_ptr, slot_ptr, kc_ptr, vc_ptr, stride_cos, stride_sin, stride_kcb, stride_kcs, stride_kch,
                          stride_vcb, stride_vcs, stride_vch, block_size, HEAD_DIM, Q_TILES, ROT_TILES, BLOCK_M,
                          BLOCK_N, UNFUSED)
    else:
        tl.store(out_ptr + at, acc.to(dtype), mask=ok)


@triton.jit
def _rope_kv_epilogue(x, rows, row_ok, cols, col_ok, pn, N, q_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr,
                      stride_cos, stride_sin, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                      block_size, HEAD_DIM: tl.constexpr, Q_TILES: tl.constexpr, ROT_TILES: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UNFUSED: tl.constexpr):
    """ROPE_KV's epilogue on ``x`` (float32 of the rounded projection, [BLOCK_M, BLOCK_N], columns
    ``cols``): rotate a q or k tile's pairs as ``rope_write_kv`` does (x1*cos - x2*sin, x2*cos + x1*sin
    in float32), then q into the [rows, Q_TILES * BLOCK_N] output, k and v into the cache slot (a
    negative slot: not written; rounded to the projection's dtype, then the cache's). ``UNFUSED``
    (on a GPU): each product rounded on its own (``_mul_rn``), so a rotated value has the same bits
    in every tile shape; the compiler's choice of which product to fuse into an FMA followed the
    tile (float32 rows changed with the row tile on an H200)."""
    dtype = q_ptr.dtype.element_ty
    slot = tl.load(slot_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
    blk = slot // block_size
    off = slot % block_size
    write = row_ok & (slot >= 0)
    if pn < ROT_TILES:
        HALF: tl.constexpr = BLOCK_N // 2
        pos = tl.load(pos_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        freq = (pn % (HEAD_DIM // BLOCK_N)) * HALF + tl.arange(0, HALF)
        c = tl.load(cos_ptr + pos[:, None] * stride_cos + freq[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + pos[:, None] * stride_sin + freq[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.permute(tl.reshape(x, [BLOCK_M, 2, HALF]), [0, 2, 1]))
        y1 = _mul_rn(x1, c, UNFUSED) - _mul_rn(x2, s, UNFUSED)
        y2 = _mul_rn(x2, c, UNFUSED) + _mul_rn(x1, s, UNFUSED)
        y = tl.reshape(tl.permute(tl.join(y1, y2), [0, 2, 1]), [BLOCK_M, BLOCK_N])
        # (masks of the full tile, by column: the interpreter mishandled a scalar or a broadcast mask)
        q_cols = Q_TILES * BLOCK_N
        in_q = cols < q_cols
        q_dst = q_ptr + rows.to(tl.int64)[:, None] * q_cols + tl.where(in_q, cols, 0)[None, :]
        tl.store(q_dst, y.to(dtype), mask=row_ok[:, None] & in_q[None, :])
        kc = tl.where(in_q, 0, cols - q_cols)
        k_dst = kc_ptr + blk[:, None] * stride_kcb + off[:, None] * stride_kcs + (kc // HEAD_DIM)[None, :] * stride_kch \
            + (kc % HEAD_DIM)[None, :]
        tl.store(k_dst, y.to(dtype).to(kc_ptr.dtype.element_ty), mask=write[:, None] & (cols >= q_cols)[None, :])
    else:
        vc = cols - ROT_TILES * BLOCK_N
        dst = vc_ptr + blk[:, None] * stride_vcb + off[:, None] * stride_vcs + (vc // HEAD_DIM)[None, :] * stride_vch \
            + (vc % HEAD_DIM)[None, :]
        tl.store(dst, x.to(dtype).to(vc_ptr.dtype.element_ty), mask=write[:, None] & col_ok[None, :])


@triton.jit
def _mul_rn(a, b, UNFUSED: tl.constexpr):
    """float32 ``a * b``, with ``UNFUSED`` as PTX ``mul.rn.f32``: an instruction whose rounding is
    named is never contracted into an FMA with the add that uses it. Off the GPU (Triton's
    interpreter), a plain product, which numpy rounds on its own anyway."""
    if UNFUSED:
        y = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True,
                                      pack=1)
    else:
        y = a * b
    return y


_LINE_BYTES = 128


@triton.jit
def _prefetch_l2(rows_ptr, K, LINES: tl.constexpr, LINE: tl.constexpr):
    """Ask L2 for the first ``LINES`` 128-byte lines of each row at ``rows_ptr`` [R, 1] (``LINE``
    elements a line, clamped to the row's K elements); nothing is loaded into registers."""
    offs = tl.minimum(tl.arange(0, LINES) * LINE, K - 1)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [rows_ptr + offs[None, :]],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _order_free_sum(x, axis: tl.constexpr, LOG_TERMS: tl.constexpr):
    """The sum of float32 ``x`` along ``axis`` (at most 2^``LOG_TERMS`` terms), the same bits in any
    order and so in any layout of the tile (``tl.sum``'s order follows the layout, and the layout
    the row tile): each term is cut to a fixed point set by the largest magnitude along the axis (a max, an
    exact operation), the integers are summed in int64 (exact) and the sum converted back once.
    Terms below 2^-(62 - LOG_TERMS) of the largest are dropped: far under float32's precision.
    NaN and infinity pass through."""
    big = tl.max(tl.abs(x), axis)
    e = ((big.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2(big)); -127 for 0
    s = tl.minimum(61 - LOG_TERMS - e, 126)  # each term below 2^(62 - LOG_TERMS)
    up = ((s + 127) << 23).to(tl.float32, bitcast=True)  # 2^s
    down = ((127 - s) << 23).to(tl.float32, bitcast=True)  # 2^-s
    fixed = (x * tl.expand_dims(up, axis)).to(tl.int64)
    return tl.where(big < float("inf"), tl.sum(fixed, axis).to(tl.float32) * down, big)
