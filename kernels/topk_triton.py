"""Triton top-k of the draft distribution: ``kernels.tree.draft_topk_ref``'s signature and results.

A tree level asks for the top ``k`` (about 10) of each fed node's ~32K draft log-probs. torch's
top-k over such rows costs a radix select of several passes (~15 us for a level of ten rows on an
H100), and the log-softmax, the chunked variant's second top-k, its gathers and the d2t map add a
kernel each. Here two kernels do all of it::

    chunks:  one program per (row, chunk of BLOCK entries): the chunk's max and sum of exp (its
             share of the row's log-sum-exp) and its own top k (k rounds of max, first index on
             ties, the pick masked out)                               -> k candidates a chunk
    merge:   one program per row: the row's log-sum-exp from the chunks' shares, the top k of
             the candidates, log-prob = logit - lse, target id = draft id + d2t[draft id]

Every chunk's top k holds every entry of the row's top k that lies in it, so the merge picks the
row's top k. Equal values go to the lower draft id (the reference's order for ties is torch's,
unspecified). No host sync, outputs allocated from shapes alone: the calls are captured in the
draft's CUDA graphs.

Each round of the merge is one max over int64 keys that pack a candidate's value (its float32 bits
made order-preserving) above its id (complemented: on equal values the lower id is the larger key).
It was three reductions a round (the max, the lowest id holding it, its position): the merge of a
batch-1 level took 8.4 us of a tree step's draft on an H100, ten rounds over 1,250 candidates (the
launch pair 13.1 -> 11.4 us). The chunk kernel keeps 32-bit reductions: there int64 keys made the
pair slower at 160 rows and more (41 -> 49 us, 141 -> 173 at 640 rows; ``topk_ab_h100.json``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kernels.pdl import small_launch

# The launch shape, from a sweep on an H100 (``benchmarks/topk_sweep.py``, 32K draft vocabulary, k = 10,
# ``benchmarks/results/speculation/topk_sweep_h100_1722a8f.json``): one-warp programs of 256 entries (125
# chunks a row) against 2048-entry programs of 8 warps: 13.2 against 13.3 us a launch pair for a batch-1
# level's 10 rows, 41 against 51 for 160 rows (batch 16), 141 against 178 for 640 (batch 64). A one-warp
# program's k rounds of max reduce within its warp, with no shared-memory round trip.
BLOCK = 256  # entries a chunk program reads
CHUNK_WARPS = 1  # warps of a chunk program
MERGE_WARPS = 4


def draft_topk_triton(logits: torch.Tensor, k: int, d2t: torch.Tensor, block: int | None = None,
                      chunk_warps: int | None = None, merge_warps: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(target ids int64 [M, k], log-probs float32 [M, k]) of ``logits`` [M, Vd] (any float dtype,
    rows may be strided, entries contiguous), descending; ``d2t`` int64 [Vd]: draft id -> offset.
    ``block``, ``chunk_warps``, ``merge_warps``: the launch shape (default: the module's; a sweep,
    ``benchmarks/topk_sweep.py``, tries others: the results never depend on them)."""
    m, v = logits.shape
    assert 0 < k <= v, f"top-k {k} over a draft vocabulary of {v}"
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    ids = torch.empty(m, k, dtype=torch.int64, device=dev)
    lp = torch.empty(m, k, dtype=torch.float32, device=dev)
    if m == 0:
        return ids, lp
    block = min(block or BLOCK, triton.next_power_of_2(v))
    chunks = triton.cdiv(v, block)
    chunk_warps = chunk_warps or CHUNK_WARPS
    cand_vals = torch.empty(m, chunks * k, dtype=torch.float32, device=dev)
    cand_ids = torch.empty(m, chunks * k, dtype=torch.int32, device=dev)
    shares = torch.empty(m, chunks, 2, dtype=torch.float32, device=dev)  # (max, sum of exp(x - max))
    _chunk_topk_kernel[(m, chunks)](logits, logits.stride(0), v, cand_vals, cand_ids, shares, chunks,
                                    K=k, BLOCK=block, num_warps=chunk_warps, **small_launch(logits))
    width = triton.next_power_of_2(chunks * k)
    _merge_topk_kernel[(m,)](cand_vals, cand_ids, shares, chunks, v, d2t, ids, lp, K=k,
                             WIDTH=width, CHUNKS=triton.next_power_of_2(chunks), num_warps=merge_warps or MERGE_WARPS,
                             **small_launch(cand_vals))
    return ids, lp


