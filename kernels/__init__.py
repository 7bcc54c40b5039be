"""GPU kernels, each next to its pure-torch reference with the same signature.

``select_kernels`` is the one dispatch point: the implementation is chosen once, when a
runner is constructed, never per call. Every entry of ``KernelSet`` is a plain function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kernels import acceptance, attention, kv_compaction, rope, sampling, tree


@dataclass(frozen=True, slots=True)
class KernelSet:
    prepare_attention: Callable  # AttentionMetadata -> AttentionMetadata, once per step
    write_kv: Callable
    paged_attention: Callable
    apply_rope: Callable
    logits_to_probs: Callable
    exponential_noise: Callable
    uniform_noise: Callable
    sample: Callable
    greedy_accept: Callable
    sampling_accept: Callable
    compaction_slots: Callable
    compact_kv: Callable
    tree_mask: Callable
    tree_positions: Callable
    draft_topk: Callable
    name: str


REFERENCE = KernelSet(
    prepare_attention=attention.prepare_attention_ref,
    write_kv=attention.write_kv_ref,
    paged_attention=attention.paged_attention_ref,
    apply_rope=rope.apply_rope_ref,
    logits_to_probs=sampling.logits_to_probs_ref,
    exponential_noise=sampling.exponential_noise_ref,
    uniform_noise=sampling.uniform_noise_ref,
    sample=sampling.sample_ref,
    greedy_accept=acceptance.greedy_accept_ref,
    sampling_accept=acceptance.sampling_accept_ref,
    compaction_slots=kv_compaction.compaction_slots_ref,
    compact_kv=kv_compaction.compact_kv_ref,
    tree_mask=tree.tree_mask_ref,
    tree_positions=tree.tree_positions_ref,
    draft_topk=tree.draft_topk_ref,
    name="reference",
)


def select_kernels(device: torch.device | str) -> KernelSet:
    """The kernels for ``device``. Only the pure-torch references exist so far, on every device."""
    del device  # CUDA kernels register here as they land; until then the references run everywhere.
    return REFERENCE
