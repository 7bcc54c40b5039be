"""GPU kernels, each next to its pure-torch reference with the same signature.

``select_kernels`` is the one dispatch point: the implementation is chosen once, when a
runner is constructed, never per call. Every entry of ``KernelSet`` is a plain function.
``REFERENCE`` holds the pure-torch references; ``kernels/triton_set.py`` the Triton set, which
replaces the entries that have a Triton kernel and keeps the references for the rest;
``kernels/exact_set.py`` the batch-invariant set of ``--exact`` (the Triton set with a fixed-tile
matmul and position-ordered attention).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch

from kernels import acceptance, attention, draft_rows, fused_linear, kv_compaction, norm, rope, sampling, tree

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KernelSet:
    prepare_attention: Callable  # AttentionMetadata -> AttentionMetadata, once per step
    linear: Callable  # (x, weight, bias=None) -> x @ weight.T (+ bias): the projections
    write_kv: Callable
    paged_attention: Callable
    apply_rope: Callable
    rope_write_kv: Callable  # RoPE on q/k + the KV write, fused
    rms_norm: Callable  # with the residual add
    silu_mul: Callable
    # A decode layer's projections with its norms and activation in their epilogues
    # (kernels/fused_linear.py), for steps of at most ``fused_rows(hidden_size)`` rows.
    scaled_linear: Callable
    scaled_gate_up_silu: Callable
    linear_add_norm: Callable
    logits_to_probs: Callable
    exponential_noise: Callable
    uniform_noise: Callable
    sample: Callable
    argmax: Callable  # logits [N, V] -> each row's greedy token, int64 [N]
    greedy_accept: Callable
    sampling_accept: Callable
    seeded_accept: Callable
    compaction_slots: Callable
    compact_kv: Callable
    packed_tree_mask: Callable  # (parents, num_nodes) -> the trees' ancestor masks, bit-packed
    sanitize_trees: Callable  # trees another process wrote -> checked trees or stand-ins, then valid flags (one tensor)
    tree_positions: Callable
    draft_topk: Callable
    expand_frontier: Callable  # a dynamic tree's level: candidates scored into the pool, the best kept
    best_nodes: Callable  # a dynamic tree's final nodes: the pool's best, parents first
    static_level: Callable  # a static tree's level: its nodes picked from the top-k into the pool
    extend_layout: Callable  # a draft extend's metadata from its row counts, on the device
    pack_rows: Callable  # a chained extend's fed rows packed front to back
    level_input: Callable  # a draft tree level's inputs: parents' outputs gathered, embeddings, both norms, mask rows
    proposal_layout: Callable  # a whole proposal's KV slots, positions and lengths from its rows and tables
    name: str
    fused_rows: Callable = fused_linear.no_fused_rows
    # The fused [q; k; v] projection with RoPE and the KV write in its epilogue (``scaled_qkv_rope``),
    # for the steps that take the fused projections; None: scaled_linear, then rope_write_kv.
    scaled_qkv_rope: Callable | None = None


REFERENCE = KernelSet(
    prepare_attention=attention.prepare_attention_ref,
    linear=torch.nn.functional.linear,
    write_kv=attention.write_kv_ref,
    paged_attention=attention.paged_attention_ref,
    apply_rope=rope.apply_rope_ref,
    rope_write_kv=rope.rope_write_kv_ref,
    rms_norm=norm.rms_norm_ref,
    silu_mul=norm.silu_mul_ref,
    scaled_linear=fused_linear.scaled_linear_ref,
    scaled_gate_up_silu=fused_linear.scaled_gate_up_silu_ref,
    linear_add_norm=fused_linear.linear_add_norm_ref,
    logits_to_probs=sampling.logits_to_probs_ref,
    exponential_noise=sampling.exponential_noise_ref,
    uniform_noise=sampling.uniform_noise_ref,
    sample=sampling.sample_ref,
    argmax=sampling.argmax_ref,
    greedy_accept=acceptance.greedy_accept_ref,
    sampling_accept=acceptance.sampling_accept_ref,
    seeded_accept=acceptance.seeded_accept_ref,
    compaction_slots=kv_compaction.compaction_slots_ref,
    compact_kv=kv_compaction.compact_kv_ref,
    packed_tree_mask=tree.packed_tree_mask_ref,
    sanitize_trees=tree.sanitize_trees_ref,
    tree_positions=tree.tree_positions_ref,
    draft_topk=tree.draft_topk_ref,
    expand_frontier=tree.expand_frontier_ref,
    best_nodes=tree.best_nodes_ref,
    static_level=tree.static_level_ref,
    extend_layout=draft_rows.extend_layout_ref,
    pack_rows=draft_rows.pack_rows_ref,
    level_input=draft_rows.level_input_ref,
    proposal_layout=draft_rows.proposal_layout_ref,
    name="reference",
)


KERNEL_CHOICES = ("auto", "triton", "reference")


# Whether ``auto`` picks the Triton set on CUDA (their parity tests pass natively on H100).
TRITON_BY_DEFAULT = True


def select_kernels(device: torch.device | str, kind: str = "auto", exact: bool = False,
                   exact_chunk: int | None = None) -> KernelSet:
    """The kernels for ``device``. ``reference``: the pure-torch references; ``triton``: the Triton
    set (on a CPU through Triton's interpreter, with ``TRITON_INTERPRET=1``: tests); ``auto``: the
    Triton set on CUDA where ``TRITON_BY_DEFAULT``, else the references. ``exact``: the
    batch-invariant set (``kernels.exact_set.EXACT``) for ``auto`` and ``triton``, its attention
    folding chunks of ``exact_chunk`` keys (default ``kernels.attention_exact.CHUNK``)."""
    if kind not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}, got {kind!r}")
    if exact:
        return _exact_kernels(device, kind, exact_chunk)
    if kind == "reference" or (kind == "auto" and not (TRITON_BY_DEFAULT and torch.device(device).type == "cuda")):
        return REFERENCE
    try:
        from kernels.triton_set import TRITON
    except ImportError as exc:  # triton is not installed
        if kind == "triton":
            raise RuntimeError(f"Triton kernels were asked for but triton does not import: {exc}") from exc
        log.warning("triton does not import (%s): the pure-torch reference kernels run on %s", exc, device)
        return REFERENCE
    return TRITON


# Whether an engine that leaves ``exact`` unset runs the batch-invariant set on CUDA with the Triton
# kernels (``exact_by_default``): its cost measured within 10% of tok/s at batch 1 and 64 (README, Exact
# mode), so greedy output with a draft is target-only output in bf16 by default. ``--no-exact`` opts out.
EXACT_BY_DEFAULT = True


def exact_by_default(device_type: str, kind: str) -> bool:
    """Whether an engine on ``device_type`` with kernels ``kind`` and ``exact`` unset runs the
    batch-invariant set: on CUDA unless the references are asked for (on a CPU the float32
    references already give target-only output)."""
    return EXACT_BY_DEFAULT and device_type == "cuda" and kind != "reference"


def exact_refusal(device_type: str, kind: str) -> str | None:
    """Why ``--exact`` cannot run with these kernels on this device type, or None."""
    if kind == "reference":
        return "runs batch-invariant Triton kernels: it contradicts --kernels reference"
    # On a CPU the float32 references already make speculative output equal target-only output;
    # Triton's interpreter (TRITON_INTERPRET=1) runs the exact kernels on a CPU, for tests.
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return (f"needs CUDA, got a {device_type} device: on a CPU the float32 reference kernels already give "
                "speculative output equal to target-only output (TRITON_INTERPRET=1 runs the exact kernels "
                "through Triton's interpreter, for tests)")
    return None


def _exact_kernels(device: torch.device | str, kind: str, chunk: int | None) -> KernelSet:
    refusal = exact_refusal(torch.device(device).type, kind)
    if refusal is not None:
        raise ValueError(f"--exact {refusal}")
    try:
        from kernels import exact_set
    except ImportError as exc:  # triton is not installed
        raise RuntimeError(f"--exact needs the Triton kernels but triton does not import: {exc}") from exc
    return exact_set.EXACT if chunk is None else exact_set.with_chunk(chunk)
