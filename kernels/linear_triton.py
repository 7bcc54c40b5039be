"""Triton matmul for the projections: ``linear_triton(x, w) == F.linear(x, w)`` ([M, K] x [N, K] -> [M, N]).

One program owns a tile of BLOCK_M rows and BLOCK_N output columns and walks the whole K
dimension in BLOCK_K steps, in order, accumulating in float32 (no split-K)::

    grid = (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),)      program -> (row tile, column tile)

Decode steps have a handful of rows, so the weight read is the whole cost: narrow column tiles
give enough programs to keep every SM streaming. ``linear_config`` picks the tiles from the row
count. Not in the default kernel set: on an H100 with cold weights (``benchmarks/gemm_shapes.py``)
it beats cuBLAS only on Llama-3-8B's o_proj at one row (15.2 against 17.0 us; floor 11.2) and
loses on the other projections and on every SmolLM2 one, and a whole 8B step moved by 0.4%.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl


@dataclasses.dataclass(frozen=True, slots=True)
class LinearConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4


def linear_config(rows: int) -> LinearConfig:
    if rows <= 16:
        return LinearConfig(16, 32, 256, num_warps=4, num_stages=4)
    if rows <= 64:
        return LinearConfig(64, 64, 64, num_warps=4, num_stages=4)
    return LinearConfig(128, 128, 64, num_warps=8, num_stages=3)


def linear_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.nn.functional.linear(x, w, bias)


# The batch-invariant mode's one tile shape (kernels/exact_set.py; it runs the LM head): a row's
# result then never depends on how many rows the call has, as no choice is made from M. Picked on
# an H200 (``gemm_shapes.py --rows 1 --rows 60 --rows 64 --shape smol.lm_head --shape 8b.lm_head
# --exact-sweep``, c4e2837, ``benchmarks/results/exact_mode/gemm_lm_head_exact_sweep_h200_c4e2837.json``):
# at 1, 60 and 64 rows the SmolLM2 LM head takes 18.9, 20.1 and 20.5 us (cuBLAS 18.9, 19.1, 19.2;
# the former tile (64, 32, 128, 4, 4) 27.5, 28.0, 28.0) and the 8B's 246.9, 265.0, 265.9 (cuBLAS
# 248.7, 282.1, 288.4; the former tile 281.4, 326.8, 358.1).
EXACT_CONFIG = LinearConfig(64, 128, 64, num_warps=8, num_stages=4)


def linear_exact(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``linear_triton`` with ``EXACT_CONFIG`` whatever the row count: batch-invariant rows."""
    return linear_triton(x, w, EXACT_CONFIG, bias)


def linear_triton(x: torch.Tensor, w: torch.Tensor, config: LinearConfig | None = None,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T (+ bias [N], added in float32 before the one rounding) -> [..., N] in x's dtype."""
    lead, K = x.shape[:-1], x.shape[-1]
    N = w.shape[0]
    assert w.shape[1] == K, f"weight {tuple(w.shape)} does not take {K} inputs"
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out.reshape(*lead, N)
    cfg = config or linear_config(M)
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    has_bias = bias is not None
    _linear_kernel[grid](x2, w, bias if has_bias else w, out, M, N, K, x2.stride(0), w.stride(0), out.stride(0),
                         HAS_BIAS=has_bias, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                         PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                         DOT_DTYPE=tl.float32 if not x.is_cuda or x.dtype == torch.float32 else
                         {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[x.dtype],
                         num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out.reshape(*lead, N)


@triton.jit(do_not_specialize=["M"])  # M == 1 compiles no other kernel than M == 7
def _linear_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr):
    n_tiles = tl.cdiv(N, BLOCK_N)
    pm = tl.program_id(0) // n_tiles
    pn = tl.program_id(0) % n_tiles
    rows = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])
