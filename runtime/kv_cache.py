"""Paged KV cache storage: one tensor for all layers, blocks of ``block_size`` tokens.

Layout (kernel-friendly: a block's tokens are contiguous per layer)::

    data: [num_layers, 2 (k, v), num_blocks, block_size, kv_heads, head_dim]
    slot s of a sequence's KV index i  =  block_table[i // block_size] * block_size + i % block_size

Which blocks belong to which sequence is the ``BlockManager``'s business, not this class's.
"""

from __future__ import annotations

import torch

from common.config import ModelConfig


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.data = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim,
                                dtype=dtype, device=device)

    @classmethod
    def for_model(cls, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                  device) -> "PagedKVCache":
        return cls(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype, device)

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * itemsize

    def layer(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) views of one layer: [num_blocks, block_size, kv_heads, head_dim]."""
        return self.data[idx, 0], self.data[idx, 1]
