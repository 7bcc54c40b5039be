"""The batch-invariant kernel set (``--exact``): every target row's bits independent of the step.

A token's logits come out the same whether it is decoded alone, verified inside a 64-token
tree, prefilled in any chunking, or batched with any other sequences: every step runs the
projections with the layer's norms and activation in their epilogues
(``kernels/fused_linear_triton.py``) on one row tile and tiles that depend on the weights' shapes
alone, the LM head uses one fixed matmul tile (``linear_exact``), attention walks keys in position
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


def with_row_tile(row_tile: int | None, exact_sums: bool = True) -> KernelSet:
    """The batch-invariant set with its projections on one ``row_tile``-row tile (``None``: the tile
    from the step's row count, as the fast path picks it). Any fixed tile keeps a row's bits
    independent of the step. With the sums of h^2 in fixed point (``exact_sums``) the tile's size
    should change no bit on an H200 either, where o_proj's and down's results did not depend on the
    tile (``benchmarks/row_tile_bits.py``; to be measured with the sums in fixed point). Triton's
    interpreter computes a dot per tile shape, so there only a fixed tile is invariant."""
    fixed = {"block_m": row_tile, "exact_sums": exact_sums}
    return dataclasses.replace(
        TRITON,
        prepare_attention=prepare_attention_exact,
        paged_attention=paged_attention_exact,
        linear=linear_exact,
        scaled_linear=functools.partial(scaled_linear_triton, **fixed),
        scaled_gate_up_silu=functools.partial(scaled_gate_up_silu_triton, **fixed),
        linear_add_norm=functools.partial(linear_add_norm_triton, **fixed),
        fused_rows=every_step,
        name="exact",  # (the engine captures graphs for the sets it knows by name)
    )


# As measured on the GPU (MT-bench and Vicuna-bench 80/80, README: Exact mode): one 64-row tile,
# plain sums (a fixed tile needs no more).
EXACT = with_row_tile(EXACT_ROW_TILE, exact_sums=False)
