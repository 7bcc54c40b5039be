"""Triton paged attention and KV write: the same signatures as ``kernels/attention.py``'s references.

One kernel serves decode, prefill chunks and tree verification. A program owns one tile of a
sequence's new tokens for one KV head (the g = heads / kv_heads query heads sharing it are
folded into the tile's rows) and one split of the KV length::

    grid = (sequences * query tiles, kv_heads, splits)
    rows of a tile:  token qi, head gi  ->  row qi * g + gi            (BLOCK_M rows)
    keys of a split: [split * keys_per_split, (split + 1) * keys_per_split) within the sequence,
                     keys_per_split = ceil(seq_len / splits), rounded up to whole key tiles

Keys are read straight from the paged cache through the block table. Visibility is computed in
the kernel: every key before ``mask_start`` is visible; after it, causal by default, or bit
(key - mask_start) of the token's row of the packed ancestor mask (int32 words, 32 keys each).
No dense [B, Q, K] mask exists anywhere.

A ragged step (``meta.ragged``: a graphed prompt step, its grid fixed by its capacity of tokens)
numbers its programs over the step's tiles instead: program p finds its sequence from the chunks'
tile counts (a cumulative sum over ``query_start_loc`` in the kernel), one split::

    grid = (ceil(T / BLOCK_Q) + sequences, kv_heads, 1)     (programs past the last tile exit)

With several splits (flash-decoding: one long sequence still fills the GPU) each program writes
its normalised partial output and log-sum-exp; ``_combine_kernel`` merges them::

    out = sum_s 2^(lse_s - lse_max) * o_s / sum_s 2^(lse_s - lse_max)      (lse in base 2)

A graphed step's split count comes from its bucket's capacity, not from its sequences' lengths, so
a short sequence uses only the first ``used = ceil(seq_len / keys_per_split)`` splits: the programs
past them exit at once, the first split's programs write ``used`` for their tokens, and the combine
reads that many partials (a 512-key tree in a 58-split launch of 32-key tiles: 16 of them). Shares
of one key tile keep each program's loop shortest: on an H200 a SmolLM2 decode step (512 keys)
took 0.799 ms with shares of at least four tiles, against 0.768 with one.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import triton
import triton.language as tl

from kernels.pdl import PDL_ALL, dependent, launch_options

from kernels.attention import pack_mask
from kernels.metadata import AttentionMetadata

LOG2E = 1.4426950408889634
# Dot operands in the cache's dtype on the GPU (fp32 accumulation). Triton's CPU interpreter
# multiplies bfloat16 wrongly, so there both operands go up to float32 (tests only).
_DOT_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def write_kv_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Store new keys/values [T, kv_heads, head_dim] at flat slots [T] (a negative slot: a padding
    token, not written). Mutates the caches."""
    T = k.shape[0]
    if T == 0:
        return
    assert slot_mapping.is_contiguous(), "slots: contiguous [T]"
    width = k.shape[1] * k.shape[2]
    k, v = k.reshape(T, width), v.reshape(T, width)
    _write_kv_kernel[(T,)](k_cache, v_cache, k, v, slot_mapping, k.stride(0), v.stride(0), width,
                           BLOCK=triton.next_power_of_2(width))


