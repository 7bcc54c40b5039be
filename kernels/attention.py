"""Attention over the paged KV cache, and the KV write that precedes it.

Cache layout per layer (what later CUDA kernels read directly)::

    k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim]

The reference gathers each sequence's blocks into a padded dense tensor and runs SDPA with
an explicit boolean mask; a fused kernel with the same signature replaces it on the GPU.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels.metadata import AttentionMetadata


def write_kv_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Store new keys/values [T, kv_heads, head_dim] at flat slots [T] (a negative slot: a padding
    token, not written). Mutates the caches."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def attention_mask_ref(meta: AttentionMetadata) -> torch.Tensor:
    """Boolean visibility [B, max_query_len, max_seq_len] of cached keys for padded queries."""
    device = meta.seq_lens.device
    q_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]  # (B,)
    key = torch.arange(meta.max_seq_len, device=device)[None, None, :]  # (1, 1, K)
    q_idx = torch.arange(meta.max_query_len, device=device)[None, :, None]  # (1, Q, 1)
    if meta.custom_mask is None:
        start = (meta.seq_lens - q_lens)[:, None, None]  # (B, 1, 1): first new token's KV index
        masked = (key - start) <= q_idx  # causal among the new tokens
    else:
        start = meta.mask_start[:, None, None]
        custom = unpack_mask(meta.custom_mask) if meta.custom_mask.dtype == torch.int32 else meta.custom_mask
        cols = custom.shape[1]
        dense = torch.zeros(meta.num_seqs, meta.max_query_len + 1, cols, dtype=torch.bool, device=device)
        dense[meta.token_seq, _real_rows(meta)] = custom[:len(meta.token_seq)]
        dense = dense[:, :-1]
        rel = (key - start).clamp(0, cols - 1).expand(-1, meta.max_query_len, -1)  # (B, Q, K)
        masked = torch.gather(dense, 2, rel) & (key - start < cols)
    visible = ((key < start) | masked) & (key < meta.seq_lens[:, None, None])
    # Padding query rows see key 0 so softmax stays finite; their outputs are dropped.
    visible[:, :, 0] |= q_idx[:, :, 0] >= q_lens[:, None]
    return visible


def _real_rows(meta: AttentionMetadata) -> torch.Tensor:
    """Each token row's index within its sequence, and ``max_query_len`` for the padding rows past
    the step's tokens (a static layout's: sequence 0, index 0): scattered there, into a column the
    caller drops, they leave sequence 0's first row as it is. With no sync with the device."""
    rows = torch.arange(len(meta.token_q_idx), device=meta.token_q_idx.device)
    return torch.where(rows < meta.query_start_loc[-1], meta.token_q_idx, meta.max_query_len)


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """bool [T, cols] -> int32 [T, ceil(cols / 32)]: bit j of word w is column 32 w + j."""
    T, cols = mask.shape
    words = -(-cols // 32)
    padded = torch.zeros(T, words * 32, dtype=torch.int64, device=mask.device)
    padded[:, :cols] = mask
    weights = torch.bitwise_left_shift(torch.ones(32, dtype=torch.int64, device=mask.device),
                                       torch.arange(32, device=mask.device))
    packed = (padded.view(T, words, 32) * weights).sum(-1)  # < 2^32, exact in int64
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # two's complement


def unpack_mask(words: torch.Tensor) -> torch.Tensor:
    """A packed mask, int32 [T, words] (bit j of word w: column 32 w + j), as bool [T, 32 * words]."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 1).flatten(1).bool()  # (T, words, 32) -> (T, 32 words)


def prepare_attention_ref(meta: AttentionMetadata) -> AttentionMetadata:
    """Per-step work shared by every layer: the dense mask (computed once, not per layer)."""
    return dataclasses.replace(meta, dense_mask=attention_mask_ref(meta))


# cuDNN's SDPA plans a new graph for every new KV length (every decode step), costing ~2 ms of
# host time per call; the memory-efficient and math backends take arbitrary masks without it.
_SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention of new queries [T, heads, head_dim] over their sequences' cached KV -> [T, heads, head_dim].

    Grouped-query attention without repeating KV: the g = heads / kv_heads query heads that
    share a KV head are folded into the query axis, so SDPA sees kv_heads heads of Q*g rows.
    """
    B, Q, K = meta.num_seqs, meta.max_query_len, meta.max_seq_len
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    g = q.shape[1] // kvh
    tables = meta.block_tables[:, : -(-K // k_cache.shape[1])]
    k = k_cache[tables].flatten(1, 2)[:, :K].transpose(1, 2)  # (B, kvh, K, d)
    v = v_cache[tables].flatten(1, 2)[:, :K].transpose(1, 2)
    qp = q.new_zeros(B, Q + 1, kvh * g, d)  # (a last column for the padding rows, dropped)
    qp[meta.token_seq, _real_rows(meta)] = q
    qp = qp[:, :Q].view(B, Q, kvh, g, d).permute(0, 2, 1, 3, 4).reshape(B, kvh, Q * g, d)  # row = qi*g + gi
    mask = meta.dense_mask if meta.dense_mask is not None else attention_mask_ref(meta)
    mask = mask.repeat_interleave(g, dim=1).unsqueeze(1)  # (B, 1, Q*g, K)
    with sdpa_kernel(_SDPA_BACKENDS):
        out = F.scaled_dot_product_attention(qp, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale)
    out = out.view(B, kvh, Q, g, d).permute(0, 2, 1, 3, 4).reshape(B, Q, kvh * g, d)
    return out[meta.token_seq, meta.token_q_idx]
