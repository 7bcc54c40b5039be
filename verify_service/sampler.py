"""Choosing next tokens for a batch of sequences, each with its own sampling parameters."""

from __future__ import annotations

import torch

from kernels import KernelSet
from kernels.host_copy import to_device
from verify_service.sequence import Sequence


class Sampler:
    def __init__(self, kernels: KernelSet, device: torch.device):
        self.kernels = kernels
        self.device = device

    def probs(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The target distribution [N, V] each row samples from (one-hot for greedy rows)."""
        params = [s.params for s in seqs]
        as_tensor = lambda xs, dtype: to_device(xs, dtype, self.device)  # (no host sync)
        return self.kernels.logits_to_probs(
            logits, as_tensor([p.temperature for p in params], torch.float32),
            as_tensor([p.top_p for p in params], torch.float32),
            as_tensor([p.top_k for p in params], torch.int64),
            any_filtered=any(p.top_k > 0 or p.top_p < 1.0 for p in params))

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], greedy: torch.Tensor | None = None) -> torch.Tensor:
        """Next token of each sequence, int64 [N] on the device (no sync); row n is ``seqs[n]``'s.
        ``greedy``: the rows' argmax if the step computed it already (its graph did)."""
        if all(s.params.greedy for s in seqs):
            return greedy if greedy is not None else self.kernels.argmax(logits)
        # Noise keyed by (seed, index of the token being drawn): batch-independent.
        noise = self.kernels.exponential_noise([s.seed for s in seqs], [s.num_tokens for s in seqs],
                                               logits.shape[-1], self.device)
        return self.kernels.sample(self.probs(logits, seqs), noise)
