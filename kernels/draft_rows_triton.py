"""Triton draft rows: ``kernels.draft_rows``' references, one launch each (some twenty small torch
kernels for an extend's layout, twelve for a proposal's, seven for a tree level's inputs, on the
critical path of every chained step).

Every program holds the batch's row counts (B of them, in registers), takes their running sum, and
finds the sequence of each of its packed rows by counting the sequences that end at or before it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import small_launch
from kernels.triton_jit import jit_unspecialized

MIN_BLOCK_B = 16


def _blocks(B: int) -> tuple[int, int]:
    """(rows a program, the batch's block): [rows, batch] comparisons in one program's registers."""
    block_b = max(MIN_BLOCK_B, triton.next_power_of_2(B))
    return max(16, min(128, 8192 // block_b)), block_b


def extend_layout_triton(starts: torch.Tensor, counts: torch.Tensor, tables: torch.Tensor, block_size: int,
                         rows_per_seq: int) -> dict[str, torch.Tensor]:
    """``extend_layout_ref``'s signature and results, in one launch."""
    B, W = tables.shape
    T = B * rows_per_seq
    dev = counts.device
    qsl = torch.empty(B + 1, dtype=torch.int64, device=dev)
    seq_lens, rows = (torch.empty(B, dtype=torch.int64, device=dev) for _ in range(2))
    slots, positions, token_seq, q_idx = (torch.empty(T, dtype=torch.int64, device=dev) for _ in range(4))
    if B:
        block, block_b = _blocks(B)
        tables = tables.contiguous()
        _extend_layout_kernel[(triton.cdiv(T, block),)](
            starts.contiguous(), counts.contiguous(), tables, qsl, seq_lens, rows, slots, positions, token_seq, q_idx,
            B, W, T, block_size, BLOCK=block, BLOCK_B=block_b, **small_launch(qsl))
    else:
        qsl.zero_()
    return {"qsl": qsl, "seq_lens": seq_lens, "slots": slots, "positions": positions, "token_seq": token_seq,
            "q_idx": q_idx, "rows": rows}


@jit_unspecialized("starts_ptr", "counts_ptr", "tables_ptr", "qsl_ptr", "seq_lens_ptr", "rows_ptr", "slots_ptr",
                   "positions_ptr", "token_seq_ptr", "q_idx_ptr", "B", "W", "T", "block_size")
def _extend_layout_kernel(starts_ptr, counts_ptr, tables_ptr, qsl_ptr, seq_lens_ptr, rows_ptr, slots_ptr,
                          positions_ptr, token_seq_ptr, q_idx_ptr, B, W, T, block_size,
                          BLOCK: tl.constexpr, BLOCK_B: tl.constexpr, USE_GDC: tl.constexpr):
    if USE_GDC:  # launched dependent (kernels/pdl.py): wait before any load, store or return
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    b = tl.arange(0, BLOCK_B)
    in_b = b < B
    counts = tl.load(counts_ptr + b, mask=in_b, other=0)
    ends = tl.cumsum(counts, 0)
    begins = ends - counts
    total = tl.sum(counts, 0)
    if pid == 0:
        starts = tl.load(starts_ptr + b, mask=in_b, other=0)
        tl.store(qsl_ptr + b, begins, mask=in_b)
        tl.store(qsl_ptr + B, total)
        tl.store(seq_lens_ptr + b, starts + counts, mask=in_b)
        tl.store(rows_ptr + b, tl.maximum(ends - 1, 0), mask=in_b)
    r = (pid * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    in_r = r < T
    # The sequence whose range holds r: how many end at or before it (past the last: the last sequence).
    seq = tl.minimum(tl.sum(((ends[None, :] <= r[:, None]) & in_b[None, :]).to(tl.int64), 1), B - 1)
    begin = tl.sum(tl.where(b[None, :] == seq[:, None], begins[None, :], 0), 1)
    q = r - begin
    valid = r < total
    kv = tl.load(starts_ptr + seq, mask=in_r, other=0) + q
    within = kv % block_size  # floor division and modulo, as torch's (a negative row stays in its table)
    within = tl.where(within < 0, within + block_size, within)
    block = tl.minimum(tl.maximum((kv - within) // block_size, 0), W - 1)
    phys = tl.load(tables_ptr + seq * W + block, mask=in_r, other=0)
    tl.store(slots_ptr + r, tl.where(valid, phys * block_size + within, -1), mask=in_r)
    tl.store(positions_ptr + r, tl.where(valid, kv, 0), mask=in_r)
    tl.store(token_seq_ptr + r, tl.where(valid, seq, 0), mask=in_r)
    tl.store(q_idx_ptr + r, tl.where(valid, q, 0), mask=in_r)


def pack_rows_triton(counts: torch.Tensor, tokens: torch.Tensor, features: torch.Tensor, rows: int, vocab: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_rows_ref``'s signature and results, in one launch (``PACK_ROWS`` packed rows a program)."""
    B, D = tokens.shape
    width = features.shape[-1]
    ids = torch.empty(rows, dtype=torch.int64, device=tokens.device)
    hidden = torch.empty(rows, width, dtype=features.dtype, device=features.device)
    if rows and B:
        _pack_rows_kernel[(triton.cdiv(rows, PACK_ROWS),)](
            counts.contiguous(), tokens.contiguous(), features.contiguous(), ids, hidden, B, D, width, vocab, rows,
            BLOCK_R=PACK_ROWS, BLOCK_B=max(MIN_BLOCK_B, triton.next_power_of_2(B)),
            BLOCK_W=min(1024, triton.next_power_of_2(max(width, 1))), **small_launch(ids))
    elif rows:
        ids.zero_()
        hidden.zero_()
    return ids, hidden


PACK_ROWS = 4


@jit_unspecialized("counts_ptr", "tokens_ptr", "features_ptr", "ids_ptr", "hidden_ptr", "B", "D", "width", "vocab",
                   "rows")
def _pack_rows_kernel(counts_ptr, tokens_ptr, features_ptr, ids_ptr, hidden_ptr, B, D, width, vocab, rows,
                      BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr, USE_GDC: tl.constexpr):
    if USE_GDC:  # launched dependent (kernels/pdl.py): wait before any load, store or return
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    in_r = r < rows
    b = tl.arange(0, BLOCK_B)
    in_b = b < B
    counts = tl.load(counts_ptr + b, mask=in_b, other=0)
    ends = tl.cumsum(counts, 0)
    seq = tl.minimum(tl.sum(((ends[None, :] <= r[:, None]) & in_b[None, :]).to(tl.int64), 1), B - 1)
    begin = tl.sum(tl.where(b[None, :] == seq[:, None], (ends - counts)[None, :], 0), 1)
    col = tl.minimum(tl.maximum(r - begin, 0), D - 1)
    valid = in_r & (r < tl.sum(counts, 0))
    src = seq * D + col
    token = tl.load(tokens_ptr + src, mask=in_r, other=0)
    token = tl.where(vocab > 0, tl.minimum(tl.maximum(token, 0), vocab - 1), token)
    tl.store(ids_ptr + r, tl.where(valid, token, 0), mask=in_r)
    w = tl.arange(0, BLOCK_W)
    for w0 in range(0, width, BLOCK_W):
        ok = (w0 + w < width)[None, :]
        x = tl.load(features_ptr + src[:, None] * width + w0 + w[None, :], mask=ok & valid[:, None], other=0.0)
        tl.store(hidden_ptr + r[:, None] * width + w0 + w[None, :], x, mask=ok & in_r[:, None])


def level_input_triton(parent_out: torch.Tensor, parent_slot: torch.Tensor, tokens: torch.Tensor, embed: torch.Tensor,
                       emb_norm: torch.Tensor, emb_eps: float, hid_norm: torch.Tensor, hid_eps: float,
                       mask: torch.Tensor | None, own: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``level_input_ref``'s signature and results (the norms as ``rms_norm_triton`` computes them), in
    one launch: a program a node."""
    B, F = tokens.shape
    P, H = parent_out.shape[1], parent_out.shape[2]
    words = own.shape[-1]
    dev = parent_out.device
    x = torch.empty(B * F, 2 * H, dtype=parent_out.dtype, device=dev)
    h = torch.empty(B * F, H, dtype=parent_out.dtype, device=dev)
    rows = torch.empty(B, F, words, dtype=own.dtype, device=dev)
    if B * F:
        parent_out, own = parent_out.contiguous(), own.contiguous()
        has_mask = mask is not None
        _level_input_kernel[(B * F,)](
            parent_out, parent_slot.contiguous(), tokens.contiguous(), embed, emb_norm, hid_norm,
            mask.contiguous() if has_mask else own, own, x, h, rows, F, P, H, words, embed.stride(0),
            emb_eps, hid_eps, HAS_MASK=has_mask, BLOCK=triton.next_power_of_2(H),
            BLOCK_WORDS=triton.next_power_of_2(words), num_warps=4 if H >= 1024 else 2, **small_launch(x))
    return x, h, rows


@triton.jit
def _norm_row(v, w_ptr, cols, ok, hidden, eps):
    """``rms_norm_triton``'s row: float32 sums, the scale as 1 / sqrt."""
    vf = v.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(vf * vf, 0) / hidden + eps)
    return vf * inv * tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)


@jit_unspecialized("F", "P", "words")  # (the widths stay specialised: one model's)
def _level_input_kernel(parent_ptr, slot_ptr, tokens_ptr, embed_ptr, emb_w_ptr, hid_w_ptr, mask_ptr, own_ptr,
                        x_ptr, h_ptr, rows_ptr, F, P, H, words, stride_e, emb_eps, hid_eps,
                        HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_WORDS: tl.constexpr, USE_GDC: tl.constexpr):
    if USE_GDC:  # launched dependent (kernels/pdl.py): wait before any load, store or return
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    r = tl.program_id(0).to(tl.int64)  # node j of sequence b: row b * F + j
    b, j = r // F, r % F
    slot = tl.maximum(tl.load(slot_ptr + r), 0)
    token = tl.load(tokens_ptr + r)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    hv = tl.load(parent_ptr + (b * P + slot) * H + cols, mask=ok, other=0.0)
    tl.store(h_ptr + r * H + cols, hv, mask=ok)
    ev = tl.load(embed_ptr + token * stride_e + cols, mask=ok, other=0.0).to(hv.dtype)
    dtype = x_ptr.dtype.element_ty
    tl.store(x_ptr + r * 2 * H + cols, _norm_row(ev, emb_w_ptr, cols, ok, H, emb_eps).to(dtype), mask=ok)
    tl.store(x_ptr + r * 2 * H + H + cols, _norm_row(hv, hid_w_ptr, cols, ok, H, hid_eps).to(dtype), mask=ok)
    w = tl.arange(0, BLOCK_WORDS)
    w_ok = w < words
    bits = tl.load(own_ptr + j * words + w, mask=w_ok, other=0)
    if HAS_MASK:
        bits = bits | tl.load(mask_ptr + (b * P + slot) * words + w, mask=w_ok, other=0)
    tl.store(rows_ptr + r * words + w, bits, mask=w_ok)


def proposal_layout_triton(rows: torch.Tensor, live: torch.Tensor, tables: torch.Tensor, seq: torch.Tensor,
                           row: torch.Tensor, step: torch.Tensor, lens: torch.Tensor, block_size: int
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``proposal_layout_ref``'s signature and results, in one launch (a block table's index clamped
    into the table: a row past it reads its last block, where the reference would fail)."""
    T, (B, W), levels = seq.shape[0], tables.shape, lens.shape[0]
    dev = rows.device
    slots, positions = (torch.empty(T, dtype=torch.int64, device=dev) for _ in range(2))
    out_lens = torch.empty(levels, B, dtype=torch.int64, device=dev)
    if B:
        block = min(1024, max(16, triton.next_power_of_2(T)))
        _proposal_layout_kernel[(max(1, triton.cdiv(T, block)),)](
            rows.contiguous(), live.contiguous(), tables.contiguous(), seq.contiguous(), row.contiguous(),
            step.contiguous(), lens.contiguous(), slots, positions, out_lens, T, B, W, levels, block_size,
            BLOCK=block, BLOCK_B=max(MIN_BLOCK_B, triton.next_power_of_2(B)), **small_launch(slots))
    return slots, positions, out_lens


@jit_unspecialized("rows_ptr", "live_ptr", "tables_ptr", "seq_ptr", "row_ptr", "step_ptr", "lens_ptr", "T", "B", "W",
                   "levels")
def _proposal_layout_kernel(rows_ptr, live_ptr, tables_ptr, seq_ptr, row_ptr, step_ptr, lens_ptr, slots_ptr,
                            positions_ptr, out_lens_ptr, T, B, W, levels, block_size,
                            BLOCK: tl.constexpr, BLOCK_B: tl.constexpr, USE_GDC: tl.constexpr):
    if USE_GDC:  # launched dependent (kernels/pdl.py): wait before any load, store or return
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    t = (pid * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    ok = t < T
    s = tl.load(seq_ptr + t, mask=ok, other=0)
    first = tl.load(rows_ptr + s, mask=ok, other=0)
    kv = first + tl.load(row_ptr + t, mask=ok, other=0)
    block = tl.minimum(tl.maximum(kv // block_size, 0), W - 1)
    phys = tl.load(tables_ptr + s * W + block, mask=ok, other=0)
    live = tl.load(live_ptr + s, mask=ok, other=0)
    tl.store(slots_ptr + t, tl.where(live > 0, phys * block_size + kv % block_size, -1), mask=ok)
    tl.store(positions_ptr + t, first + tl.load(step_ptr + t, mask=ok, other=0), mask=ok)
    if pid == 0:  # each level's lengths
        b = tl.arange(0, BLOCK_B)
        b_ok = b < B
        r = tl.load(rows_ptr + b, mask=b_ok, other=0)
        for i in range(levels):
            tl.store(out_lens_ptr + i * B + b, r + tl.load(lens_ptr + i), mask=b_ok)
