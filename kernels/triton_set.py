"""The Triton kernel set: each entry with a Triton kernel replaces its reference (imports triton)."""

from __future__ import annotations

import dataclasses

from kernels import REFERENCE
from kernels.attention_triton import paged_attention_triton, prepare_attention_triton, write_kv_triton
from kernels.fused_linear_triton import (fused_rows, linear_add_norm_triton, scaled_gate_up_silu_triton,
                                         scaled_linear_triton, scaled_qkv_rope_triton)
from kernels.fused_triton import rms_norm_triton, rope_write_kv_triton, silu_mul_triton
from kernels.draft_rows_triton import (extend_layout_triton, level_input_triton, pack_rows_triton,
                                       proposal_layout_triton)
from kernels.argmax_triton import argmax_triton
from kernels.acceptance_triton import compaction_slots_triton, greedy_accept_triton
from kernels.topk_triton import draft_topk_triton
from kernels.tree_triton import (best_nodes_triton, expand_frontier_triton, packed_tree_mask_triton,
                                 sanitize_trees_triton, static_level_triton)

TRITON = dataclasses.replace(
    REFERENCE,
    prepare_attention=prepare_attention_triton,
    write_kv=write_kv_triton,
    paged_attention=paged_attention_triton,
    rms_norm=rms_norm_triton,
    silu_mul=silu_mul_triton,
    scaled_linear=scaled_linear_triton,
    scaled_gate_up_silu=scaled_gate_up_silu_triton,
    linear_add_norm=linear_add_norm_triton,
    fused_rows=fused_rows,
    scaled_qkv_rope=scaled_qkv_rope_triton,
    rope_write_kv=rope_write_kv_triton,
    draft_topk=draft_topk_triton,
    argmax=argmax_triton,
    greedy_accept=greedy_accept_triton,
    compaction_slots=compaction_slots_triton,
    packed_tree_mask=packed_tree_mask_triton,
    sanitize_trees=sanitize_trees_triton,
    expand_frontier=expand_frontier_triton,
    static_level=static_level_triton,
    best_nodes=best_nodes_triton,
    extend_layout=extend_layout_triton,
    pack_rows=pack_rows_triton,
    level_input=level_input_triton,
    proposal_layout=proposal_layout_triton,
    name="triton",
)
