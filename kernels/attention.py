"""Attention over the paged KV cache, and the KV write that precedes it.

Cache layout per layer (what later CUDA kernels read directly)::

    k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim]

The reference gathers each sequence's blocks into a padded dense tensor and runs SDPA with
an explicit boolean mask; a fused kernel with the same signature replaces it on the GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.metadata import AttentionMetadata


def write_kv_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Store new keys/values [T, kv_heads, head_dim] at flat slots [T]. Mutates the caches."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def attention_mask_ref(meta: AttentionMetadata) -> torch.Tensor:
    """Boolean visibility [B, max_query_len, max_seq_len] of cached keys for padded queries."""
    device = meta.seq_lens.device
    q_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]  # (B,)
    prefix = (meta.seq_lens - q_lens)[:, None, None]  # (B, 1, 1)
    key = torch.arange(meta.max_seq_len, device=device)[None, None, :]  # (1, 1, K)
    q_idx = torch.arange(meta.max_query_len, device=device)[None, :, None]  # (1, Q, 1)
    rel = key - prefix  # index of the key among this step's new tokens, (B, 1, K)
    if meta.new_token_mask is None:
        among_new = (rel >= 0) & (rel <= q_idx)
    else:
        dense = torch.zeros(meta.num_seqs, meta.max_query_len, meta.max_query_len,
                            dtype=torch.bool, device=device)
        dense[meta.token_seq, meta.token_q_idx] = meta.new_token_mask
        rel_idx = rel.clamp(0, meta.max_query_len - 1).expand(-1, meta.max_query_len, -1)
        among_new = (rel >= 0) & torch.gather(dense, 2, rel_idx)
    visible = ((key < prefix) | among_new) & (key < meta.seq_lens[:, None, None])
    # Padding query rows see key 0 so softmax stays finite; their outputs are dropped.
    visible[:, :, 0] |= q_idx[:, :, 0] >= q_lens[:, None]
    return visible


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention of new queries [T, heads, head_dim] over their sequences' cached KV -> [T, heads, head_dim]."""
    block_size = k_cache.shape[1]
    num_blocks = -(-meta.max_seq_len // block_size)
    tables = meta.block_tables[:, :num_blocks]
    k = k_cache[tables].flatten(1, 2)[:, : meta.max_seq_len]  # (B, K, kvh, d)
    v = v_cache[tables].flatten(1, 2)[:, : meta.max_seq_len]
    qp = q.new_zeros(meta.num_seqs, meta.max_query_len, *q.shape[1:])  # (B, Q, h, d)
    qp[meta.token_seq, meta.token_q_idx] = q
    mask = attention_mask_ref(meta).unsqueeze(1)  # (B, 1, Q, K)
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
        attn_mask=mask, scale=scale, enable_gqa=True)  # (B, h, Q, d)
    return out.transpose(1, 2)[meta.token_seq, meta.token_q_idx]
