"""Flattening one step's per-sequence chunks into device tensors and ``AttentionMetadata``.

Shared by the target (verify service) and the draft head (draft service): both run paged
attention over their own cache with the same layout. The step's arrays are built on the host
with numpy, packed into one staging buffer (pinned on CUDA) and sent in ONE host-to-device
copy; the device tensors are views of that copy::

    staging (int64):  qsl | seq_lens | tables | slots | positions | token_seq | q_idx | ids | rows
                      [| mask_start | mask bytes]   (the tree or level mask, when a chunk has one)
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch

from kernels import KernelSet
from kernels.metadata import AttentionMetadata


_UNKNOWN = object()  # a host table row whose content is not kept (rewritten at the next fill)


@dataclass(slots=True)
class SeqChunk:
    """New tokens of one sequence for this step (not frozen: a step builds one per sequence, and a
    frozen dataclass's construction costs 1.6 us against 0.3, 0.2 ms a step at batch 128).

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


ALIGN = 8  # int64 elements: where each of a step's arrays starts in the staging buffer


class Staging:
    """Host buffers a step's arrays are packed into, then copied to ``device`` at once.

    Two pinned buffers on CUDA, used in turn; a buffer is written again only once its last copy
    has run (an event), so a step never overwrites a copy still in flight; they grow (rarely)
    to the largest step seen.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._pin = self.device.type == "cuda"
        self._buffers: list[tuple[torch.Tensor, np.ndarray] | None] = [None, None]  # tensor + its numpy view
        self._copies: list[torch.cuda.Event | None] = [None, None]  # each buffer's last copy to the device
        self._turn = 0

    def upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """int64 arrays -> device tensors of the same shapes, through one copy.

        Each array starts at a multiple of ``ALIGN`` elements (64 bytes): Triton specialises a
        pointer argument on its 16-byte alignment, so views at step-dependent offsets would
        otherwise compile new kernel variants in the middle of serving."""
        starts = [0, *itertools.accumulate(-(-a.size // ALIGN) * ALIGN for a in arrays)]
        total = starts[-1]
        buf, host = self._buffer(total)
        for a, at in zip(arrays, starts):
            host[at:at + a.size] = a.reshape(-1)
        if self._pin:
            moved = buf[:total].to(self.device, non_blocking=True)
            self._copies[self._turn] = torch.cuda.Event()
            self._copies[self._turn].record()
        else:
            moved = buf[:total].clone()
        # One as_strided per array: the same views as slicing then reshaping, in one call instead of two.
        return [moved.as_strided(a.shape, _contiguous_strides(a.shape), at) for a, at in zip(arrays, starts)]

    def _buffer(self, n: int) -> tuple[torch.Tensor, np.ndarray]:
        """The next buffer, once the copy that last read it has run: steps that end in no sync (prefill
        chunks that draw no token) may run ahead of the device by more than one copy."""
        self._turn ^= 1
        if self._copies[self._turn] is not None:
            self._copies[self._turn].synchronize()
        entry = self._buffers[self._turn]
        if entry is None or entry[0].shape[0] < n:
            buf = torch.empty(max(n, 4096), dtype=torch.int64, pin_memory=self._pin)
            entry = self._buffers[self._turn] = (buf, buf.numpy())
        return entry


class Readback:
    """A device tensor's copy to the host, started now and read later: the host goes on with other
    work while the device finishes what the tensor waits for, then ``wait`` blocks only for what
    is left. One pinned buffer on CUDA, reused (it grows, rarely); a copy's result must be read
    before the next copy starts (``wait`` refuses a stale ticket). Off CUDA the copy is done at once.
    """

    def __init__(self, device: torch.device):
        self._cuda = torch.device(device).type == "cuda"
        self._buffer: torch.Tensor | None = None
        self._event = torch.cuda.Event() if self._cuda else None
        self._ticket = 0
        self._view: torch.Tensor | None = None

    def start(self, t: torch.Tensor) -> int:
        """Queue ``t``'s copy behind the work already queued; returns the ticket ``wait`` takes."""
        self._ticket += 1
        if not self._cuda:
            self._view = t.detach().cpu().clone()
            return self._ticket
        n = t.numel()
        if self._buffer is None or self._buffer.dtype != t.dtype or self._buffer.numel() < n:
            with torch.inference_mode(False):  # a normal tensor: later copies may come from outside inference mode
                self._buffer = torch.empty(max(n, 1024), dtype=t.dtype, pin_memory=True)
        self._view = self._buffer[:n].view(t.shape)
        self._view.copy_(t, non_blocking=True)
        self._event.record()
        return self._ticket

    def wait(self, ticket: int) -> np.ndarray:
        """The tensor of copy ``ticket`` on the host (the caller's own array: the buffer is reused)."""
        assert ticket == self._ticket, "a copy read after the next one started"
        if self._event is not None:
            self._event.synchronize()
        return self._view.numpy().copy()


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of ``shape``, in elements."""
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


def pad_rows(rows: list[list[int]], width: int | None = None) -> np.ndarray:
    """int64 [len(rows), width] (default the longest row): each row's values, then zeros (block
    tables). A slice assignment per row: at served batch sizes cheaper than one scatter of them all."""
    out = np.zeros((len(rows), width or max(map(len, rows), default=0)), dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def layout_arrays(chunks: list[SeqChunk], block_size: int, table_width: int | None = None) -> dict[str, np.ndarray]:
    """The host side of a step's layout, int64 arrays: qsl, seq_lens, tables ([B, table_width],
    default the longest table), slots, positions, token_seq, q_idx."""
    q_lens = np.array([len(c.token_ids) for c in chunks], dtype=np.int64)
    starts = np.array([c.kv_start for c in chunks], dtype=np.int64)
    qsl = np.concatenate(([0], np.cumsum(q_lens)))
    token_seq = np.repeat(np.arange(len(chunks)), q_lens)
    token_q_idx = np.arange(qsl[-1]) - qsl[token_seq]
    kv_idx = starts[token_seq] + token_q_idx
    tables = pad_rows([c.block_table for c in chunks], table_width)
    slots = tables[token_seq, kv_idx // block_size] * block_size + kv_idx % block_size
    positions = np.concatenate([np.asarray(c.positions) if c.positions is not None else
                                np.arange(c.kv_start, c.kv_start + len(c.token_ids)) for c in chunks])
    return {"qsl": qsl, "seq_lens": starts + q_lens, "tables": tables, "slots": slots,
            "positions": positions.astype(np.int64), "token_seq": token_seq, "q_idx": token_q_idx}


def layout_step(chunks: list[SeqChunk], block_size: int, device: torch.device, kernels: KernelSet,
                staging: Staging | None = None, input_ids: torch.Tensor | None = None,
                custom_mask: torch.Tensor | None = None) -> StepLayout:
    """Flatten ``chunks`` into one batch of T tokens with its attention metadata (one copy, through
    ``staging``: a runner keeps its own across steps).

    ``input_ids`` (int64 [T]) and ``custom_mask`` (bool [T, cols]), when given, are already on the
    device (a draft tree level grown there): the chunks' ``token_ids`` then only count the tokens,
    their ``custom_mask`` is ignored (``mask_start`` still applies), and nothing waits on the device.
    """
    arrays = layout_arrays(chunks, block_size)
    qsl, seq_lens = arrays["qsl"], arrays["seq_lens"]
    max_q = int((qsl[1:] - qsl[:-1]).max())
    if custom_mask is not None:
        assert custom_mask.shape[0] == qsl[-1], f"a mask of {custom_mask.shape[0]} rows for {qsl[-1]} tokens"
        mask, mask_start = None, np.array([c.kv_start if c.mask_start is None else c.mask_start for c in chunks],
                                          dtype=np.int64)
    else:
        mask, mask_start = _custom_mask(chunks)
    arrays["rows"] = np.concatenate([qsl[i] + np.asarray(c.logits_rows, dtype=np.int64) for i, c in enumerate(chunks)])
    if input_ids is None:
        arrays["ids"] = np.concatenate([np.asarray(c.token_ids, dtype=np.int64) for c in chunks])
    if mask_start is not None:
        arrays["mask_start"] = mask_start
    if mask is not None:  # the mask travels as its bytes, padded to whole int64 words
        mask_bytes = np.zeros(-(-mask.size // 8) * 8, dtype=np.uint8)
        mask_bytes[:mask.size] = mask.reshape(-1)
        arrays["mask"] = mask_bytes.view(np.int64)
    moved = dict(zip(arrays, (staging or Staging(device)).upload(list(arrays.values()))))
    if mask is not None:
        custom_mask = moved["mask"].view(torch.uint8)[:mask.size].view(mask.shape).view(torch.bool)
    meta = AttentionMetadata(
        query_start_loc=moved["qsl"], seq_lens=moved["seq_lens"], block_tables=moved["tables"],
        slot_mapping=moved["slots"], positions=moved["positions"], token_seq=moved["token_seq"],
        token_q_idx=moved["q_idx"], max_query_len=max_q, max_seq_len=int(seq_lens.max()),
        custom_mask=custom_mask, mask_start=moved.get("mask_start"))
    ids = input_ids if input_ids is not None else moved["ids"]
    return StepLayout(ids, kernels.prepare_attention(meta), moved["rows"], qsl)


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


@dataclass(frozen=True, slots=True)
class Bucket:
    """The shape a graphed step is captured for: up to ``seqs`` sequences of up to ``tokens`` new
    tokens each; ``tree``: with a packed ancestor mask (verification), else one decode token each."""

    seqs: int
    tokens: int
    tree: bool

    @property
    def num_tokens(self) -> int:
        return self.seqs * self.tokens

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
    attention kernel's grid never depends on a step's lengths.
    """

    def __init__(self, bucket: Bucket, table_width: int, max_seq_len: int, block_size: int, device: torch.device):
        self.bucket, self.block_size, self.table_width = bucket, block_size, table_width
        B, T, W = bucket.seqs, bucket.num_tokens, table_width
        mask_int64 = -(-T * bucket.mask_words // 2)  # int32 words, two to an int64
        shapes = {"qsl": (B + 1,), "seq_lens": (B,), "tables": (B, W), "slots": (T,), "positions": (T,),
                  "token_seq": (T,), "q_idx": (T,), "ids": (T,), "mask_start": (B,), "mask": (mask_int64,)}
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
        # The last fill's copy: the host buffer is written again only once it has run (a step may be
        # launched before the step ahead of it was waited for).
        self._sent = torch.cuda.Event() if device.type == "cuda" else None
        self._in_flight = False
        # What each row of the host block table holds: a copy of the block table written there (then
        # zeros), None (zeros) or _UNKNOWN. Consecutive decode steps mostly send the same tables, and a
        # row rewritten from a list costs ~0.7 us where comparing it costs 0.06 (0.08 ms a step at batch 128).
        self._table_rows: list = [None] * bucket.seqs
        self.meta = AttentionMetadata(
            query_start_loc=dev["qsl"], seq_lens=dev["seq_lens"], block_tables=dev["tables"],
            slot_mapping=dev["slots"], positions=dev["positions"], token_seq=dev["token_seq"],
            token_q_idx=dev["q_idx"], max_query_len=bucket.tokens, max_seq_len=max_seq_len,
            custom_mask=mask, mask_start=dev["mask_start"] if words else None)
        self.fill_placeholder()

    def fits(self, chunks: list[SeqChunk]) -> bool:
        return len(chunks) <= self.bucket.seqs and all(len(c.block_table) <= self.table_width for c in chunks)

    def fill_placeholder(self) -> None:
        """Every sequence full, reading block 0 and writing nothing: the inputs a capture runs on."""
        h, B, Q = self.host, self.bucket.seqs, self.bucket.tokens
        h["qsl"][:] = np.arange(B + 1) * Q
        h["seq_lens"][:] = Q
        h["tables"][:] = 0
        self._table_rows[:] = [None] * len(self._table_rows)
        h["slots"][:] = -1
        h["positions"][:] = np.tile(np.arange(Q), B)
        h["token_seq"][:] = np.repeat(np.arange(B), Q)
        h["q_idx"][:] = np.tile(np.arange(Q), B)
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
        chained step's layout at batch 64 was 64 chunks made and taken apart again). Returns the
        step's ``query_start_loc``."""
        self._wait_sent()
        h, B, w = self.host, len(starts), n + 1
        self._write_tables(tables)
        qsl, T = self._write_rows(np.full(B, w, dtype=np.int64), starts)
        h["positions"][:T] = np.repeat(starts, w)
        h["positions"][T:] = 0
        ids = h["ids"]
        ids[:] = 0
        ids[:T:w] = roots
        if self._mask_bytes is not None:
            h["mask_start"][:B], h["mask_start"][B:] = starts, 0
            self._mask_bytes[:] = 0
        self._send()
        return qsl

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
        self.meta.positions[:rows].view(B, n + 1)[:, 1:] += depths
        self.meta.custom_mask[:rows, :packed_mask.shape[1]] = packed_mask
