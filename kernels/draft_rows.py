"""A draft's rows on the device: the layout of an extend's rows packed sequence after sequence, the
packing of a chained step's fed rows, a proposal's KV layout and a tree level's inputs
(references; ``draft_rows_triton.py`` has one launch each).

An extend holds ``rows_per_seq`` rows a sequence, packed at the front: sequence b's ``counts[b]``
rows come after those of sequences 0 .. b-1, and the slots past the last row write nothing::

    counts     2   1   3         (B = 3, rows_per_seq = 3: T = 9 slots)
    packed     b0 b0 b1 b2 b2 b2 -  -  -
    q_idx      0  1  0  0  1  2  0  0  0
    slots      KV slot of (b, starts[b] + q_idx) ... -1 -1 -1
"""

from __future__ import annotations

import torch

from kernels.norm import rms_norm_ref


def extend_layout_ref(starts: torch.Tensor, counts: torch.Tensor, tables: torch.Tensor, block_size: int,
                      rows_per_seq: int) -> dict[str, torch.Tensor]:
    """An extend's metadata from each sequence's first KV row ``starts`` [B], row count ``counts`` [B]
    (0: a padding sequence) and block table ``tables`` [B, W], int64 all: the query ranges ``qsl``
    [B + 1], ``seq_lens`` [B], and per packed slot [B * rows_per_seq] its KV ``slots`` (-1 past the
    last row), ``positions``, ``token_seq`` and ``q_idx`` (0 past the last row); ``rows``: each
    sequence's last row (0 for none before it). No host sync."""
    B, W = tables.shape
    T = B * rows_per_seq
    qsl = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    r = torch.arange(T, device=counts.device)
    seq = torch.searchsorted(qsl[1:], r, right=True).clamp(max=B - 1)  # the sequence whose range holds r
    q_idx = r - qsl[seq]
    valid = r < qsl[B]
    kv = starts[seq] + q_idx
    block = tables[seq, (kv // block_size).clamp(0, W - 1)]
    zero = torch.zeros_like(r)
    return {"qsl": qsl, "seq_lens": starts + counts, "slots": torch.where(valid, block * block_size + kv % block_size, -1),
            "positions": torch.where(valid, kv, zero), "token_seq": torch.where(valid, seq, zero),
            "q_idx": torch.where(valid, q_idx, zero), "rows": (qsl[1:] - 1).clamp(min=0)}


def pack_rows_ref(counts: torch.Tensor, tokens: torch.Tensor, features: torch.Tensor, rows: int, vocab: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences' rows packed front to back, as an extend lays them out: ``counts`` [B] rows of
    ``tokens`` [B, D] and ``features`` [B, D, width] -> token ids [rows] and features [rows, width],
    zero past the last row. ``vocab`` > 0: token ids clamped into [0, vocab) (ids another process
    wrote). A gather per packed row (its sequence by a search of the row starts), no host sync."""
    B, D = tokens.shape
    if vocab:
        tokens = tokens.clamp(0, vocab - 1)
    ends = counts.cumsum(0)
    r = torch.arange(rows, device=counts.device)
    seq = torch.searchsorted(ends, r, right=True).clamp(max=B - 1)
    col = (r - (ends[seq] - counts[seq])).clamp(0, D - 1)
    valid = r < ends[-1]
    flat = seq * D + col
    ids = torch.where(valid, tokens.reshape(-1)[flat], 0)
    hidden = torch.where(valid[:, None], features.reshape(B * D, -1)[flat], 0)
    return ids, hidden


def level_input_ref(parent_out: torch.Tensor, parent_slot: torch.Tensor, tokens: torch.Tensor, embed: torch.Tensor,
                    emb_norm: torch.Tensor, emb_eps: float, hid_norm: torch.Tensor, hid_eps: float,
                    mask: torch.Tensor | None, own: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tree level's inputs to the draft layer, for ``tokens`` [B, F] (target ids) whose parents sit
    at ``parent_slot`` [B, F] among the previous level's outputs ``parent_out`` [B, P, H] (-1: the
    root, ``parent_out``'s row 0 at the first level)::

        h    [B * F, H]       each node's parent's output (the layer's residual stream)
        x    [B * F, 2H]      [rms_norm(embed[token], emb_norm) ; rms_norm(h, hid_norm)]
        rows [B, F, words]    its packed feed-mask row: its parent's row of ``mask`` [B, P, words]
                              (None at the first level: no ancestors) | its own columns ``own`` [F, words]
    """
    B, F = tokens.shape
    H, words = parent_out.shape[-1], own.shape[-1]
    slot = parent_slot.clamp(min=0)[..., None]
    h = torch.gather(parent_out, 1, slot.expand(B, F, H)).reshape(B * F, H)
    emb = embed[tokens.reshape(-1)].to(h.dtype)
    x = torch.cat((rms_norm_ref(emb, emb_norm, emb_eps)[0], rms_norm_ref(h, hid_norm, hid_eps)[0]), dim=-1)
    rows = own.expand(B, F, words) if mask is None else torch.gather(mask, 1, slot.expand(B, F, words)) | own
    return x, h, rows.contiguous()


def proposal_layout_ref(rows: torch.Tensor, live: torch.Tensor, tables: torch.Tensor, seq: torch.Tensor,
                        row: torch.Tensor, step: torch.Tensor, lens: torch.Tensor, block_size: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every tree level's KV slots and RoPE positions at once, for a proposal over sequences with
    ``rows`` [B] committed draft rows, ``live`` [B] (0: a padding sequence, which writes nowhere) and
    block tables ``tables`` [B, W]: token t (of sequence ``seq[t]``) goes to KV row rows + ``row[t]``
    at position rows + ``step[t]``; returns slots [T] (-1: not written), positions [T] and each
    level's lengths rows + ``lens`` [levels, B]. int64 all."""
    first = rows[seq]
    kv_idx = first + row
    blocks = tables[seq, kv_idx // block_size]
    slots = torch.where(live[seq] > 0, blocks * block_size + kv_idx % block_size, -1)
    return slots, first + step, rows + lens[:, None]
