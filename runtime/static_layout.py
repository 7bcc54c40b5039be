"""A graphed step's inputs at fixed device addresses: ``Bucket`` (the shape a graph is captured for) and
``StaticLayout`` (its input buffers, filled by the host each step and sent in one copy). The same
layout as ``step_layout.py``'s, written into buffers a captured graph reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.metadata import AttentionMetadata
from runtime.step_layout import ALIGN, SeqChunk

_UNKNOWN = object()  # a host table row whose content is not kept (rewritten at the next fill)


@dataclass(frozen=True, slots=True)
class Bucket:
    """The shape a graphed step is captured for: up to ``seqs`` sequences of up to ``tokens`` new
    tokens each; ``tree``: with a packed ancestor mask (verification), else one decode token each.
    ``ragged``: causal chunks of any lengths (prompt steps), ``tokens`` in all, logits for at most
    one row a chunk (``StaticLayout.logit_rows``)."""

    seqs: int
    tokens: int
    tree: bool
    ragged: bool = False

    @property
    def num_tokens(self) -> int:
        return self.tokens if self.ragged else self.seqs * self.tokens

    @property
    def mask_words(self) -> int:
        return -(-self.tokens // 32) if self.tree else 0


class StaticLayout:
    """A graphed step's inputs at fixed device addresses, sized for one ``Bucket``.

    One int64 device buffer holds every input (ids, positions, slots, tables, lengths and the
    packed mask); ``fill`` writes a step into its pinned host twin and sends it in one copy.
    Padding: sequences past the step's own have no tokens (``query_start_loc`` repeats) and
    length 0; token rows past the step's own write no KV (slot -1). Outputs of padding rows
    are garbage that no one reads. ``meta.max_seq_len`` is the cache's capacity, so the
    attention kernel's grid never depends on a step's lengths. A ragged bucket's layout also holds
    the rows whose logits the graph computes (``logit_rows``: each chunk's, in order; padding row 0).
    """

    def __init__(self, bucket: Bucket, table_width: int, max_seq_len: int, block_size: int, device: torch.device):
        self.bucket, self.block_size, self.table_width = bucket, block_size, table_width
        self.max_seq_len = max_seq_len
        B, T, W = bucket.seqs, bucket.num_tokens, table_width
        mask_int64 = -(-T * bucket.mask_words // 2)  # int32 words, two to an int64
        shapes = {"qsl": (B + 1,), "seq_lens": (B,), "tables": (B, W), "slots": (T,), "positions": (T,),
                  "token_seq": (T,), "q_idx": (T,), "ids": (T,), "mask_start": (B,), "mask": (mask_int64,),
                  "logit_rows": (B if bucket.ragged else 0,)}
        total = sum(-(-int(np.prod(s)) // ALIGN) * ALIGN for s in shapes.values())  # aligned as Staging's
        self.device_buffer = torch.zeros(total, dtype=torch.int64, device=device)
        self.host_buffer = torch.zeros(total, dtype=torch.int64, pin_memory=device.type == "cuda")
        host = self.host_buffer.numpy()
        self.host: dict[str, np.ndarray] = {}
        dev: dict[str, torch.Tensor] = {}
        at = 0
        for name, shape in shapes.items():
            n = int(np.prod(shape))
            self.host[name] = host[at:at + n].reshape(shape)
            dev[name] = self.device_buffer[at:at + n].view(shape)
            at += -(-n // ALIGN) * ALIGN
        words = bucket.mask_words
        self._mask_bytes = self.host["mask"].view(np.uint8)[:T * words * 4].reshape(T, words * 4) if words else None
        mask = dev["mask"].view(torch.int32)[:T * words].view(T, words) if words else None
        self.input_ids = dev["ids"]
        self.logit_rows = dev["logit_rows"]  # (a ragged bucket's)
        # The last fill's copy: the host buffer is written again only once it has run (a step may be
        # launched before the step ahead of it was waited for).
        self._sent = torch.cuda.Event() if device.type == "cuda" else None
        self._in_flight = False
        # What each row of the host block table holds: a copy of the block table written there (then
        # zeros), None (zeros) or _UNKNOWN. Consecutive decode steps mostly send the same tables, and a
        # row rewritten from a list costs ~0.7 us where comparing it costs 0.06 (0.08 ms a step at batch 128).
        self._table_rows: list = [None] * bucket.seqs
        # The shape (B, n) whose constant rows ``fill_roots`` last wrote (None: another fill since), and
        # its query_start_loc and the rows' sequences and indices.
        self._roots_shape: tuple[int, int] | None = None
        self._roots_qsl = self._roots_index = None
        self.meta = AttentionMetadata(
            query_start_loc=dev["qsl"], seq_lens=dev["seq_lens"], block_tables=dev["tables"],
            slot_mapping=dev["slots"], positions=dev["positions"], token_seq=dev["token_seq"],
            token_q_idx=dev["q_idx"], max_query_len=bucket.tokens, max_seq_len=max_seq_len,
            custom_mask=mask, mask_start=dev["mask_start"] if words else None, ragged=bucket.ragged)
        self.fill_placeholder()

    def fits(self, chunks: list[SeqChunk]) -> bool:
        if len(chunks) > self.bucket.seqs or any(len(c.block_table) > self.table_width for c in chunks):
            return False
        if not self.bucket.ragged:
            return True
        return sum(len(c.token_ids) for c in chunks) <= self.bucket.tokens and all(
            c.custom_mask is None and c.positions is None and c.write_from is None and len(c.logits_rows) <= 1
            for c in chunks)

    def fill_placeholder(self) -> None:
        """Every sequence full, reading block 0 and writing nothing: the inputs a capture runs on (a
        ragged bucket: its tokens split evenly over its sequences)."""
        h, B, Q = self.host, self.bucket.seqs, self.bucket.tokens
        self._roots_shape = None
        if self.bucket.ragged:
            q_lens = np.diff(np.arange(B + 1) * Q // B)
            qsl = np.concatenate(([0], np.cumsum(q_lens)))
            h["logit_rows"][:] = qsl[1:] - 1
        else:
            q_lens, qsl = np.full(B, Q), np.arange(B + 1) * Q
        h["qsl"][:] = qsl
        h["seq_lens"][:] = q_lens
        h["tables"][:] = 0
        self._table_rows[:] = [None] * len(self._table_rows)
        h["slots"][:] = -1
        token_seq = np.repeat(np.arange(B), q_lens)
        q_idx = np.arange(len(token_seq)) - qsl[token_seq]
        # Within the RoPE table: a ragged bucket's tokens over few sequences may outnumber what one holds.
        h["positions"][:] = np.minimum(q_idx, self.max_seq_len - 1)
        h["token_seq"][:] = token_seq
        h["q_idx"][:] = q_idx
        h["ids"][:] = 0
        h["mask_start"][:] = 0
        if self._mask_bytes is not None:
            tril = np.packbits(np.tril(np.ones((Q, Q), dtype=bool)), axis=1, bitorder="little")
            self._mask_bytes[:] = 0
            self._mask_bytes[:, :tril.shape[1]] = np.tile(tril, (B, 1))
        self.device_buffer.copy_(self.host_buffer)

    def fill(self, chunks: list[SeqChunk], mask_on_device: bool = False) -> np.ndarray:
        """Write ``chunks`` (which ``fits``) and copy them to the device (asynchronously, one copy).

        Returns the step's ``query_start_loc`` on the host. The host buffer is written once the
        last fill's copy has run. ``mask_on_device``: send no mask (zeros); ``write_trees`` writes it next.
        """
        self._wait_sent()
        h = self.host
        self._roots_shape = None  # (every input rewritten: fill_roots' constants with them)
        q_lens = np.array([len(c.token_ids) for c in chunks], dtype=np.int64)
        starts = np.array([c.kv_start for c in chunks], dtype=np.int64)
        n = len(chunks)
        self._write_tables([c.block_table for c in chunks])
        qsl, T = self._write_rows(q_lens, starts)
        if T == n and all(c.positions is None for c in chunks):  # a decode step: one token each, at kv_start
            h["positions"][:T] = starts
            h["ids"][:T] = [c.token_ids[0] for c in chunks]
        else:
            h["positions"][:T] = np.concatenate([np.asarray(c.positions) if c.positions is not None else
                                                 np.arange(c.kv_start, c.kv_start + len(c.token_ids)) for c in chunks])
            h["ids"][:T] = np.concatenate([np.asarray(c.token_ids, dtype=np.int64) for c in chunks])
        h["positions"][T:] = 0
        h["ids"][T:] = 0
        if self.bucket.ragged:  # each chunk's logits row (at most one), in order
            rows = [at + c.logits_rows[0] for c, at in zip(chunks, qsl[:-1].tolist()) if len(c.logits_rows)]
            h["logit_rows"][:len(rows)], h["logit_rows"][len(rows):] = rows, 0
        if self._mask_bytes is not None and mask_on_device:
            h["mask_start"][:n], h["mask_start"][n:] = starts, 0
            self._mask_bytes[:] = 0
        elif self._mask_bytes is not None:
            masks = [np.ones((1, 1), dtype=bool) if c.custom_mask is None else np.asarray(c.custom_mask, dtype=bool)
                     for c in chunks]
            h["mask_start"][:n] = [c.kv_start if c.mask_start is None else c.mask_start for c in chunks]
            h["mask_start"][n:] = 0
            dense = np.zeros((T, self.bucket.tokens), dtype=bool)  # the step's rows unpacked, packed at once
            for m, at in zip(masks, qsl[:-1].tolist()):
                dense[at:at + m.shape[0], :m.shape[1]] = m
            self._mask_bytes[:] = 0
            packed = np.packbits(dense, axis=1, bitorder="little")  # bit j of byte b: column 8 b + j
            self._mask_bytes[:T, :packed.shape[1]] = packed
        self._send()
        return qsl

    def fill_roots(self, starts: np.ndarray, roots: np.ndarray, tables: list[list[int]], n: int) -> np.ndarray:
        """``fill(chunks, mask_on_device=True)`` for B trees of ``n`` nodes whose nodes are on the device,
        without the chunks: sequence b's chunk is its root ``roots[b]`` then ``n`` placeholder nodes
        (token 0), every row at the root's position ``starts[b]`` (its KV start), logits for every row,
        over ``tables[b]`` (``write_trees`` writes the nodes next). Built for the batch at once (a
        chained step's layout at batch 64 was 64 chunks made and taken apart again). What depends on
        the shape (B, n) alone (the rows' sequences and indices, query_start_loc, the padding, the
        zero mask and node ids) is written when the shape differs from the last fill's; consecutive
        chained steps of one shape write only what their starts, roots and tables change (the host
        lays out the next step while the device runs the draft: its time is the step's then).
        Returns the step's ``query_start_loc``."""
        self._wait_sent()
        h, B, w = self.host, len(starts), n + 1
        T = B * w
        self._write_tables(tables)
        if self._roots_shape != (B, n):
            self._roots_rows(B, w)
        seq, q_idx = self._roots_index
        h["seq_lens"][:B] = starts + w
        kv_idx = starts[seq] + q_idx
        bs = self.block_size
        h["slots"][:T] = h["tables"][seq, kv_idx // bs] * bs + kv_idx % bs
        h["positions"][:T] = starts[seq]
        h["ids"][:T:w] = roots
        if self._mask_bytes is not None:
            h["mask_start"][:B] = starts
        self._send()
        return self._roots_qsl

    def _roots_rows(self, B: int, w: int) -> None:
        """``fill_roots``' inputs that follow its shape alone: B trees of w rows (root and nodes)."""
        h, T = self.host, B * w
        qsl, seq = np.arange(B + 1) * w, np.repeat(np.arange(B), w)
        q_idx = np.arange(T) - qsl[seq]
        h["qsl"][:B + 1], h["qsl"][B + 1:] = qsl, T
        h["seq_lens"][B:] = 0
        h["slots"][T:] = -1
        h["token_seq"][:T], h["token_seq"][T:] = seq, 0
        h["q_idx"][:T], h["q_idx"][T:] = q_idx, 0
        h["positions"][T:] = 0
        h["ids"][:] = 0  # (each step writes its roots; the nodes' ids are written on the device)
        if self._mask_bytes is not None:
            h["mask_start"][B:] = 0
            self._mask_bytes[:] = 0
        self._roots_shape, self._roots_qsl, self._roots_index = (B, w - 1), qsl, (seq, q_idx)

    def _wait_sent(self) -> None:
        if self._in_flight:
            self._sent.synchronize()

    def _write_rows(self, q_lens: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, int]:
        """The per-row inputs every step has (query_start_loc, lengths, KV slots, the rows' sequences
        and indices, after the tables); returns query_start_loc and the step's tokens."""
        h, bs = self.host, self.block_size
        n, T = len(q_lens), int(q_lens.sum())
        qsl = np.concatenate(([0], np.cumsum(q_lens)))
        h["qsl"][:n + 1] = qsl
        h["qsl"][n + 1:] = T
        h["seq_lens"][:n] = starts + q_lens
        h["seq_lens"][n:] = 0
        token_seq = np.repeat(np.arange(n), q_lens)
        q_idx = np.arange(T) - qsl[token_seq]
        kv_idx = starts[token_seq] + q_idx
        h["slots"][:T] = h["tables"][token_seq, kv_idx // bs] * bs + kv_idx % bs
        h["slots"][T:] = -1
        h["token_seq"][:T], h["token_seq"][T:] = token_seq, 0
        h["q_idx"][:T], h["q_idx"][T:] = q_idx, 0
        return qsl, T

    def _send(self) -> None:
        self.device_buffer.copy_(self.host_buffer, non_blocking=True)
        if self._sent is not None:
            self._sent.record()
            self._in_flight = True

    def _write_tables(self, block_tables: list) -> None:
        """The step's block tables into the host table's rows, zeros after each table and in the rows
        past the step's; a row already holding its table is left as it is."""
        tables, rows, n = self.host["tables"], self._table_rows, len(block_tables)
        first = block_tables[0] if block_tables else None
        if n > 1 and all(t is first for t in block_tables):  # one sequence's tokens as many (a prompt)
            tables[:n] = 0
            tables[:n, :len(first)] = first
            rows[:n] = [list(first) if type(first) is list else _UNKNOWN] * n
        else:
            for i, table in enumerate(block_tables):
                if type(table) is list and rows[i] == table:
                    continue
                tables[i] = 0
                tables[i, :len(table)] = table
                rows[i] = list(table) if type(table) is list else _UNKNOWN
        for i in range(n, len(rows)):  # the rows past the step's: zeros
            if rows[i] is not None:
                tables[i] = 0
                rows[i] = None

    def write_trees(self, tokens: torch.Tensor, depths: torch.Tensor, packed_mask: torch.Tensor) -> None:
        """After ``fill(mask_on_device=True)`` of B chunks of a root and n nodes each, every row at
        its root's position: the nodes' tokens and depths (int64 [B, n]) and the trees' ancestor
        masks (``packed_tree_mask``: int32 [B * (n + 1), words], root first), still on the device,
        written into the step's inputs there (device work queued behind the fill's copy; the host
        waits for nothing)."""
        B, n = tokens.shape
        rows = B * (n + 1)
        ids = self.input_ids[:rows].view(B, n + 1)
        ids[:, 1:] = tokens
        # Each node at its root's position plus its depth (from the root's row, which this leaves as the
        # fill wrote it: writing the same trees again gives the same inputs, as a graph's warm-up run does).
        positions = self.meta.positions[:rows].view(B, n + 1)
        positions[:, 1:] = positions[:, :1] + depths
        self.meta.custom_mask[:rows, :packed_mask.shape[1]] = packed_mask
