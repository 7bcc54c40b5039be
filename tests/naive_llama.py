"""Naive dense reference forward pass for Llama-family decoders (TEST ORACLE).

This module is the independent test oracle used to check the production
implementation. It is written only from the public Hugging Face model
definitions (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM) and is
deliberately simple: float64 math, plain Python loops over layers and heads,
full causal attention over one sequence at positions 0..T-1, no KV cache, no
fused kernels, no tricks. Do not optimise it; its value is being obviously
correct.

Supported: grouped-query attention, optional q/k/v/o and MLP biases (Qwen2,
Llama attention_bias/mlp_bias), Qwen3 per-head q_norm/k_norm (before RoPE),
tied embeddings, RoPE ("rotate half") with rope_scaling None/default, linear
or llama3. Anything else raises NotImplementedError.
"""
import math

import torch

F64 = torch.float64


def _w(weights, name):
    return weights[name].to(F64)


def _linear(x, weights, prefix):
    """y = x @ W^T (+ b if a bias tensor is present), HF nn.Linear semantics."""
    y = x @ _w(weights, prefix + ".weight").T
    if prefix + ".bias" in weights:
        y = y + _w(weights, prefix + ".bias")
    return y


def _rms_norm(x, w, eps):
    return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + eps) * w


def _inv_freq(config, head_dim):
    theta = float(config.get("rope_theta", 10000.0))
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=F64) / head_dim)
    rs = config.get("rope_scaling")
    if rs is None:
        return inv_freq
    rope_type = rs.get("rope_type", rs.get("type"))
    if rope_type in (None, "default"):
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rs["factor"])
    if rope_type == "llama3":
        # Mirrors transformers' _compute_llama3_parameters.
        factor = float(rs["factor"])
        low_ff = float(rs["low_freq_factor"])
        high_ff = float(rs["high_freq_factor"])
        old_ctx = float(rs["original_max_position_embeddings"])
        low_freq_wavelen = old_ctx / low_ff
        high_freq_wavelen = old_ctx / high_ff
        wavelen = 2 * math.pi / inv_freq
        out = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * out / factor + smooth * out
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, out)
    raise NotImplementedError(f"rope_scaling type {rope_type!r} not supported by the oracle")


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def naive_forward(config: dict, weights: dict, input_ids, capture_layers: tuple = ()):
    """Returns (logits [T, vocab] float64, [hidden state ENTERING layer i,
    [T, hidden] float64 for i in capture_layers]).

    Layer index i = 0 is the token embeddings; i = num_hidden_layers is the
    output of the last decoder layer (before the final norm).
    """
    if config.get("use_sliding_window"):
        raise NotImplementedError("sliding-window attention not supported by the oracle")
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
    T = ids.shape[0]
    hidden = config["hidden_size"]
    n_layers = config["num_hidden_layers"]
    n_heads = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads") or n_heads
    head_dim = config.get("head_dim") or hidden // n_heads
    eps = float(config.get("rms_norm_eps", 1e-6))
    group = n_heads // n_kv
    assert n_heads % n_kv == 0
    for i in capture_layers:
        assert 0 <= i <= n_layers, f"capture layer {i} out of range"

    # RoPE tables, cos/sin duplicated over the two halves of head_dim: [T, head_dim].
    freqs = torch.outer(torch.arange(T, dtype=F64), _inv_freq(config, head_dim))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()

    def rope(x):  # x: [T, head_dim]
        return x * cos + _rotate_half(x) * sin

    causal = torch.ones(T, T, dtype=torch.bool).tril()
    scale = 1.0 / math.sqrt(head_dim)

    embed = _w(weights, "model.embed_tokens.weight")
    h = embed[ids].clone()
    captured = {}
    for layer in range(n_layers):
        if layer in capture_layers:
            captured[layer] = h.clone()
        p = f"model.layers.{layer}."

        # --- self attention ---
        x = _rms_norm(h, _w(weights, p + "input_layernorm.weight"), eps)
        q = _linear(x, weights, p + "self_attn.q_proj").reshape(T, n_heads, head_dim)
        k = _linear(x, weights, p + "self_attn.k_proj").reshape(T, n_kv, head_dim)
        v = _linear(x, weights, p + "self_attn.v_proj").reshape(T, n_kv, head_dim)
        if p + "self_attn.q_norm.weight" in weights:  # Qwen3: per-head RMSNorm before RoPE
            q = _rms_norm(q, _w(weights, p + "self_attn.q_norm.weight"), eps)
        if p + "self_attn.k_norm.weight" in weights:
            k = _rms_norm(k, _w(weights, p + "self_attn.k_norm.weight"), eps)
        heads_out = []
        for hd in range(n_heads):
            kv = hd // group  # GQA: query head hd reads kv head hd // group
            qh, kh, vh = rope(q[:, hd]), rope(k[:, kv]), v[:, kv]
            scores = (qh @ kh.T) * scale
            scores = scores.masked_fill(~causal, float("-inf"))
            heads_out.append(torch.softmax(scores, dim=-1) @ vh)
        attn = torch.cat(heads_out, dim=-1)  # [T, n_heads * head_dim], head-major
        h = h + _linear(attn, weights, p + "self_attn.o_proj")

        # --- SiLU-gated MLP ---
        x = _rms_norm(h, _w(weights, p + "post_attention_layernorm.weight"), eps)
        gate = _linear(x, weights, p + "mlp.gate_proj")
        up = _linear(x, weights, p + "mlp.up_proj")
        h = h + _linear(torch.nn.functional.silu(gate) * up, weights, p + "mlp.down_proj")

    if n_layers in capture_layers:
        captured[n_layers] = h.clone()
    h = _rms_norm(h, _w(weights, "model.norm.weight"), eps)
    # HF ties lm_head to the embeddings when tie_word_embeddings (the checkpoint
    # then usually omits lm_head.weight).
    tied = config.get("tie_word_embeddings", False) or "lm_head.weight" not in weights
    lm_head = embed if tied else _w(weights, "lm_head.weight")
    logits = h @ lm_head.T
    return logits, [captured[i] for i in capture_layers]
