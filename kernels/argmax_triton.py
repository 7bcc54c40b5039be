"""Greedy tokens: the argmax of each row of logits (``argmax_ref``, ``torch.argmax``'s semantics), in two
short launches that spread one row over the GPU.

``torch.argmax`` of a single row reduces it in one block: one Llama-3 row of 128,256 float32 logits
took 27 us of an 8B decode step on an H200 (SmolLM2's 49,152 about 12 us). Here programs of
``CHUNK`` logits each find their chunk's best, and a second launch picks the row's best of those.

Order and ties are torch's: the largest value, NaN above everything (torch propagates it), the first
index among equals, -0.0 equal to +0.0. Each value maps to an int32 key whose signed order is the
float order (the sign bit set: the other bits flipped), so every comparison is an integer one and the
result is the same whatever the chunking: a row's token never depends on the batch it is in.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import PDL_ALL, dependent, launch_options

CHUNK = 2048  # logits a program of the first launch (8 KB of float32)


def argmax_triton(logits: torch.Tensor) -> torch.Tensor:
    """Index of each row's largest logit, int64 [N], for logits [N, V] (float32 or bfloat16; rows may
    be strided, columns contiguous). Allocates from shapes alone (no host sync): graph-capturable."""
    assert logits.dim() == 2 and logits.shape[1] > 0, f"logits [N, V], got {tuple(logits.shape)}"
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    n, v = logits.shape
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    chunk = min(CHUNK, triton.next_power_of_2(v))
    chunks = triton.cdiv(v, chunk)
    pdl = dependent(logits, PDL_ALL)
    single = chunks == 1
    keys = out if single else torch.empty(n, chunks, dtype=torch.int32, device=logits.device)
    first = out if single else torch.empty(n, chunks, dtype=torch.int32, device=logits.device)
    _chunk_kernel[(n, chunks)](logits, keys, first, out, v, logits.stride(0), chunks, CHUNK=chunk, SINGLE=single,
                               USE_GDC=pdl, num_warps=4, **launch_options(pdl))
    if not single:
        _merge_kernel[(n,)](keys, first, out, chunks, BLOCK_C=triton.next_power_of_2(chunks), USE_GDC=pdl,
                            num_warps=1 if chunks <= 128 else 4, **launch_options(pdl))
    return out


@triton.jit
def _order_key(x):
    """int32 keys in the float order of ``x`` (float32): NaN highest, -0.0 as +0.0."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(x != x, 0x7FFFFFFF, key)


@triton.jit(do_not_specialize=["v", "stride_row", "chunks"])
def _chunk_kernel(x_ptr, keys_ptr, first_ptr, out_ptr, v, stride_row, chunks, CHUNK: tl.constexpr,
                  SINGLE: tl.constexpr, USE_GDC: tl.constexpr):
    if USE_GDC:  # launched dependent (kernels/pdl.py): the logits written first
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    ok = cols < v
    x = tl.load(x_ptr + row * stride_row + cols, mask=ok, other=0.0).to(tl.float32)
    key = tl.where(ok, _order_key(x), -2147483648)  # past the row: below every value, -inf included
    best = tl.max(key, 0)
    at = tl.min(tl.where(key == best, cols, 2147483647), 0)
    if SINGLE:
        tl.store(out_ptr + row, at.to(tl.int64))
    else:
        tl.store(keys_ptr + row * chunks + c, best)
        tl.store(first_ptr + row * chunks + c, at)


@triton.jit(do_not_specialize=["chunks"])
def _merge_kernel(keys_ptr, first_ptr, out_ptr, chunks, BLOCK_C: tl.constexpr, USE_GDC: tl.constexpr):
    if USE_GDC:  # the chunks' bests written first
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    ok = c < chunks
    key = tl.load(keys_ptr + row * chunks + c, mask=ok, other=-2147483648)
    at = tl.load(first_ptr + row * chunks + c, mask=ok, other=2147483647)
    best = tl.max(key, 0)
    # (chunks hold increasing columns: the smallest index among the best is the row's first)
    tl.store(out_ptr + row, tl.min(tl.where(key == best, at, 2147483647), 0).to(tl.int64))
