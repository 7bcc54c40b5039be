"""The batch-invariant kernel set (``--exact``): every target row's bits independent of the step.

A token's logits come out the same whether it is decoded alone, verified inside a 64-token
tree, prefilled in any chunking, or batched with any other sequences: the projections and the
LM head use one fixed matmul tile (``linear_exact``), attention walks keys in position order in
fixed tiles and fixed chunks (``paged_attention_exact``), and RMSNorm, RoPE and the activation
are already computed row by row. So greedy speculative output equals target-only output in
bf16 too, as it does in float32.
"""

from __future__ import annotations

import dataclasses

from kernels.attention_exact import paged_attention_exact, prepare_attention_exact
from kernels.fused_linear import no_fused_rows
from kernels.linear_triton import linear_exact
from kernels.triton_set import TRITON

EXACT = dataclasses.replace(
    TRITON,
    prepare_attention=prepare_attention_exact,
    paged_attention=paged_attention_exact,
    linear=linear_exact,
    # Never the few-row fused projections: they scale a row after its matmul, so a decoded row
    # would differ from the same row inside a tree.
    fused_rows=no_fused_rows,
    name="exact",
)
