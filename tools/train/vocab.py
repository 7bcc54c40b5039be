"""The draft vocabulary: the target tokens the draft may propose, chosen by frequency."""

from __future__ import annotations

from typing import Iterable

import torch

from common.errors import InvalidRequestError


def token_counts(sequences: Iterable[list[int]], vocab_size: int) -> torch.Tensor:
    """How often each target id occurs in ``sequences`` -> int64 [vocab]."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ids in sequences:
        if ids:
            counts += torch.bincount(torch.tensor(ids, dtype=torch.int64), minlength=vocab_size)
    return counts


def select_draft_vocab(counts: torch.Tensor, draft_vocab_size: int,
                       always: Iterable[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for the ``draft_vocab_size`` most frequent ids (``always`` ones included).

    Draft ids follow ascending target ids; d2t holds offsets (target = draft + d2t[draft])
    and t2d marks the chosen target ids. Ties break towards lower ids (deterministic).
    """
    vocab = counts.numel()
    if not 0 < draft_vocab_size <= vocab:
        raise InvalidRequestError("draft_vocab_size", f"must be in [1, {vocab}] (the target vocabulary), "
                                                      f"got {draft_vocab_size}")
    score = counts.double().clone()
    forced = torch.tensor(sorted(set(always)), dtype=torch.int64)
    if forced.numel() > draft_vocab_size:
        raise InvalidRequestError("draft_vocab_size", f"{forced.numel()} special tokens do not fit in {draft_vocab_size}")
    score[forced] = float("inf")
    order = torch.argsort(-score, stable=True)  # stable: equal counts keep ascending ids
    chosen = order[:draft_vocab_size].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    return chosen - torch.arange(draft_vocab_size), t2d
