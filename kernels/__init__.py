"""GPU kernels, each next to its pure-torch reference with the same signature.

``select_kernels`` is the one dispatch point: the implementation is chosen once, when a
runner is constructed, never per call. Every entry of ``KernelSet`` is a plain function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kernels import attention, rope, sampling


@dataclass(frozen=True, slots=True)
class KernelSet:
    prepare_attention: Callable  # AttentionMetadata -> AttentionMetadata, once per step
    write_kv: Callable
    paged_attention: Callable
    apply_rope: Callable
    logits_to_probs: Callable
    exponential_noise: Callable
    sample: Callable
    name: str


REFERENCE = KernelSet(
    prepare_attention=attention.prepare_attention_ref,
    write_kv=attention.write_kv_ref,
    paged_attention=attention.paged_attention_ref,
    apply_rope=rope.apply_rope_ref,
    logits_to_probs=sampling.logits_to_probs_ref,
    exponential_noise=sampling.exponential_noise_ref,
    sample=sampling.sample_ref,
    name="reference",
)


def select_kernels(device: torch.device | str) -> KernelSet:
    """The kernels for ``device``. Only the pure-torch references exist so far, on every device."""
    del device  # CUDA kernels register here as they land; until then the references run everywhere.
    return REFERENCE
