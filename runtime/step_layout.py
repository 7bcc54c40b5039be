"""Flattening one step's per-sequence chunks into device tensors and ``AttentionMetadata``.

Shared by the target (verify service) and the draft head (draft service): both run paged
attention over their own cache with the same layout. One host-to-device copy per tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels import KernelSet
from kernels.metadata import AttentionMetadata


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """New tokens of one sequence for this step.

    Their KV goes to indices ``kv_start ..``; RoPE positions are ``kv_start ..`` unless
    ``positions`` is given (tree steps). ``custom_mask`` [n, m] replaces causal visibility
    over the KV indices ``mask_start .. mask_start + m`` (default ``mask_start`` = kv_start;
    every index before it is visible to all new tokens). ``logits_rows`` selects which of
    the new tokens get logits (e.g. the last one of a prefill chunk, all nodes of a tree).
    """

    token_ids: list[int] | np.ndarray
    kv_start: int
    block_table: list[int]
    logits_rows: tuple[int, ...] | np.ndarray = ()
    positions: list[int] | np.ndarray | None = None
    custom_mask: np.ndarray | None = None
    mask_start: int | None = None


@dataclass(frozen=True, slots=True)
class StepLayout:
    input_ids: torch.Tensor  # int64 [T]
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # int64 [N], rows of the flat batch that need logits
    query_start_loc: np.ndarray  # host copy of meta.query_start_loc, for slicing outputs


def layout_step(chunks: list[SeqChunk], block_size: int, device: torch.device, kernels: KernelSet) -> StepLayout:
    """Flatten ``chunks`` into one batch of T tokens with its attention metadata."""
    q_lens = np.array([len(c.token_ids) for c in chunks], dtype=np.int64)
    starts = np.array([c.kv_start for c in chunks], dtype=np.int64)
    seq_lens = starts + q_lens
    qsl = np.concatenate(([0], np.cumsum(q_lens)))
    token_seq = np.repeat(np.arange(len(chunks)), q_lens)
    token_q_idx = np.arange(qsl[-1]) - qsl[token_seq]
    kv_idx = starts[token_seq] + token_q_idx
    width = max(len(c.block_table) for c in chunks)
    tables = np.zeros((len(chunks), width), dtype=np.int64)
    for i, c in enumerate(chunks):
        tables[i, : len(c.block_table)] = c.block_table
    slots = tables[token_seq, kv_idx // block_size] * block_size + kv_idx % block_size
    positions = np.concatenate([np.asarray(c.positions) if c.positions is not None else
                                np.arange(c.kv_start, c.kv_start + len(c.token_ids)) for c in chunks])
    max_q = int(q_lens.max())
    mask, mask_start = _custom_mask(chunks)
    rows = np.concatenate([qsl[i] + np.asarray(c.logits_rows, dtype=np.int64) for i, c in enumerate(chunks)])
    ids = np.concatenate([np.asarray(c.token_ids, dtype=np.int64) for c in chunks])

    def dev(a, dtype=torch.int64):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device, dtype)

    meta = AttentionMetadata(
        query_start_loc=dev(qsl), seq_lens=dev(seq_lens), block_tables=dev(tables),
        slot_mapping=dev(slots), positions=dev(positions), token_seq=dev(token_seq),
        token_q_idx=dev(token_q_idx), max_query_len=max_q, max_seq_len=int(seq_lens.max()),
        custom_mask=None if mask is None else dev(mask, torch.bool),
        mask_start=None if mask is None else dev(mask_start))
    return StepLayout(dev(ids), kernels.prepare_attention(meta), dev(rows), qsl)


def _custom_mask(chunks: list[SeqChunk]) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Stack per-chunk masks into [T, max_cols]; chunks without one get their causal mask."""
    if all(c.custom_mask is None for c in chunks):
        return None, None
    starts, masks = [], []
    for c in chunks:
        n = len(c.token_ids)
        if c.custom_mask is None:
            starts.append(c.kv_start)
            masks.append(np.tril(np.ones((n, n), dtype=bool)))
        else:
            starts.append(c.kv_start if c.mask_start is None else c.mask_start)
            masks.append(np.asarray(c.custom_mask, dtype=bool))
    cols = max(m.shape[1] for m in masks)
    stacked = np.concatenate([np.pad(m, ((0, 0), (0, cols - m.shape[1]))) for m in masks])
    return stacked, np.asarray(starts, dtype=np.int64)
