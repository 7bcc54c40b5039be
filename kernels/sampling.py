"""Turning logits into tokens: temperature, top-k, top-p, and a sync-free sampler.

Sampling uses the exponential race: with E_i ~ Exp(1) independent,
``argmax_i p_i / E_i`` is distributed exactly as ``p`` (no cumsum, no ``multinomial``,
no ``.item()``). The noise for a token depends only on (request seed, token position),
so a request's samples do not depend on which other requests share its batch.
"""

from __future__ import annotations

import torch

from kernels.host_copy import to_device

_MASK64 = (1 << 64) - 1
_UNIFORM_STREAM = 0x5DEECE66D  # xor-ed into the seed so uniforms and Exp(1) noise never coincide


def mix_seed(seed: int, offset: int) -> int:
    """SplitMix64 of (seed, offset): a well-spread 63-bit generator seed."""
    z = (seed * 0x9E3779B97F4A7C15 + offset * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 that holds it."""
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch shifts arithmetically)."""
    return torch.bitwise_right_shift(z, s) & ((1 << (64 - s)) - 1)


def _counter_uniform(keys: list[int], n: int, device) -> torch.Tensor:
    """float64 [N, n] in (0, 1): entry [r, i] is SplitMix64(keys[r] + (i + 1) * golden) to 53 bits.

    A counter-based generator: one batched computation for every row (no generator object, no
    launch per row), the same bits on every device (integer arithmetic wrapping mod 2^64)."""
    key = to_device([_signed(k) for k in keys], torch.int64, device)  # (no host sync)
    z = key[:, None] + (torch.arange(1, n + 1, dtype=torch.int64, device=device) * _GOLDEN)[None, :]
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    return (_shr(z, 11).to(torch.float64) + 0.5) * 2.0 ** -53


def exponential_noise_ref(seeds: list[int], offsets: list[int], vocab_size: int, device) -> torch.Tensor:
    """Exp(1) noise [N, vocab] float32; row n is a pure function of (seeds[n], offsets[n])."""
    if not seeds:
        return torch.empty(0, vocab_size, device=device)
    u = _counter_uniform([mix_seed(s, o) for s, o in zip(seeds, offsets)], vocab_size, device)
    return (-torch.log(u)).to(torch.float32)


def uniform_noise_ref(seeds: list[int], offsets: list[int], n: int, device) -> torch.Tensor:
    """U(0, 1) noise [N, n] float32 for acceptance tests; a stream separate from the Exp(1) noise."""
    if not seeds:
        return torch.empty(0, n, device=device)
    u = _counter_uniform([mix_seed(s ^ _UNIFORM_STREAM, o) for s, o in zip(seeds, offsets)], n, device)
    return u.to(torch.float32).clamp(max=1.0 - 2.0 ** -24)  # float32 would round the top ones up to 1


def logits_to_probs_ref(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                        top_k: torch.Tensor, any_filtered: bool | None = None) -> torch.Tensor:
    """Sampling distribution [N, V] float32 per row's parameters.

    temperature == 0 gives a one-hot at the argmax (greedy), so greedy and sampled rows share
    one path. top_k == 0 and top_p == 1 disable those filters; such a row is a plain softmax,
    computed the same way whatever the other rows ask (a row's bits never depend on its batch).
    ``any_filtered``: False when the caller knows no row filters, which skips the vocabulary
    sort altogether; None: not known (rows are told apart on the device).
    """
    logits = logits.float()
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    probs = scaled.softmax(dim=-1)
    if any_filtered is not False:
        filtered = (top_k > 0) | (top_p < 1.0)
        probs = torch.where(filtered[:, None], _filtered_probs(scaled, top_p, top_k), probs)
    one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


def _filtered_probs(scaled: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p over the sorted vocabulary, renormalised: [N, V]."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(scaled.shape[-1], device=scaled.device)[None, :]
    k = torch.where(top_k > 0, top_k, scaled.shape[-1])[:, None]
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it >= top_p.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p[:, None], 0.0)
    sorted_probs[:, 0] = torch.where(sorted_probs[:, 0] > 0, sorted_probs[:, 0], 1.0)
    probs = torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)
    return probs / probs.sum(dim=-1, keepdim=True)


def argmax_ref(logits: torch.Tensor) -> torch.Tensor:
    """Greedy tokens: the index of each row's largest logit, int64 [N] for logits [N, V] (NaN the
    largest, the first index among equals)."""
    return logits.argmax(dim=-1)


def sample_ref(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Tokens [N] int64 drawn from ``probs`` [N, V] with Exp(1) ``noise`` [N, V] (exponential race)."""
    return (probs / noise).argmax(dim=-1)
