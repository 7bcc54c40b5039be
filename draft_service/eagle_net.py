"""The EAGLE-3 draft head: one Llama-style layer over [token embedding ; target features].

Module paths equal the checkpoint names (``fc``, ``midlayer.self_attn.q_proj``, ``lm_head``,
buffers ``d2t`` / ``t2d``), so loading is a name-by-name assignment. The token embedding is
the TARGET's table, attached by reference, never a parameter of its own.

One step over T new tokens (H = draft width, Ht = target width)::

    features [T, 3*Ht] --fc--> h [T, H]          (skipped when the input is already H wide)
    x   = [input_layernorm(embed(ids)) ; hidden_norm(h)]           [T, 2H]
    h   = h + o_proj(paged_attention(rope(q(x)), rope(k(x)), v(x)))  own one-layer KV cache
    out = h + mlp(post_attention_layernorm(h))                      [T, H], fed back next step
    logits = lm_head(norm(out))                                     [N, draft_vocab]
    target_id = draft_id + d2t[draft_id]
"""

from __future__ import annotations

import os

import torch
from torch import nn

from draft_service.eagle_config import DraftConfig
from kernels import KernelSet
from kernels.metadata import AttentionMetadata
from runtime.kv_cache import PagedKVCache
from runtime.layers import MLP, Attention, RMSNorm, StepContext
from runtime.rope import rope_tables


