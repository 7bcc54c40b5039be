"""The explicit metadata every attention / KV kernel takes (no hidden globals).

A step runs a flat batch of T new tokens belonging to B sequences. Sequence b owns
tokens ``query_start_loc[b] : query_start_loc[b+1]`` and, after this step's KV writes,
``seq_lens[b]`` cached entries, laid out in the paged cache through ``block_tables[b]``::

    kv index  0 ............ mask_start-1 | mask_start ........... seq_len-1
              visible to every new token  | visibility per new token: causal by default,
                                          | or row t of ``custom_mask`` (tree attention)

Without a custom mask, ``mask_start`` is the first new token's KV index (plain causal
attention). A target tree step sets it there too and passes the tree's ancestor mask; a
draft tree level sets it to the end of the committed rows, so each new node sees only its
own ancestors among the speculative nodes already in the cache.

``positions`` (RoPE) are separate from KV indices, so a tree node at depth d sits at
position prefix_len + d while its KV lives at prefix_len + node_index.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Per-step layout of new tokens and their sequences' paged KV. All tensors on device."""

    query_start_loc: torch.Tensor  # int64 [B+1]
    seq_lens: torch.Tensor  # int64 [B], KV length after this step's writes
    block_tables: torch.Tensor  # int64 [B, max_blocks], unused entries padded with 0
    slot_mapping: torch.Tensor  # int64 [T], flat cache slot (block * block_size + offset)
    positions: torch.Tensor  # int64 [T], RoPE positions
    token_seq: torch.Tensor  # int64 [T], sequence index of each new token
    token_q_idx: torch.Tensor  # int64 [T], index of each new token within its sequence's new tokens
    max_query_len: int  # host-side maxima: sizes known when the batch is built, no device sync
    max_seq_len: int
    # bool [T, max_mask_len]: column j of row t is KV index mask_start[seq(t)] + j; or the same packed,
    # int32 [T, words] with bit j of word w for column 32 w + j (``kernels.attention.unpack_mask``):
    # every set's ``prepare_attention`` takes either. None means causal (each new token sees the cached
    # tokens and the new ones up to itself).
    custom_mask: torch.Tensor | None = None
    mask_start: torch.Tensor | None = None  # int64 [B], with custom_mask
    # bool [B, max_query_len, max_seq_len]: the reference attention's dense visibility mask,
    # built once per step by ``prepare_attention_ref`` rather than once per layer.
    dense_mask: torch.Tensor | None = None
    # A graphed step of ragged chunks (prompts; ``max_query_len`` is then the step's capacity of
    # tokens): attention's programs each find their sequence and query tile from ``query_start_loc``,
    # so its grid depends on that capacity alone, not on B x the longest chunk's tiles.
    ragged: bool = False

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]
