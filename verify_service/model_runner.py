"""One forward step of the target over a batch of sequence chunks.

The scheduler decides *what* runs (``SeqChunk`` per sequence); the runner lays it out as
flat device tensors plus ``AttentionMetadata`` (one host-to-device copy per tensor), runs
the model and returns logits only for the rows that need them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels import KernelSet
from kernels.metadata import AttentionMetadata
from verify_service.kv_cache import PagedKVCache
from verify_service.model import CausalLM


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """New tokens of one sequence for this step.

    Their KV goes to indices ``kv_start ..``; RoPE positions are ``kv_start ..`` unless
    ``positions`` is given (tree steps). ``new_token_mask`` [n, n] replaces causal
    visibility among the new tokens when given. ``logits_rows`` selects which of the new
    tokens get logits (e.g. the last one of a prefill chunk, all nodes of a tree).
    """

    token_ids: list[int]
    kv_start: int
    block_table: list[int]
    logits_rows: tuple[int, ...] = ()
    positions: list[int] | None = None
    new_token_mask: np.ndarray | None = None


@dataclass(frozen=True, slots=True)
class StepOutput:
    logits: torch.Tensor  # [sum(len(logits_rows)), vocab] float32, in chunk order
    hidden: torch.Tensor  # [T, hidden] final-normed hidden of every new token
    captured: torch.Tensor | None  # [T, k * hidden] EAGLE-3 features, when capture layers are set


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: PagedKVCache, kernels: KernelSet,
                 capture_layers: tuple[int, ...] = ()):
        self.model = model
        self.kv_cache = kv_cache
        self.kernels = kernels
        self.capture_layers = tuple(sorted(capture_layers))
        self.device = kv_cache.data.device

    def build_metadata(self, chunks: list[SeqChunk]) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flatten ``chunks`` into (input_ids [T], metadata, logits row indices [N])."""
        bs = self.kv_cache.block_size
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
        slots = tables[token_seq, kv_idx // bs] * bs + kv_idx % bs
        positions = np.concatenate([c.positions if c.positions is not None else
                                    np.arange(c.kv_start, c.kv_start + len(c.token_ids)) for c in chunks])
        max_q = int(q_lens.max())
        mask = self._new_token_mask(chunks, max_q)
        rows = np.concatenate([qsl[i] + np.asarray(c.logits_rows, dtype=np.int64)
                               for i, c in enumerate(chunks)])
        ids = np.concatenate([np.asarray(c.token_ids, dtype=np.int64) for c in chunks])
        dev = lambda a, dtype=torch.int64: torch.from_numpy(np.ascontiguousarray(a)).to(self.device, dtype)
        meta = AttentionMetadata(
            query_start_loc=dev(qsl), seq_lens=dev(seq_lens), block_tables=dev(tables),
            slot_mapping=dev(slots), positions=dev(positions), token_seq=dev(token_seq),
            token_q_idx=dev(token_q_idx), max_query_len=max_q, max_seq_len=int(seq_lens.max()),
            new_token_mask=None if mask is None else dev(mask, torch.bool))
        return dev(ids), self.kernels.prepare_attention(meta), dev(rows)

    @staticmethod
    def _new_token_mask(chunks: list[SeqChunk], max_q: int) -> np.ndarray | None:
        if all(c.new_token_mask is None for c in chunks):
            return None
        blocks = []
        for c in chunks:
            n = len(c.token_ids)
            m = c.new_token_mask if c.new_token_mask is not None else np.tril(np.ones((n, n), dtype=bool))
            blocks.append(np.pad(m.astype(bool), ((0, 0), (0, max_q - n))))
        return np.concatenate(blocks)

    @torch.inference_mode()
    def step(self, chunks: list[SeqChunk]) -> StepOutput:
        ids, meta, rows = self.build_metadata(chunks)
        out = self.model(ids, meta, self.kv_cache, self.kernels, self.capture_layers)
        return StepOutput(self.model.compute_logits(out.hidden[rows]), out.hidden, out.captured)
