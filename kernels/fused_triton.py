"""Triton RMSNorm (with the residual add), SiLU-gated activation and fused RoPE + KV write: the same
signatures and semantics as the references in ``kernels/norm.py`` and ``kernels/rope.py``.

Each wrapper launches one kernel and allocates its outputs from shapes alone (no host sync, no
data-dependent Python control flow), so the calls can be captured in CUDA graphs. All math runs
in float32 after the loads; every result is rounded where the reference rounds it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import PDL_ALL, dependent, launch_options


def _num_warps(block: int) -> int:
    """Warps for a program owning ``block`` elements: about 256 elements a warp, 1 to 16 warps."""
    return min(max(block // 256, 1), 16)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, h) with h = x + residual (rounded to x.dtype; h is ``x`` itself without a residual)
    and normed = h * rsqrt(mean(h^2) + eps) * weight, computed in float32, returned in x.dtype.

    ``x``, ``residual``: [..., hidden], rows may be strided views; ``weight``: [hidden]. One program a row.
    """
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)  # a view for 2-D inputs, strided rows included
    rows = x2.shape[0]
    normed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    has_residual = residual is not None
    if has_residual:
        r2 = residual.reshape(-1, hidden)
        h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        r2, h = x2, x  # never read / written by the kernel
    if rows == 0:
        return normed, h
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(rows,)](x2, r2, weight, normed, h, x2.stride(0), x2.stride(1), r2.stride(0), r2.stride(1),
                              hidden, eps, HAS_RESIDUAL=has_residual, BLOCK=block, num_warps=_num_warps(block))
    return normed, h


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, h_ptr, stride_xt, stride_xd, stride_rt, stride_rd, hidden, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + t * stride_xt + cols * stride_xd, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + t * stride_rt + cols * stride_rd, mask=ok, other=0.0)
        h = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the reference's add, rounded once
        tl.store(h_ptr + t * hidden + cols, h, mask=ok)
        x = h
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / hidden + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * hidden + cols, (xf * inv * w).to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for ``gate_up`` [..., 2 * inter] = [gate | up] -> [..., inter], in float32 and
    rounded once (the reference rounds silu(gate) first: within one rounding of this)."""
    inter = gate_up.shape[-1] // 2
    gu = gate_up.reshape(-1, 2 * inter)
    rows = gu.shape[0]
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0 or inter == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](gu, out, gu.stride(0), gu.stride(1), inter,
                                                        BLOCK=block, num_warps=_num_warps(block))
    return out


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_t, stride_d, inter, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    g = tl.load(gu_ptr + t * stride_t + cols * stride_d, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * stride_t + (cols + inter) * stride_d, mask=ok, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + t * inter + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def rope_write_kv_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> torch.Tensor:
    """RoPE on q [T, heads, d] and k [T, kv_heads, d], then rotated k and v into the paged cache
    [num_blocks, block_size, kv_heads, d] at ``slot_mapping`` [T] (a negative slot: a padding token,
    not written). Returns rotated q, contiguous. q, k and v may be strided views of one fused projection.

    One program a token rotates all its q and k heads (pairs (i, i + d/2), cos/sin [positions, d/2]
    in float32) and stores k and v: one launch for what the reference does in several.
    """
    T, H, D = q.shape
    kvh = k.shape[1]
    assert positions.is_contiguous() and slot_mapping.is_contiguous(), "positions and slots: contiguous [T]"
    q_rot = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    if T == 0:
        return q_rot
    half = D // 2
    block_half = triton.next_power_of_2(half)
    pdl = dependent(q, PDL_ALL)
    _rope_write_kv_kernel[(T,)](
        q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, q_rot,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), H, kvh, half, k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(H), BLOCK_KVH=triton.next_power_of_2(kvh), BLOCK_HALF=block_half,
        USE_GDC=pdl, num_warps=_num_warps(triton.next_power_of_2(H) * 2 * block_half), **launch_options(pdl))
    return q_rot


@triton.jit
def _rotate(x_ptr, row_off, heads, stride_h, stride_d, c, s, half, BLOCK_HEADS: tl.constexpr,
            BLOCK_HALF: tl.constexpr):
    """Rotated halves (float32) of the [heads, 2 * half] tile at x_ptr + row_off, and their mask."""
    hd = tl.arange(0, BLOCK_HEADS)
    i = tl.arange(0, BLOCK_HALF)
    ok = (hd[:, None] < heads) & (i[None, :] < half)
    base = x_ptr + row_off + hd[:, None] * stride_h + i[None, :] * stride_d
    x1 = tl.load(base, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + half * stride_d, mask=ok, other=0.0).to(tl.float32)
    return x1 * c - x2 * s, x2 * c + x1 * s, ok


@triton.jit
def _rope_write_kv_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, q_out_ptr,
                          stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
                          stride_vt, stride_vh, stride_vd, stride_cos, stride_sin,
                          stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                          heads, kv_heads, half, block_size,
                          BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr, BLOCK_HALF: tl.constexpr,
                          USE_GDC: tl.constexpr):
    if USE_GDC:  # launched dependent (kernels/pdl.py): the projection's q, k and v written first
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    c = tl.load(cos_ptr + pos * stride_cos + i, mask=i < half, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * stride_sin + i, mask=i < half, other=0.0).to(tl.float32)[None, :]

    # q: every token, padding included, into the contiguous [T, heads, 2 * half] output.
    q1, q2, q_ok = _rotate(q_ptr, t * stride_qt, heads, stride_qh, stride_qd, c, s, half, BLOCK_H, BLOCK_HALF)
    hq = tl.arange(0, BLOCK_H)
    q_out = q_out_ptr + t * heads * 2 * half + hq[:, None] * 2 * half + i[None, :]
    tl.store(q_out, q1.to(q_out_ptr.dtype.element_ty), mask=q_ok)
    tl.store(q_out + half, q2.to(q_out_ptr.dtype.element_ty), mask=q_ok)

    # k and v: into the cache slot, unless the slot is negative (padding).
    # (Heads to write as 0, not a scalar AND into the mask: Triton's interpreter mistypes that.)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    write_heads = tl.where(slot >= 0, kv_heads, 0)
    blk = slot // block_size
    off = slot % block_size
    k1, k2, k_ok = _rotate(k_ptr, t * stride_kt, write_heads, stride_kh, stride_kd, c, s, half, BLOCK_KVH, BLOCK_HALF)
    hk = tl.arange(0, BLOCK_KVH)
    k_dst = k_cache_ptr + blk * stride_kcb + off * stride_kcs + hk[:, None] * stride_kch + i[None, :]
    # Rounded to k's dtype first, then to the cache's: the reference's two casts.
    tl.store(k_dst, k1.to(k_ptr.dtype.element_ty).to(k_cache_ptr.dtype.element_ty), mask=k_ok)
    tl.store(k_dst + half, k2.to(k_ptr.dtype.element_ty).to(k_cache_ptr.dtype.element_ty), mask=k_ok)
    v_src = v_ptr + t * stride_vt + hk[:, None] * stride_vh + i[None, :] * stride_vd
    v_dst = v_cache_ptr + blk * stride_vcb + off * stride_vcs + hk[:, None] * stride_vch + i[None, :]
    v1 = tl.load(v_src, mask=k_ok, other=0.0)
    v2 = tl.load(v_src + half * stride_vd, mask=k_ok, other=0.0)
    tl.store(v_dst, v1.to(v_cache_ptr.dtype.element_ty), mask=k_ok)
    tl.store(v_dst + half, v2.to(v_cache_ptr.dtype.element_ty), mask=k_ok)