@triton.jit
def _write_kv_kernel(k_cache_ptr, v_cache_ptr, k_ptr, v_ptr, slot_ptr, stride_k, stride_v, width,
                     BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < tl.where(slot >= 0, width, 0)  # a padding token writes nothing
    k = tl.load(k_ptr + t * stride_k + cols, mask=ok)
    v = tl.load(v_ptr + t * stride_v + cols, mask=ok)
    tl.store(k_cache_ptr + slot * width + cols, k.to(k_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(v_cache_ptr + slot * width + cols, v.to(v_cache_ptr.dtype.element_ty), mask=ok)


def prepare_attention_triton(meta: AttentionMetadata) -> AttentionMetadata:
    """Per-step work shared by every layer: the custom mask packed into int32 words, once (a mask
    that comes packed is kept)."""
    if meta.custom_mask is None or meta.custom_mask.dtype == torch.int32:
        return meta
    return dataclasses.replace(meta, custom_mask=pack_mask(meta.custom_mask))


# EAGLE3_ATTN_PREFETCH=N (tiles; 0 off): before its wait on the kernel before it (a dependent launch,
# kernels/pdl.py), each program of a launch of at most two programs an SM asks L2 for its first N
# tiles of keys and values that the step does not write (those before the step's first new token:
# RoPE's kernel, just before, writes the new ones), so its reads start warm while RoPE runs. Speed
# only: no result changes a bit. On an H200 (benchmarks/switch_ab.py, two rounds, every launch
# prefetching; results/attention/attn_prefetch_ab_h200.json), step ms with 0 / 1 / 2 / 4 / 8 tiles:
# SmolLM2 batch 1 at 512 keys 0.754 / 0.745 / 0.727 / 0.720 / 0.723; Llama-3-8B geometry batch 1
# at 4K 4.531 / 4.501 / 4.495 / 4.531 / 4.512, but at 32K (392 programs) 5.572 / 5.565 / 5.589 /
# 5.664 / 5.891 and batch 64 at 4K (512) 12.95 / 12.98 / 12.98 / 13.10 / 13.31: launches that
# fill the GPU lose by it.
ATTN_PREFETCH_TILES = int(os.environ.get("EAGLE3_ATTN_PREFETCH", "2"))
assert ATTN_PREFETCH_TILES in (0, 1, 2, 4, 8), "EAGLE3_ATTN_PREFETCH: 0, 1, 2, 4 or 8 tiles"
_LINE_BYTES = 128
MAX_SPLITS = 64  # key splits of one launch at most
# The combine's block of splits for launches of at most this many (``combine_block``; 0: ``MAX_SPLITS``
# for every launch; ``EAGLE3_COMBINE_NARROW``, read at import). A block of 64 splits holds its
# partials in 168 registers a thread (sm_90): three programs an SM, so a tree step's (token, head)
# programs ran in waves (the 8B's 64-token tree, 8 splits: 2,048 programs, 18.8 us a layer at 4K and
# at 32K keys, as long as the attention at 4K); a block of 16 takes 48 registers.
COMBINE_NARROW = int(os.environ.get("EAGLE3_COMBINE_NARROW", "16"))
assert COMBINE_NARROW in (0, 8, 16, 32), "EAGLE3_COMBINE_NARROW: 0, 8, 16 or 32 splits"
SPLIT_TILES = 4  # key tiles a split at least, in the host's split count (a capacity's, in a graph)
TAIL_N = tl.constexpr(32)  # keys a masked tile
_CPU_SLOTS = 8  # programs "at once" under the CPU interpreter (only the split logic is exercised there)
_slots: dict[tuple, int] = {}  # a compiled variant's resources -> programs the GPU runs at once


def _num_splits(programs: int, max_seq_len: int, block_n: int, slots: int) -> int:
    """Key splits for a launch of ``programs`` (sequence, tile, head) programs when the GPU runs
    ``slots`` of them at once: as many as still fit one wave, at least 4 key tiles each. A
    launch just over a wave costs two (on an H200, a 64-token tree at 32K keys, 16 programs of
    132 slots: 17 splits 172 us, 8 splits 150 us, 16 splits 168 us, 32 splits 210 us; more
    splits, more programs' fixed costs and a longer combine). Launches that fill the GPU are not
    split. Depends only on host-side sizes (a graphed step passes its bucket's capacity as
    ``max_seq_len``): each sequence divides its own length among the splits, in the kernel."""
    cap = max(1, min(triton.cdiv(max_seq_len, SPLIT_TILES * block_n), MAX_SPLITS))
    return max(1, min(slots // programs, cap))


def prefetch_tiles(programs: int, sms: int, tiles: int = ATTN_PREFETCH_TILES) -> int:
    """Key tiles each program of a dependent launch of ``programs`` asks L2 for before its wait, on a
    GPU of ``sms`` SMs: ``tiles`` where the launch holds at most two programs an SM, else none (a
    launch that fills the GPU lost by it: ``EAGLE3_ATTN_PREFETCH`` above)."""
    return tiles if programs <= 2 * sms else 0


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _programs_per_sm(n_regs: int, shared_bytes: int, num_warps: int, props) -> int:
    """Programs of a compiled kernel (``n_regs`` registers a thread, ``shared_bytes`` of shared
    memory) one SM of ``props`` (a device's properties) holds at once: registers are allocated per
    warp in units of 256, 1 KiB of shared memory is reserved a program; threads limit too."""
    regs_per_warp = triton.cdiv(max(n_regs, 1) * 32, 256) * 256
    by_regs = props.regs_per_multiprocessor // (regs_per_warp * num_warps)
    by_shared = props.shared_memory_per_multiprocessor // (shared_bytes + 1024)
    by_threads = props.max_threads_per_multi_processor // (32 * num_warps)
    return max(1, min(by_regs, by_shared, by_threads))


def _slots_of(kernel, num_warps: int, device: torch.device) -> int:
    """Programs of a compiled kernel the whole device holds at once."""
    props = torch.cuda.get_device_properties(device)
    load = getattr(kernel, "_init_handles", None)  # loads the binary: n_regs is known from then on
    if load is not None:
        load()
    n_regs = getattr(kernel, "n_regs", None)
    # A Triton that keeps the register count elsewhere: one program an SM (fewer splits, same results).
    per_sm = _programs_per_sm(n_regs, kernel.metadata.shared, num_warps, props) if n_regs else 1
    return per_sm * props.multi_processor_count


@dataclasses.dataclass(frozen=True, slots=True)
class AttentionConfig:
    """Tile sizes and launch shape of one attention launch."""

    block_m: int  # query rows per program (tokens x the query heads sharing a KV head)
    block_n: int  # keys per loop iteration
    num_warps: int = 4
    num_stages: int = 2
    splits: int = 0  # key splits of the launch; 0: ``_num_splits`` picks


def attention_config(max_query_len: int, group: int, head_dim: int, elem_bytes: int = 2,
                     tree: bool = False) -> AttentionConfig:
    """Decode-sized steps take small row tiles, tree and prefill steps 64 x 64 tiles. From
    ``benchmarks/attention_kernel.py --sweep`` on an H200 (Llama-3-8B geometry, splits filling one
    wave, ``benchmarks/results/attention/``): a 64-token tree at 32K keys 151 us with 128 x 128 tiles,
    120 us with 64 x 64 tiles and 3 stages (two programs an SM); at 4K keys 27 us either way with 64
    x 64. Float32 caches (``elem_bytes`` 4) keep 2 stages (shared memory).

    Decode steps: 16 x 64 tiles with 2 stages (39 KB of shared memory, four programs an SM). At batch
    64 and 4K keys 249 us a layer (the KV read once: 252 us), against 298 us with 3 stages (72 KB, three
    programs an SM); one sequence at 32K keys 43.0 against 43.9 us, at 4K 12.1 against 12.0.

    A ``tree`` (a masked step) of at most 64 tokens over 64-wide heads (SmolLM2) takes 32-key steps:
    on an H100, a 60-token tree at 512 keys 9.5 against 12.4 us (at 2048 keys 11.2 against 10.9)."""
    rows = max_query_len * group
    if rows <= 16:
        return AttentionConfig(16, 64, num_warps=4, num_stages=2)
    if tree and head_dim <= 64 and max_query_len <= 64:
        return AttentionConfig(64, 32, num_warps=4, num_stages=2)
    return AttentionConfig(64, 64, num_warps=4, num_stages=3 if head_dim * elem_bytes <= 256 else 2)


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float, config: AttentionConfig | None = None) -> torch.Tensor:
    """Attention of new queries [T, heads, head_dim] over their sequences' cached KV -> [T, heads, head_dim].

    ``meta.custom_mask`` must be packed (``prepare_attention_triton``). ``config``: tile sizes
    (default ``attention_config``; benchmarks sweep others).
    """
    T, H, D = q.shape
    _, block_size, kvh, _ = k_cache.shape
    g = H // kvh
    assert all(t is None or t.is_contiguous() for t in (meta.query_start_loc, meta.seq_lens, meta.mask_start)), \
        "step metadata: contiguous arrays"
    cfg = config or attention_config(meta.max_query_len, g, D, k_cache.element_size(),
                                     tree=meta.custom_mask is not None)
    block_q = cfg.block_m // g  # tokens per tile: g rows each
    assert block_q >= 1, f"{g} query heads per KV head exceed a tile of {cfg.block_m} rows"
    q_tiles = triton.cdiv(meta.max_query_len, block_q)
    if meta.ragged:
        assert meta.custom_mask is None, "a ragged step is causal"
    has_mask = meta.custom_mask is not None
    mask = meta.custom_mask if has_mask else meta.seq_lens  # any tensor: never read without a mask
    mask_start = meta.mask_start if has_mask else meta.seq_lens
    pdl = dependent(q, PDL_ALL)
    constants = dict(G=g, BLOCK_Q=block_q, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=D,
                     BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_SIZE=block_size, HAS_MASK=has_mask,
                     EVEN_D=triton.next_power_of_2(D) == D and D >= 16,
                     PRECISION="ieee" if q.dtype == torch.float32 else "tf32", RAGGED=meta.ragged,
                     BLOCK_B=triton.next_power_of_2(meta.num_seqs) if meta.ragged else 1,
                     DOT_DTYPE=tl.float32 if not q.is_cuda else _DOT_DTYPES.get(k_cache.dtype, tl.float32),
                     USE_GDC=pdl, PREFETCH_TILES=0, ROW_LINES=max(1, D * k_cache.element_size() // _LINE_BYTES),
                     LINE=_LINE_BYTES // k_cache.element_size(), num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    def launch(grid, part, lse, used, splits, warmup=False):
        run = _attention_kernel.warmup if warmup else _attention_kernel[grid]
        extra = {"grid": grid} if warmup else {}
        return run(
            q, k_cache, v_cache, part, lse, used, meta.query_start_loc, meta.seq_lens, meta.block_tables, mask, mask_start,
            scale * LOG2E, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            meta.block_tables.stride(0), mask.stride(0) if has_mask else 0, mask.shape[1] if has_mask else 0,
            part.stride(0) if splits > 1 else 0, part.stride(-3), part.stride(-2),
            lse.stride(0) if splits > 1 else 0, lse.stride(-2) if splits > 1 else 0,
            q_tiles, splits, meta.num_seqs, SPLIT=splits > 1, **constants, **extra,
            **({} if warmup else launch_options(pdl)))

    def partials(splits):
        return (torch.empty(splits, T, H, D, dtype=torch.float32, device=q.device),
                torch.empty(splits, T, H, dtype=torch.float32, device=q.device),
                torch.empty(T, dtype=torch.int32, device=q.device))  # each token's splits used

    splits = 1 if meta.ragged else cfg.splits
    if not splits:
        slots = _CPU_SLOTS
        if q.is_cuda:  # the split variant's resources decide how many programs run at once
            key = (q.device.index, k_cache.dtype, tuple(sorted(constants.items())))
            if key not in _slots:
                kernel = launch((1, 1, 1), *partials(2), 2, warmup=True)
                _slots[key] = _slots_of(kernel, cfg.num_warps, q.device)
            slots = _slots[key]
        splits = _num_splits(meta.num_seqs * q_tiles * kvh, meta.max_seq_len, cfg.block_n, slots)
    out = torch.empty_like(q)
    part, lse, used = partials(splits) if splits > 1 else (out, out, out)  # one split: written directly, normalised
    programs = triton.cdiv(meta.max_query_len, block_q) + meta.num_seqs if meta.ragged else meta.num_seqs * q_tiles
    if pdl and not meta.ragged:
        constants["PREFETCH_TILES"] = prefetch_tiles(programs * kvh * splits, _sm_count(q.device))
    launch((programs, kvh, splits), part, lse, used, splits)
    if splits > 1:
        _combine_kernel[(T, H)](part, lse, used, out, splits, part.stride(0), part.stride(1), part.stride(2),
                                lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), D,
                                BLOCK_S=combine_block(splits), BLOCK_D=triton.next_power_of_2(D), USE_GDC=pdl,
                                **launch_options(pdl))
    return out


@triton.jit
def _attend_keys(acc, m_i, l_i, q, lo, hi, b, t, qi, row_ok, m_start, first_kv, k_cache_ptr, v_cache_ptr,
                 tables_ptr, mask_ptr, scale_log2, stride_kb, stride_ks, stride_kh, stride_bt, stride_mask,
                 mask_words, kvh, d, d_ok, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr,
                 HAS_MASK: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Online softmax over keys [lo, hi); scores stay raw, the running max ``m_i`` is in scaled
    log2 units (the scale folds into the exponent's multiply-add).

    MASKED False: whole tiles of keys every row sees (hi - lo a multiple of BLOCK_N): no bounds,
    no visibility, no infinities (a padding row has q = 0 and finite scores, never stored).
    MASKED True: the rest (partial tiles, the tree or causal region) with full checks."""
    # Each tile's block ids come from the iteration before, in registers. Loaded in their own
    # iteration, the pipeliner copied the ids one stage ahead and the keys and values only one tile
    # ahead (waiting on every copy at each tile's start); so, they go num_stages - 1 tiles ahead.
    ahead = lo + tl.arange(0, BLOCK_N)
    ids = tl.load(tables_ptr + b * stride_bt + ahead // BLOCK_SIZE, mask=ahead < hi, other=0)
    for start in range(lo, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        block = ids.to(tl.int64)
        ahead = keys + BLOCK_N
        ids = tl.load(tables_ptr + b * stride_bt + ahead // BLOCK_SIZE, mask=ahead < hi, other=0)
        if MASKED:
            key_ok = keys < hi
        addr = block * stride_kb + (keys % BLOCK_SIZE) * stride_ks + kvh * stride_kh  # (N,)
        kv_ptrs = addr[:, None] + d[None, :]  # (N, D): each key's row is contiguous
        if MASKED:
            kv_ok = key_ok[:, None] & d_ok[None, :]
            k = tl.load(k_cache_ptr + kv_ptrs, mask=kv_ok, other=0.0)
        elif EVEN_D:
            k = tl.load(k_cache_ptr + kv_ptrs)
        else:
            k = tl.load(k_cache_ptr + kv_ptrs, mask=d_ok[None, :], other=0.0)
        s = tl.dot(q.to(DOT_DTYPE), tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION)  # (M, N), raw
        if MASKED:
            if HAS_MASK:
                # The tile's keys span at most BLOCK_N // 32 + 1 of a row's mask words: each row loads
                # those few words once (vectors over the rows), and every key picks its own.
                rel = keys - m_start  # (N,): column in the tokens' mask rows
                first_word = tl.maximum(start - m_start, 0) // 32
                pick = tl.maximum(rel, 0) // 32 - first_word  # (N,): which of the loaded words
                word = tl.zeros(s.shape, dtype=tl.int32)
                rows_at = mask_ptr + t * stride_mask + first_word  # (M,)
                for j in tl.static_range(BLOCK_N // 32 + 1):  # (the bound broadcast over the rows: the interpreter)
                    w = tl.load(rows_at + j, mask=row_ok & ((first_word + j + 0 * t) < mask_words), other=0)
                    word = tl.where(pick[None, :] == j, w[:, None], word)
                in_mask = (rel >= 0) & (tl.maximum(rel, 0) // 32 < mask_words)
                bit = ((word >> (tl.maximum(rel, 0) % 32)[None, :]) & 1) != 0
                visible = (rel < 0)[None, :] | (bit & in_mask[None, :])
            else:
                visible = keys[None, :] <= (first_kv + qi)[:, None]
            visible = visible & key_ok[None, :] & row_ok[:, None]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
            m_safe = m_new
        p = tl.exp2(s * scale_log2 - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_cache_ptr + kv_ptrs, mask=kv_ok, other=0.0)
        elif EVEN_D:
            v = tl.load(v_cache_ptr + kv_ptrs)
        else:
            v = tl.load(v_cache_ptr + kv_ptrs, mask=d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _prefetch_kv(k_cache_ptr, v_cache_ptr, tables_ptr, b, kvh, lo, hi, stride_kb, stride_ks, stride_kh, stride_bt,
                 KEYS: tl.constexpr, BLOCK_SIZE: tl.constexpr, ROW_LINES: tl.constexpr, LINE: tl.constexpr):
    """Ask L2 for the 128-byte lines of keys [lo, hi) (at most ``KEYS``) of one KV head, keys and
    values (prefetch.global.L2: nothing loaded into registers). Keys out of the range ask for the
    sequence's first block's lines again (a valid address, no branch)."""
    keys = lo + tl.arange(0, KEYS)
    ok = keys < hi
    block = tl.load(tables_ptr + b * stride_bt + keys // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
    block = tl.where(ok, block, tl.load(tables_ptr + b * stride_bt).to(tl.int64))
    addr = block * stride_kb + (tl.where(ok, keys, 0) % BLOCK_SIZE) * stride_ks + kvh * stride_kh
    lines = addr[:, None] + (tl.arange(0, ROW_LINES) * LINE)[None, :]  # (KEYS, ROW_LINES)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [k_cache_ptr + lines],
                              dtype=tl.int32, is_pure=False, pack=1)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [v_cache_ptr + lines],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _query_tile(q_ptr, q_start, q_len, tile, kvh, stride_qt, stride_qh, G: tl.constexpr, BLOCK_Q: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A program's query rows: row r is token qi = tile * BLOCK_Q + r // G of the sequence's new
    tokens (flat index t) and query head kvh * G + r % G. Returns qi, head, row_ok, t, d, d_ok and
    the queries (M, D), zero in rows and columns out of range."""
    rows = tl.arange(0, BLOCK_M)
    qi = tile * BLOCK_Q + rows // G
    head = kvh * G + rows % G
    row_ok = (rows < BLOCK_Q * G) & (qi < q_len)
    t = (q_start + qi).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    return qi, head, row_ok, t, d, d_ok, q


@triton.jit
def _program_tile(qsl_ptr, num_seqs, q_tiles, BLOCK_Q: tl.constexpr, RAGGED: tl.constexpr, BLOCK_B: tl.constexpr):
    """(sequence, query tile, past the step's last tile) of this program. A ragged step (a graphed
    prompt step, its grid fixed by its capacity of tokens): program p takes the step's tile p,
    counted over the chunks' tiles in order (a cumulative sum over ``query_start_loc``), and the
    programs past the last one have nothing to do. Otherwise program p is tile p % q_tiles of
    sequence p // q_tiles."""
    if RAGGED:
        p = tl.program_id(0)
        s = tl.arange(0, BLOCK_B)
        s_ok = s < num_seqs
        lens = tl.load(qsl_ptr + s + 1, mask=s_ok, other=0) - tl.load(qsl_ptr + s, mask=s_ok, other=0)
        tiles = (lens + BLOCK_Q - 1) // BLOCK_Q
        ends = tl.cumsum(tiles, 0)  # each sequence's tiles end there (exclusive)
        b = tl.sum((ends <= p).to(tl.int32), 0)  # the first sequence whose tiles reach past p
        past = b >= num_seqs
        b = tl.maximum(tl.minimum(b, num_seqs - 1), 0)
        tile = p - tl.sum(tl.where(s < b, tiles, 0), 0)
    else:
        b = tl.program_id(0) // q_tiles
        tile = tl.program_id(0) % q_tiles
        past = tl.program_id(0) < 0  # (never: a tensor, as the ragged branch's)
    return b, tile, past


# Integer arguments that change from step to step are not specialised: Triton compiles a variant per
# value class (== 1, divisible by 16), and a variant first met mid-serving stalls every stream for
# the compilation (a block table's width, the splits, the mask's words, strides that scale with T).
@triton.jit(do_not_specialize=["stride_bt", "stride_mask", "mask_words", "stride_os", "stride_ls", "q_tiles",
                               "splits", "num_seqs"])
def _attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr, used_ptr, qsl_ptr, seq_lens_ptr, tables_ptr,
                      mask_ptr, mask_start_ptr, scale_log2, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                      stride_bt, stride_mask, mask_words, stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
                      q_tiles, splits, num_seqs,
                      G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      HAS_MASK: tl.constexpr, SPLIT: tl.constexpr, EVEN_D: tl.constexpr,
                      PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr, RAGGED: tl.constexpr,
                      BLOCK_B: tl.constexpr, USE_GDC: tl.constexpr, PREFETCH_TILES: tl.constexpr,
                      ROW_LINES: tl.constexpr, LINE: tl.constexpr):
    # The step's metadata (query starts, lengths, the mask's start) is read before the wait: it is
    # written before the step's first kernel, never by the kernel just before this one (RoPE's,
    # which writes q and the new keys), and that one's programs let this launch only after their own
    # wait, so every kernel before it is complete (kernels/pdl.py). The wait still comes before any
    # early return.
    b, tile, past = _program_tile(qsl_ptr, num_seqs, q_tiles, BLOCK_Q, RAGGED, BLOCK_B)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    if HAS_MASK:
        m_start = tl.load(mask_start_ptr + b)
    if PREFETCH_TILES > 0:  # (not ragged) keys before the step's new ones: no kernel of the step writes them
        pf_lo = split * tl.maximum(tl.cdiv(tl.cdiv(seq_len, splits), BLOCK_N), 1) * BLOCK_N
        pf_hi = tl.minimum(pf_lo + PREFETCH_TILES * BLOCK_N, seq_len - q_len)
        _prefetch_kv(k_cache_ptr, v_cache_ptr, tables_ptr, b, kvh, pf_lo, pf_hi, stride_kb, stride_ks, stride_kh,
                     stride_bt, PREFETCH_TILES * BLOCK_N, BLOCK_SIZE, ROW_LINES, LINE)
    if USE_GDC:  # launched dependent (kernels/pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if past:
        return
    if tile * BLOCK_Q >= q_len:
        return
    # This sequence's share of the keys (one tile at least: a sequence of no keys reads none).
    keys_per_split = tl.maximum(tl.cdiv(tl.cdiv(seq_len, splits), BLOCK_N), 1) * BLOCK_N
    used = tl.maximum(tl.cdiv(seq_len, keys_per_split), 1)  # the splits that hold any of its keys
    if split >= used:  # nothing to read; the combine stops before this split
        return
    first_kv = seq_len - q_len  # KV index of the sequence's first new token
    qi, head, row_ok, t, d, d_ok, q = _query_tile(q_ptr, q_start, q_len, tile, kvh, stride_qt, stride_qh,
                                                  G, BLOCK_Q, BLOCK_M, BLOCK_D, HEAD_DIM)
    if SPLIT:
        if split == 0:  # every KV head's program writes the same count
            tl.store(used_ptr + t, used, mask=row_ok)
    if HAS_MASK:
        open_end = m_start  # keys before the mask: visible to every token
        key_end = seq_len
    else:  # causal: keys before the tile's first token are visible to all its tokens; none past its last
        m_start = first_kv
        open_end = first_kv + tile * BLOCK_Q
        key_end = tl.minimum(seq_len, first_kv + (tile + 1) * BLOCK_Q)
    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, key_end)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Whole tiles of keys every row sees, then the rest (a partial tile, the tree or causal region)
    # in tiles of TAIL_N keys: the masked loop's registers then stay under the open loop's (64 x 64
    # tree tiles over 128-wide heads: 218 registers a thread and no spill, against 255 and 88 bytes
    # of stack with 64-key masked tiles; Triton 3.6, sm_90: benchmarks/kernel_resources.py).
    mid = lo + (tl.maximum(tl.minimum(hi, open_end) - lo, 0) // BLOCK_N) * BLOCK_N
    acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, lo, mid, b, t, qi, row_ok, m_start, first_kv, k_cache_ptr,
                                 v_cache_ptr, tables_ptr, mask_ptr, scale_log2, stride_kb, stride_ks, stride_kh,
                                 stride_bt, stride_mask, mask_words, kvh, d, d_ok, BLOCK_N, BLOCK_SIZE, False,
                                 HAS_MASK, EVEN_D, PRECISION, DOT_DTYPE)
    acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, mid, hi, b, t, qi, row_ok, m_start, first_kv, k_cache_ptr,
                                 v_cache_ptr, tables_ptr, mask_ptr, scale_log2, stride_kb, stride_ks, stride_kh,
                                 stride_bt, stride_mask, mask_words, kvh, d, d_ok, TAIL_N, BLOCK_SIZE, True,
                                 HAS_MASK, EVEN_D, PRECISION, DOT_DTYPE)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    ok = row_ok[:, None] & d_ok[None, :]
    tl.store(out_ptr + split * stride_os + t[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=ok)
    if SPLIT:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(lse_ptr + split * stride_ls + t * stride_lt + head, lse, mask=row_ok)


def combine_block(splits: int) -> int:
    """The combine's block of splits for a launch of ``splits``: all of them, ``COMBINE_NARROW`` for
    a count up to it and ``MAX_SPLITS`` for any count above, so two compiled variants serve every
    launch the server makes, both compiled at its start (``warm_combine``: a variant per block size
    would compile mid-serving as a sequence's keys grew past a split count's threshold on an eager
    step); more only where a benchmark forces more splits."""
    if 0 < splits <= COMBINE_NARROW:
        return COMBINE_NARROW
    return max(MAX_SPLITS, triton.next_power_of_2(splits))


def warm_combine(device: torch.device, dtype: torch.dtype, heads: int, head_dim: int) -> None:
    """Compile the combine's variants (``combine_block``: the narrow block and ``MAX_SPLITS``) for
    partials of ``heads`` x ``head_dim`` and outputs of ``dtype``, as the attention launches them
    (the same strides, the same dependent launch), before serving. CUDA only."""
    q = torch.zeros(1, heads, head_dim, dtype=dtype, device=device)
    pdl = dependent(q, PDL_ALL)
    for splits in sorted({max(1, COMBINE_NARROW), MAX_SPLITS}):
        part = torch.zeros(splits, 1, heads, head_dim, dtype=torch.float32, device=device)
        lse = torch.zeros(splits, 1, heads, dtype=torch.float32, device=device)
        used = torch.full((1,), splits, dtype=torch.int32, device=device)
        _combine_kernel[(1, heads)](part, lse, used, q, splits, part.stride(0), part.stride(1), part.stride(2),
                                    lse.stride(0), lse.stride(1), q.stride(0), q.stride(1), head_dim,
                                    BLOCK_S=combine_block(splits), BLOCK_D=triton.next_power_of_2(head_dim),
                                    USE_GDC=pdl, **launch_options(pdl))


@triton.jit(do_not_specialize=["splits", "stride_ps", "stride_ls"])
def _combine_kernel(part_ptr, lse_ptr, used_ptr, out_ptr, splits, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
                    stride_ot, stride_oh, head_dim, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                    USE_GDC: tl.constexpr):
    """Merge one (token, head)'s split results (the first ``used[token]`` of the launch's ``splits``,
    at most ``BLOCK_S``) in one block: the partials' loads go out with the log-sum-exps', not after
    their maximum, nor a block of splits at a time (one round of loads; on an H200 the 8B's batch-1
    decode step 4.485 -> 4.451 ms at 4K, 5.316 -> 5.238 at 32K against blocks of 16 splits read
    twice: ``benchmarks/results/attention/combine_one_shot_h200/``). A token no program wrote
    (padding between a packed step's sequences) reads a count clamped to the launch's."""
    if USE_GDC:  # launched dependent (kernels/pdl.py): the splits' partials written first
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    splits = tl.minimum(tl.maximum(tl.load(used_ptr + t), 1), splits)
    d = tl.arange(0, BLOCK_D)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < splits
    lse = tl.load(lse_ptr + s * stride_ls + t * stride_lt + h, mask=s_ok, other=float("-inf"))
    part = tl.load(part_ptr + s[:, None] * stride_ps + t * stride_pt + h * stride_ph + d[None, :],
                   mask=s_ok[:, None] & (d[None, :] < head_dim), other=0.0)
    w = tl.where(s_ok & (lse != float("-inf")), tl.exp2(lse - tl.max(lse, 0)), 0.0)
    o = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < head_dim)

