"""The target bundle: model, paged KV cache, block manager, runner and tokenizer, built from config."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from common.config import ModelConfig
from common.errors import InvalidRequestError
from hub.checkpoint import iter_tensors
from hub.tokenizer import Tokenizer, validate_messages
from kernels import exact_by_default, select_kernels
from runtime.block_manager import BlockManager, blocks_for
from runtime.kv_cache import PagedKVCache
from runtime.memory import check_fits, rope_table_bytes
from verify_service.config import EngineConfig
from verify_service.loader import build_model
from verify_service.model import CausalLM
from verify_service.model_runner import ModelRunner

log = logging.getLogger(__name__)
_CPU_KV_GIB = 2.0
_GPU_KV_FRACTION = 0.9


class Target:
    def __init__(self, cfg: EngineConfig, model: CausalLM, tokenizer: Tokenizer | None,
                 capture_layers: tuple[int, ...] = ()):
        self.cfg = cfg
        self.model = model
        self.model_config: ModelConfig = model.config
        self.tokenizer = tokenizer
        self.device = model.model.norm.weight.device
        self.dtype = model.model.norm.weight.dtype
        self.max_model_len = model.cos.shape[0]
        num_blocks = self._num_kv_blocks()
        per_block = PagedKVCache.bytes_per_block(self.model_config, cfg.block_size, self.dtype)
        check_fits(f"KV cache of {num_blocks} blocks of {cfg.block_size} tokens", num_blocks * per_block, self.device)
        self.kv_cache = PagedKVCache.for_model(self.model_config, num_blocks, cfg.block_size, self.dtype, self.device)
        self.blocks = BlockManager(num_blocks, cfg.block_size)
        chunk = None
        exact = cfg.exact if cfg.exact is not None else exact_by_default(self.device.type, cfg.kernels)
        if exact:  # the attention's fold chunk: one for the model, for every step
            from kernels.exact_set import fold_chunk
            chunk = fold_chunk(self.model_config.num_kv_heads, self.model_config.head_dim)
        kernels = select_kernels(self.device, cfg.kernels, exact=exact, exact_chunk=chunk)
        self.exact = kernels.name == "exact"  # batch-invariant numerics (ServerInfo.exact_numerics)
        if kernels.name == "exact" and self.device.type == "cuda":  # before any step and any graph's capture
            from kernels.attention_exact import TREE_WIDE_ROWS, WIDE_TILE, probe_wide_tile, tree_wide_wanted
            from kernels.exact_set import probe_layer
            mc = self.model_config
            g = mc.num_heads // mc.num_kv_heads
            log.info("exact numerics: attention folds chunks of %d keys; the fast path's row tiles keep a row's "
                     "bits on %s: %s; the attention's %d-row tile for prompts keeps them: %s", chunk, self.device,
                     probe_layer(model.model.layers[0]), WIDE_TILE[0],
                     probe_wide_tile(self.device, self.dtype, g, mc.head_dim, chunk))
            if tree_wide_wanted(self.max_model_len, chunk):  # (graphed steps see the capacity as their keys)
                log.info("exact numerics: the attention's %d-row tile for a tree's prefix keeps a row's bits: %s",
                         TREE_WIDE_ROWS, probe_wide_tile(self.device, self.dtype, g, mc.head_dim, chunk, tile="tree"))
        graphs = not cfg.enforce_eager and (self.device.type == "cuda" and kernels.name in ("triton", "exact")
                                            or self.device.type == "cpu" and cfg.graphs_on_cpu)
        self.runner = ModelRunner(model, self.kv_cache, kernels, capture_layers, graphs, cfg.max_num_seqs)
        log.info("target engine: %s on %s/%s, %d KV blocks of %d tokens, context %d, %s kernels, %s",
                 self.model_config.architecture, self.device, self.dtype, num_blocks, cfg.block_size,
                 self.max_model_len, kernels.name,
                 ("CUDA graphs" if self.device.type == "cuda" else "graphs run eagerly") if graphs else "eager")

    @classmethod
    def from_config(cls, cfg: EngineConfig, capture_layers: tuple[int, ...] = ()) -> "Target":
        model_cfg = ModelConfig.from_dir(cfg.model_dir)
        device = cfg.torch_device()
        max_len = cfg.max_model_len or model_cfg.max_position_embeddings
        check_fits(f"max_model_len {max_len} (RoPE tables)", rope_table_bytes(model_cfg.head_dim, max_len), device)
        model = build_model(model_cfg, iter_tensors(cfg.model_dir), cfg.torch_dtype(device), device, max_len)
        has_tokenizer = (Path(cfg.model_dir) / "tokenizer.json").is_file()
        return cls(cfg, model, Tokenizer(cfg.model_dir) if has_tokenizer else None, capture_layers)

    def _num_kv_blocks(self) -> int:
        if self.cfg.num_kv_blocks is not None:
            return self.cfg.num_kv_blocks
        per_block = PagedKVCache.bytes_per_block(self.model_config, self.cfg.block_size, self.dtype)
        if self.cfg.kv_cache_gib is not None:
            budget = self.cfg.kv_cache_gib * 2**30
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * _GPU_KV_FRACTION
        else:
            budget = _CPU_KV_GIB * 2**30
        wanted = self.cfg.max_num_seqs * blocks_for(self.max_model_len, self.cfg.block_size)
        return max(1, min(int(budget // per_block), wanted))

    def validate_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise InvalidRequestError("prompt", "the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < vocab)), None)
        if bad is not None:
            raise InvalidRequestError("prompt_token_ids", f"token id {bad!r} is outside the vocabulary [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"the prompt has {len(prompt_ids)} tokens; the context holds {self.max_model_len} "
                          "including at least one generated token")

    def encode(self, prompt: str | None = None, messages: list[dict] | None = None) -> list[int]:
        """Token ids of a text prompt or of chat messages rendered with the model's template."""
        if messages is not None:
            validate_messages(messages)
        if self.tokenizer is None:
            raise InvalidRequestError("prompt", "this model has no tokenizer: send token ids")
        if messages is not None:
            return self.tokenizer.encode_chat(messages)
        if not prompt:
            raise InvalidRequestError("prompt", "the prompt is empty")
        return self.tokenizer.encode(prompt)
