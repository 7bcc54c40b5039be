"""The batch-invariant kernel set (``--exact``): every target row's bits independent of the step.

A token's logits come out the same whether it is decoded alone, verified inside a 64-token
tree, prefilled in any chunking, or batched with any other sequences: every step runs the
projections with the layer's norms and activation in their epilogues
(``kernels/fused_linear_triton.py``), a row's products accumulated in K order and its sums of
squares in fixed point, the LM head uses one fixed matmul tile (``linear_exact``), attention walks keys in position
order in fixed tiles and fixed chunks (``paged_attention_exact``), and RMSNorm and RoPE are
computed row by row. So greedy speculative output equals target-only output in bf16 too, as it
does in float32.
"""

from __future__ import annotations

import dataclasses
import functools

from kernels.attention_exact import paged_attention_exact, prepare_attention_exact
from kernels.fused_linear_triton import (EXACT_ROW_TILE, every_step, linear_add_norm_triton,
                                         scaled_gate_up_silu_triton, scaled_linear_triton)
from kernels.linear_triton import linear_exact
from kernels import KernelSet
from kernels.triton_set import TRITON


def _gpu_row_count_tile(fn, exact_sums: bool):
    """``fn`` on the fast path's row tile (from the step's row count) on a GPU, and on the fixed
    ``EXACT_ROW_TILE`` in Triton's interpreter: there each dot is rounded per K step, and the K
    step follows the row tile (``row_linear_config``), so only a fixed tile is invariant."""
    @functools.wraps(fn)
    def call(x, *args, **kwargs):
        return fn(x, *args, block_m=None if x.is_cuda else EXACT_ROW_TILE, exact_sums=exact_sums, **kwargs)
    return call


def with_row_tile(row_tile: int | None, exact_sums: bool = True) -> KernelSet:
    """The batch-invariant set with its projections on one ``row_tile``-row tile, or (``None``) on
    the tile from the step's row count, as the fast path picks it, with the sums of h^2 in fixed
    point (``exact_sums``). Any fixed tile keeps a row's bits independent of the step. The tile
    from the row count does too on an H200 once the sums are in fixed point: the tensor cores
    accumulate a row's products in K order whatever the row and K tiles
    (``benchmarks/row_tile_bits.py --exact-sums``: 0 of 64 cases differ, 52a76bf), and the GPU
    tests check it bitwise."""
    if row_tile is None:
        def project(fn):
            return _gpu_row_count_tile(fn, exact_sums)
    else:
        def project(fn):
            return functools.partial(fn, block_m=row_tile, exact_sums=exact_sums)
    return dataclasses.replace(
        TRITON,
        prepare_attention=prepare_attention_exact,
        paged_attention=paged_attention_exact,
        linear=linear_exact,
        scaled_linear=project(scaled_linear_triton),
        scaled_gate_up_silu=project(scaled_gate_up_silu_triton),
        linear_add_norm=project(linear_add_norm_triton),
        fused_rows=every_step,
        name="exact",  # (the engine captures graphs for the sets it knows by name)
    )


# The projections on the fast path's row tiles with the sums in fixed point (H200, 52a76bf,
# decode_baseline.py --exact-row-tile 0: the 8B batch-1 step at 4K 4.893 ms against 5.409 on one
# fixed 64-row tile, 4.553 on the fast path; README: Exact mode).
EXACT = with_row_tile(None)