# ``EagleNet.extend``'s few-row path (``EAGLE3_DRAFT_FUSED_EXTEND=0``: every extend through ``forward``
# and ``compute_logits``, as before; read at import, for A/B runs).
FUSED_EXTEND = os.environ.get("EAGLE3_DRAFT_FUSED_EXTEND", "1") != "0"
_OWN_ROWS: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _own_rows(T: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.level_input``'s arguments for T rows that are their own parents, and no feed mask:
    slots [1, T] = 0 .. T-1 and a mask word of zeros a row [T, 1]. Made once (the first call runs
    eagerly, before a graph captures the extend) and kept."""
    key = (T, torch.device(device))
    got = _OWN_ROWS.get(key)
    if got is None:
        got = _OWN_ROWS[key] = (torch.arange(T, device=device)[None], torch.zeros(T, 1, dtype=torch.int32, device=device))
    return got


class MidLayer(nn.Module):
    """The single draft decoder layer (checkpoint prefix ``midlayer.``)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on the fused features
        # q/k/v read the 2H-wide [embedding ; features]; o_proj writes H; the draft cache holds one layer.
        self.self_attn = Attention(2 * cfg.hidden_size, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                                   cfg.head_dim, layer_idx=0)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, emb: torch.Tensor, h: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """The norms through the kernel set (one launch each on the GPU sets; the reference is this
        module's RMSNorm, bit for bit), the residual add folded into the post-attention norm."""
        k = ctx.kernels
        x = torch.cat((k.rms_norm(emb, self.input_layernorm.weight, self.input_layernorm.eps)[0],
                       k.rms_norm(h, self.hidden_norm.weight, self.hidden_norm.eps)[0]), dim=-1)  # (T, 2H)
        return self.forward_normed(x, h, ctx)

    def forward_normed(self, x: torch.Tensor, h: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``forward`` from its normed input x = [input_layernorm(emb) ; hidden_norm(h)] [T, 2H]."""
        k = ctx.kernels
        normed, h = k.rms_norm(self.self_attn(x, ctx), self.post_attention_layernorm.weight,
                               self.post_attention_layernorm.eps, residual=h)  # h + attention, normed
        return h + self.mlp(normed, k)

    def forward_rows(self, x: torch.Tensor, h: torch.Tensor, ctx: StepContext,
                     final_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``forward_normed`` as a few-row step: the projections with the residual adds, the norm and
        the activation in their epilogues (``kernels/fused_linear.py``), the last one forming the
        head's ``final_norm`` too, and RoPE with the KV write in the q/k/v projection's where the kernel
        set has it (``Attention.project_attend``). Returns (out, out * final_norm.weight, the partial
        sums of out^2): the output fed back next step, and the LM head's scaled input."""
        k, attn, mlp = ctx.kernels, self.self_attn, self.mlp
        norm2 = self.post_attention_layernorm
        h, hn, ss = k.linear_add_norm(attn.project_attend(x, None, 0.0, ctx), attn.o_proj.weight, h, norm2.weight)
        act = k.scaled_gate_up_silu(hn, ss, norm2.eps, mlp.gate_up_weight)
        return k.linear_add_norm(act, mlp.down_proj.weight, h, final_norm.weight)


class EagleNet(nn.Module):
    """EAGLE-3 draft head. Build on the meta device, load weights, attach the target embedding."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))  # offsets
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        self.embed_weight: torch.Tensor | None = None  # the target's table, by reference
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def attach_embedding(self, weight: torch.Tensor) -> None:
        """Use the target's token embedding [vocab, H] (shared storage, no copy)."""
        cfg = self.config
        assert tuple(weight.shape) == (cfg.vocab_size, cfg.hidden_size),\
            f"target embedding {tuple(weight.shape)} != ({cfg.vocab_size}, {cfg.hidden_size})"
        self.embed_weight = weight.detach()  # a Parameter would register here and join the draft's weights

    def init_rope(self, max_positions: int) -> None:
        """Build the RoPE tables for the runtime context length (never the config's 2048)."""
        cfg = self.config
        self.cos, self.sin = rope_tables(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_positions,
                                         self.norm.weight.device)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                kv_cache: PagedKVCache, kernels: KernelSet) -> torch.Tensor:
        """One draft step over T new tokens -> pre-norm output [T, H] (next step's ``hidden``).

        ``input_ids`` [T] are TARGET-vocabulary ids; ``hidden`` [T, 3*Ht] target features on
        the first step, or [T, H] (the draft's own output) afterwards. Writes the draft KV
        cache at ``meta.slot_mapping``.
        """
        assert self.cos is not None, "call init_rope() before forward()"
        assert self.embed_weight is not None, "call attach_embedding() before forward()"
        ctx = StepContext(meta, kv_cache, self.cos, self.sin, kernels)
        h = hidden if hidden.shape[-1] == self.config.hidden_size else self.fc(hidden)  # (T, H)
        # Indexing, not F.embedding: the same rows, through the GPU's row-gather kernel rather than
        # index_select's (which is slow for a few rows).
        emb = self.embed_weight[input_ids].to(h.dtype)  # (T, H)
        return self.midlayer(emb, h, ctx)

    def extend(self, input_ids: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata, kv_cache: PagedKVCache,
               kernels: KernelSet, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` over committed tokens, then the LM head at ``rows`` (each sequence's last row):
        (out [T, H], logits [len(rows), draft_vocab] in the head's dtype). A step of at most
        ``kernels.fused_rows`` rows goes as a tree level does (``level_logits``): the fc in one
        few-row kernel, the embedding lookup and both input norms in one launch (``kernels.level_input``,
        each row its own parent), the fused projections with the final norm in the last one's
        epilogue, and the LM head on the picked rows' scaled outputs: some ten launches fewer than
        ``forward`` and ``compute_logits`` (on an H200, the chained step's extend of a SmolLM2 head)."""
        T, H = input_ids.shape[0], self.config.hidden_size
        mid = self.midlayer
        if not FUSED_EXTEND or T > kernels.fused_rows(H) or mid.mlp.gate_up_weight is None:
            out = self.forward(input_ids, hidden, meta, kv_cache, kernels)
            return out, self.compute_logits(out[rows], kernels, float32=False)
        assert self.cos is not None, "call init_rope() before forward()"
        assert self.embed_weight is not None, "call attach_embedding() before forward()"
        ctx = StepContext(meta, kv_cache, self.cos, self.sin, kernels)
        h = hidden if hidden.shape[-1] == H else kernels.scaled_linear(hidden, None, 0.0, self.fc.weight)
        slots, no_mask = _own_rows(T, h.device)
        x, h, _ = kernels.level_input(h[None], slots, input_ids[None], self.embed_weight, mid.input_layernorm.weight,
                                      mid.input_layernorm.eps, mid.hidden_norm.weight, mid.hidden_norm.eps, None, no_mask)
        out, outn, ss = mid.forward_rows(x, h, ctx, self.norm)
        return out, kernels.scaled_linear(outn[rows], ss[:, rows], self.norm.eps, self.lm_head.weight)

    def level_logits(self, x: torch.Tensor, h: torch.Tensor, meta: AttentionMetadata, kv_cache: PagedKVCache,
                     kernels: KernelSet, float32: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """A tree level's step from its normed input ``x`` [T, 2H] and features ``h`` [T, H]
        (``kernels.level_input``): (out [T, H], logits [T, draft_vocab]). A step of at most
        ``kernels.fused_rows`` rows takes the fused projections, the final norm in the last one's
        epilogue: three launches fewer a level on the GPU."""
        assert self.cos is not None, "call init_rope() before forward()"
        ctx = StepContext(meta, kv_cache, self.cos, self.sin, kernels)
        if x.shape[0] > kernels.fused_rows(self.config.hidden_size) or self.midlayer.mlp.gate_up_weight is None:
            out = self.midlayer.forward_normed(x, h, ctx)
            return out, self.compute_logits(out, kernels, float32)
        out, outn, ss = self.midlayer.forward_rows(x, h, ctx, self.norm)
        logits = kernels.scaled_linear(outn, ss, self.norm.eps, self.lm_head.weight)
        return out, logits.float() if float32 else logits

    def compute_logits(self, out: torch.Tensor, kernels: KernelSet | None = None, float32: bool = True) -> torch.Tensor:
        """Draft-vocabulary logits [N, draft_vocab] in float32 for pre-norm outputs [N, H] (the norm and
        the LM head through ``kernels`` when given). ``float32`` off: in the head's dtype (for a top-k
        that upcasts as it reads: no float32 copy of the whole vocabulary's logits)."""
        if kernels is None:
            logits = self.lm_head(self.norm(out))
        else:
            logits = kernels.linear(kernels.rms_norm(out, self.norm.weight, self.norm.eps)[0], self.lm_head.weight)
        return logits.float() if float32 else logits

    def fuse_projections(self) -> None:
        """Inference only: one q/k/v and one gate/up matmul (``runtime/layers.py``)."""
        self.midlayer.self_attn.fuse_projections()
        self.midlayer.mlp.fuse_projections()
