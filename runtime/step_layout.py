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


@dataclass(slots=True)
class SeqChunk:
    """New tokens of one sequence for this step (not frozen: a step builds one per sequence, and a
    frozen dataclass's construction costs 1.6 us against 0.3, 0.2 ms a step at batch 128).

    Their KV goes to indices ``kv_start ..``; RoPE positions are ``kv_start ..`` unless
    ``positions`` is given (tree steps). ``custom_mask`` [n, m] replaces causal visibility
    over the KV indices ``mask_start .. mask_start + m`` (default ``mask_start`` = kv_start;
    every index before it is visible to all new tokens). ``logits_rows`` selects which of
    the new tokens get logits (e.g. the last one of a prefill chunk, all nodes of a tree).
    ``write_from``: KV indices below it are in the cache already and not written again (their
    tokens are recomputed for their features alone: a sequence that takes up the draft again).
    """

    token_ids: list[int] | np.ndarray
    kv_start: int
    block_table: list[int]
    logits_rows: tuple[int, ...] | np.ndarray = ()
    positions: list[int] | np.ndarray | None = None
    custom_mask: np.ndarray | None = None
    mask_start: int | None = None
    write_from: int | None = None


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
    for i, c in enumerate(chunks):
        if c.write_from is not None:  # cached already: not written (a negative slot)
            rows = slice(qsl[i], qsl[i + 1])
            slots[rows] = np.where(kv_idx[rows] < c.write_from, -1, slots[rows])
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