@triton.jit
def _chunk_topk_kernel(x_ptr, stride_row, v, cand_vals, cand_ids, shares, chunks, K: tl.constexpr,
                       BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    if USE_GDC:  # launched dependent (kernels/pdl.py): wait before any load, store or return
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    ok = cols < v
    x = tl.load(x_ptr + row * stride_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
    top = tl.max(x, 0)
    finite_top = tl.where(top == float("-inf"), 0.0, top)  # a chunk of -inf only: sum 0, no NaN
    s = tl.sum(tl.where(ok, tl.exp(x - finite_top), 0.0), 0)
    tl.store(shares + (row * chunks + c) * 2, finite_top)
    tl.store(shares + (row * chunks + c) * 2 + 1, s)
    out = row * chunks * K + c * K
    free = ok  # entries not picked yet (a chunk with fewer than K entries repeats none: its extra
    for i in tl.static_range(K):  # picks are -inf at a padding index, clamped below)
        best = tl.max(tl.where(free, x, float("-inf")), 0)
        at = tl.min(tl.where(free & (x == best), cols, 2147483647), 0)  # the first index holding it
        at = tl.minimum(at, v)  # none free: the padding index v, never merged ahead of a real entry
        tl.store(cand_vals + out + i, tl.where(at < v, best, float("-inf")))
        tl.store(cand_ids + out + i, at.to(tl.int32))
        free = free & (cols != at)


NO_KEY = tl.constexpr(-9223372036854775807)  # below every entry's key


@triton.jit
def _key(x, ids):
    """int64 keys ordered as (value x, then lower id first): the float32 bits of x flipped so that
    their signed order is the values' (negatives: all but the sign bit), above 2^31 - 1 - id."""
    bits = tl.where(x == 0.0, 0.0, x.to(tl.float32)).to(tl.int32, bitcast=True)  # -0.0 as 0.0: equal values
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - ids.to(tl.int64))


@triton.jit
def _key_value(key):
    ordered = (key >> 32).to(tl.int32)
    return (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _key_id(key):
    return 0x7FFFFFFF - (key & 0x7FFFFFFF)


@triton.jit
def _merge_topk_kernel(cand_vals, cand_ids, shares, chunks, v, d2t_ptr, ids_ptr, lp_ptr, K: tl.constexpr,
                       WIDTH: tl.constexpr, CHUNKS: tl.constexpr, USE_GDC: tl.constexpr):
    if USE_GDC:  # launched dependent (kernels/pdl.py): wait before any load, store or return
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, CHUNKS)
    has = j < chunks
    cmax = tl.load(shares + (row * chunks + j) * 2, mask=has, other=float("-inf"))
    csum = tl.load(shares + (row * chunks + j) * 2 + 1, mask=has, other=0.0)
    top = tl.max(cmax, 0)
    lse = top + tl.log(tl.sum(tl.where(has, csum * tl.exp(cmax - top), 0.0), 0))
    n = chunks * K
    w = tl.arange(0, WIDTH)
    ok = w < n
    vals = tl.load(cand_vals + row * n + w, mask=ok, other=float("-inf"))
    cids = tl.load(cand_ids + row * n + w, mask=ok, other=0)
    # A real entry is one chunk's candidate once; a chunk's padding (id v, -inf) repeats, and ranks
    # below every real entry (a row has k real ones at least: k > v is refused).
    keys = tl.where(ok, _key(vals, cids), NO_KEY)
    for i in tl.static_range(K):
        best = tl.max(keys, 0)
        d = tl.minimum(_key_id(best), v - 1)  # (in range whatever was left)
        tl.store(ids_ptr + row * K + i, d + tl.load(d2t_ptr + d))
        tl.store(lp_ptr + row * K + i, tl.minimum(_key_value(best) - lse, 0.0))  # (the reference's clamp)
        keys = tl.where(keys == best, NO_KEY, keys)
