"""EAGLE-3 training-time test: the draft unrolled over K steps, as it runs at inference.

Step 0 is the draft over committed rows: row i pairs target feature f_i with token
x_{i+1}, sits at position i and predicts x_{i+2}. Step s >= 1 is a depth-s tree node of the
chain hanging below row i: its hidden input is the draft's OWN output of step s-1 at row i,
its token is x_{i+1+s}, its position i + s, and it predicts x_{i+2+s}. Like a tree node, it
attends to the committed rows 0..i (step-0 keys) and to its ancestors (step-j keys of row i,
1 <= j <= s)::

    keys seen by step s, row i:   K0[0..i]  |  K1[i]  K2[i] ... Ks[i]
                                  causal    |  one "diagonal" key per earlier step

Dense and differentiable (no paged cache), for training; the inference path must agree
with it (tests/test_training.py checks steps 0 and 1 against the drafter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from draft_service.eagle_net import EagleNet
from kernels.rope import apply_rope_ref


@dataclass
class TTTOutput:
    logits: list[torch.Tensor]  # per step: [B, T, draft_vocab] float32, row i predicts x_{i+2+s}


def _rope(x: torch.Tensor, positions: torch.Tensor, net: EagleNet) -> torch.Tensor:
    """RoPE on [B, T, heads, d] at positions [T]."""
    B, T, h, d = x.shape
    flat = x.reshape(B * T, h, d)
    return apply_rope_ref(flat, positions.repeat(B), net.cos, net.sin).view(B, T, h, d)


def _qkv(net: EagleNet, emb: torch.Tensor, h: torch.Tensor):
    layer = net.midlayer
    att = layer.self_attn
    x = torch.cat((layer.input_layernorm(emb), layer.hidden_norm(h)), dim=-1)  # (B, T, 2H)
    B, T, _ = x.shape
    q = att.q_proj(x).view(B, T, att.num_heads, att.head_dim)
    k = att.k_proj(x).view(B, T, att.num_kv_heads, att.head_dim)
    v = att.v_proj(x).view(B, T, att.num_kv_heads, att.head_dim)
    return q, k, v


def _attend(q, keys, values, scale: float) -> torch.Tensor:
    """q [B, T, h, d]; keys/values: list (step 0 first) of [B, T, kvh, d] -> [B, T, h*d]."""
    B, T, h, d = q.shape
    g = h // keys[0].shape[2]
    expand = lambda t: t.repeat_interleave(g, dim=2).transpose(1, 2)  # noqa: E731  (B, h, T, d)
    qh = q.transpose(1, 2).float()  # (B, h, T, d)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    s0 = (qh @ expand(keys[0]).float().transpose(-1, -2)) * scale  # (B, h, T, T)
    s0 = s0.masked_fill(~causal, float("-inf"))
    diag = [(qh * expand(k).float()).sum(-1, keepdim=True) * scale for k in keys[1:]]  # (B, h, T, 1) each
    p = torch.cat([s0, *diag], dim=-1).softmax(dim=-1)
    out = p[..., :T] @ expand(values[0]).float()
    for j, v in enumerate(values[1:]):
        out = out + p[..., T + j:T + j + 1] * expand(v).float()
    return out.to(q.dtype).transpose(1, 2).reshape(B, T, h * d)


def ttt_forward(net: EagleNet, input_ids: torch.Tensor, features: torch.Tensor, steps: int) -> TTTOutput:
    """Unroll the draft ``steps`` times over sequences ``input_ids`` [B, T] with target
    features [B, T, 3*Ht] (feature i belongs to position i)."""
    B, T = input_ids.shape
    att, layer = net.midlayer.self_attn, net.midlayer
    h = net.fc(features)  # (B, T, H)
    rows = torch.arange(T, device=input_ids.device)
    keys, values, logits = [], [], []
    for s in range(steps):
        tok_idx = (rows + 1 + s).clamp(max=T - 1)  # x_{i+1+s}; rows past the end are masked in the loss
        emb = F.embedding(input_ids[:, tok_idx], net.embed_weight).to(h.dtype)
        q, k, v = _qkv(net, emb, h)
        q, k = _rope(q, rows + s, net), _rope(k, rows + s, net)
        keys.append(k)
        values.append(v)
        h = h + att.o_proj(_attend(q, keys, values, att.scale))
        h = h + layer.mlp(layer.post_attention_layernorm(h))  # the step's output, next step's hidden
        logits.append(net.compute_logits(h))
    return TTTOutput(logits)


def step_token_counts(loss_mask: torch.Tensor, steps: int) -> torch.Tensor:
    """Trained tokens of each unrolled step [steps] (step s sees positions 1+s.. of the mask)."""
    return torch.stack([loss_mask[:, 1 + s:].float().sum() for s in range(steps)])


def ttt_loss(out: TTTOutput, target_logits: torch.Tensor, loss_mask: torch.Tensor,
             step_weights: list[float] | None = None,
             denominators: torch.Tensor | None = None) -> tuple[torch.Tensor, list[dict]]:
    """Soft cross-entropy against the target's distribution restricted to the draft vocabulary.

    target_logits [B, T, Vd]: the target's logits at the draft vocabulary's target ids
    (column j is target id j + d2t[j]); position p predicts x_{p+1}; step s row i is compared with the
    target at p = i + 1 + s. loss_mask [B, T] marks positions whose prediction is trained
    (the answer). ``denominators`` [steps]: the tokens each step's loss is averaged over
    (default: this batch's, ``step_token_counts``; data-parallel training passes the sum over
    processes, so summed gradients equal one process's on the whole batch). Returns the loss
    and, per step, {"loss", "acc"} over this batch, where acc is the share of rows whose draft
    argmax equals the target's argmax (within the draft vocabulary).
    """
    T = target_logits.shape[1]
    weights = step_weights or [0.8 ** s for s in range(len(out.logits))]  # later steps matter less
    probs = target_logits.float().softmax(dim=-1)  # once for every step: step s uses rows 1+s..
    best = target_logits.argmax(dim=-1)
    total, per_step = 0.0, []
    for s, logits in enumerate(out.logits):
        n = T - 1 - s  # rows i with i + 1 + s <= T - 1
        if n <= 0:
            break
        p = probs[:, 1 + s:]  # (B, n, Vd)
        logq = logits[:, :n].float().log_softmax(dim=-1)
        mask = loss_mask[:, 1 + s:].float()
        ce_sum = (-(p * logq).sum(-1) * mask).sum()  # cross-entropy over the trained rows
        local = mask.sum().clamp(min=1.0)
        denom = local if denominators is None else denominators[s].clamp(min=1.0)
        total = total + weights[s] * ce_sum / denom
        acc = ((logits[:, :n].argmax(-1) == best[:, 1 + s:]).float() * mask).sum() / local
        per_step.append(torch.stack((ce_sum.detach() / local, acc)))
    values = torch.stack(per_step).tolist() if per_step else []  # one device sync for all steps
    return total, [{"loss": loss, "acc": acc} for loss, acc in values]
