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

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x + residual``: the stream entering the layer (``x`` alone without a residual). Returns
        (MLP output, residual stream after attention, the stream entering the layer): the stream
        leaving the layer, the sum of the first two, is formed by the next norm (the add fused
        into it)."""
        k, norm1, norm2 = ctx.kernels, self.input_layernorm, self.post_attention_layernorm
        normed, entering = k.rms_norm(x, norm1.weight, norm1.eps, residual)
        normed, residual = k.rms_norm(self.self_attn(normed, ctx), norm2.weight, norm2.eps, entering)
        return self.mlp(normed, k), residual, entering

    def forward_rows(self, hn: torch.Tensor, ss: torch.Tensor | None, h: torch.Tensor, ctx: StepContext,
                     next_norm: torch.Tensor | None) -> tuple:
        """The layer as four few-row projections with the norms and the activation in their
        epilogues (``kernels/fused_linear.py``). ``h``: the stream entering the layer; ``hn``:
        h * input_layernorm.weight, with ``ss`` the partial sums of h^2 (``ss`` None: ``hn`` is
        already normed). Returns the stream leaving the layer as (h, hn, ss) for ``next_norm``;
        without one (the last layer), as (MLP output, residual stream), as ``forward`` does."""
        k, attn, mlp = ctx.kernels, self.self_attn, self.mlp
        norm2 = self.post_attention_layernorm
        a = attn.project_attend(hn, ss, self.input_layernorm.eps, ctx)
        h, hn, ss = k.linear_add_norm(a, attn.o_proj.weight, h, norm2.weight)
        act = k.scaled_gate_up_silu(hn, ss, norm2.eps, mlp.gate_up_weight)
        if next_norm is None:
            return k.scaled_linear(act, None, 0.0, mlp.down_proj.weight), h
        return k.linear_add_norm(act, mlp.down_proj.weight, h, next_norm)


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
    # With ``join`` False: those layer inputs [T, hidden] apart, in the same order (``captured`` None).
    parts: tuple[torch.Tensor, ...] = ()


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
                kernels: KernelSet, capture_layers: tuple[int, ...] = (), join: bool = True) -> ForwardOutput:
        """``join`` False: the captured layer inputs come apart (``ForwardOutput.parts``), for a
        caller that joins them only when a step feeds the draft (a captured decode graph)."""
        assert self.cos is not None, "call init_rope() before forward()"
        ctx = StepContext(meta, kv_cache, self.cos, self.sin, kernels)
        x = self.model.embed_tokens(input_ids)  # (T, hidden)
        if x.shape[0] <= kernels.fused_rows(self.config.hidden_size) and self.model.layers[0].mlp.gate_up_weight is not None:
            hidden, captured = self._forward_rows(x, ctx, capture_layers)
        else:
            hidden, captured = self._forward_layers(x, ctx, capture_layers)
        if not join:
            return ForwardOutput(hidden, None, tuple(captured[i] for i in capture_layers))
        feats = torch.cat([captured[i] for i in capture_layers], dim=-1) if capture_layers else None
        return ForwardOutput(hidden, feats)

    def _forward_layers(self, x: torch.Tensor, ctx: StepContext,
                        capture_layers: tuple[int, ...]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        residual, captured = None, {}
        for i, layer in enumerate(self.model.layers):
            x, residual, entering = layer(x, residual, ctx)
            if i in capture_layers:
                captured[i] = entering  # the stream entering layer i
        hidden, _ = ctx.kernels.rms_norm(x, self.model.norm.weight, self.model.norm.eps, residual)
        return hidden, captured

    def _forward_rows(self, x: torch.Tensor, ctx: StepContext,
                      capture_layers: tuple[int, ...]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """A small step (decode, small trees): every norm but the first and the last runs in the
        epilogue of the projection before it (``DecoderLayer.forward_rows``)."""
        layers, k, captured = self.model.layers, ctx.kernels, {}
        hn, h = k.rms_norm(x, layers[0].input_layernorm.weight, layers[0].input_layernorm.eps)
        ss = None  # hn is normed already
        for i, layer in enumerate(layers[:-1]):
            if i in capture_layers:
                captured[i] = h  # the stream entering layer i
            h, hn, ss = layer.forward_rows(hn, ss, h, ctx, layers[i + 1].input_layernorm.weight)
        if len(layers) - 1 in capture_layers:
            captured[len(layers) - 1] = h
        x, residual = layers[-1].forward_rows(hn, ss, h, ctx, None)
        hidden, _ = k.rms_norm(x, self.model.norm.weight, self.model.norm.eps, residual)
        return hidden, captured

    def fuse_projections(self) -> None:
        """Serving layout: one matmul for q/k/v and one for gate/up in every layer."""
        for layer in self.model.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor, linear: Callable = F.linear) -> torch.Tensor:
        """Logits [N, vocab] in the model's dtype for the rows of ``hidden`` that need them; ``linear``
        is the kernel set's matmul (the batch-invariant one in exact mode). Not upcast here: greedy
        tokens (``argmax``) read the model's dtype, and ``logits_to_probs`` upcasts what it samples
        from (the same float32 values). A copy to float32 of every row took 8.9 us of a SmolLM2
        speculative step (60 rows of 49,152) on an H200."""
        return linear(hidden, self.lm_head_weight())
