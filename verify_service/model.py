"""The target decoder: Llama 3, Qwen2/2.5, Qwen3 and SmolLM2 in one module tree.

Module paths equal Hugging Face checkpoint names (``model.layers.3.self_attn.q_proj``), so
loading is a loop over the safetensors entries. ``forward`` takes a flat batch of new
tokens [T] plus explicit ``AttentionMetadata`` and the paged KV cache; it returns the
final-normed hidden states and, for EAGLE-3, the hidden states *entering* chosen layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from common.config import ModelConfig
from kernels import KernelSet
from kernels.metadata import AttentionMetadata
from runtime.kv_cache import PagedKVCache
from runtime.layers import MLP, Attention, RMSNorm, StepContext
from runtime.rope import rope_tables


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        qk_norm_eps = cfg.rms_norm_eps if cfg.qk_norm else None  # Qwen3
        self.self_attn = Attention(cfg.hidden_size, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                   layer_idx, cfg.attention_bias, qk_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, normed: torch.Tensor, residual: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """``normed``: input_layernorm(residual), computed by the caller (which also reads the
        residual stream entering the layer). Returns (MLP output, residual stream): their sum,
        the stream leaving the layer, is formed by the next norm (the add fused into it)."""
        x = self.self_attn(normed, ctx)
        norm = self.post_attention_layernorm
        normed, residual = ctx.kernels.rms_norm(x, norm.weight, norm.eps, residual)
        return self.mlp(normed, ctx.kernels), residual


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass(frozen=True, slots=True)
class ForwardOutput:
    hidden: torch.Tensor  # [T, hidden], after the final norm
    captured: torch.Tensor | None  # [T, len(capture_layers) * hidden], layer inputs in the requested order


class CausalLM(nn.Module):
    """Llama-family decoder with an LM head. Build on the meta device, then load weights."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def init_rope(self, max_positions: int) -> None:
        """Build the RoPE tables for the runtime context length (not the config's)."""
        cfg = self.config
        self.cos, self.sin = rope_tables(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_positions,
                                         self.model.norm.weight.device)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: PagedKVCache,
                kernels: KernelSet, capture_layers: tuple[int, ...] = ()) -> ForwardOutput:
        assert self.cos is not None, "call init_rope() before forward()"
        ctx = StepContext(meta, kv_cache, self.cos, self.sin, kernels)
        x, residual = self.model.embed_tokens(input_ids), None  # (T, hidden)
        captured = {}
        for i, layer in enumerate(self.model.layers):
            norm = layer.input_layernorm
            normed, residual = kernels.rms_norm(x, norm.weight, norm.eps, residual)  # residual: the stream entering layer i
            if i in capture_layers:
                captured[i] = residual
            x, residual = layer(normed, residual, ctx)
        hidden, _ = kernels.rms_norm(x, self.model.norm.weight, self.model.norm.eps, residual)
        feats = torch.cat([captured[i] for i in capture_layers], dim=-1) if capture_layers else None
        return ForwardOutput(hidden, feats)

    def fuse_projections(self) -> None:
        """Serving layout: one matmul for q/k/v and one for gate/up in every layer."""
        for layer in self.model.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor, linear: Callable = F.linear) -> torch.Tensor:
        """Logits [N, vocab] in float32 for the rows of ``hidden`` that need them; ``linear`` is the
        kernel set's matmul (the batch-invariant one in exact mode)."""
        return linear(hidden, self.lm_head_weight()).float()
