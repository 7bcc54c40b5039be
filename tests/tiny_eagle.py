"""Tiny random EAGLE-3 draft checkpoints that fit the tiny targets of ``tiny_models``."""

from __future__ import annotations

from pathlib import Path

import torch

from draft_service.eagle_config import DraftConfig
from draft_service.eagle_loader import save_eagle
from draft_service.eagle_net import EagleNet


def draft_raw_config(target_raw_config: dict, draft_vocab: int, **overrides) -> dict:
    """A draft config.json for the target; an override of None removes that key."""
    t = target_raw_config
    raw = {
        "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1,
        "hidden_size": t["hidden_size"], "target_hidden_size": t["hidden_size"],
        "num_attention_heads": t["num_attention_heads"],
        "num_key_value_heads": t.get("num_key_value_heads", t["num_attention_heads"]),
        "intermediate_size": 80, "rms_norm_eps": 1e-5,
        "vocab_size": t["vocab_size"], "draft_vocab_size": draft_vocab,
        "rope_theta": t.get("rope_theta", 10000.0), "rope_scaling": t.get("rope_scaling"),
        "max_position_embeddings": 2048,  # what published drafts ship; must not limit RoPE
    }
    raw.update(overrides)
    return {k: v for k, v in raw.items() if v is not None}


def chosen_target_ids(vocab: int, draft_vocab: int, seed: int = 0) -> torch.Tensor:
    """The target ids of draft ids 0..draft_vocab-1 (a random subset, random order)."""
    gen = torch.Generator().manual_seed(seed + 1000)
    return torch.randperm(vocab, generator=gen)[:draft_vocab]


def random_eagle_state(cfg: DraftConfig, seed: int = 0, std: float = 0.1) -> dict[str, torch.Tensor]:
    """Random weights under the checkpoint names, plus a correct d2t / t2d."""
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in EagleNet(cfg).named_parameters()}
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=gen) * std
        state[name] = t + 1.0 if "norm" in name else t
    ids = chosen_target_ids(cfg.vocab_size, cfg.draft_vocab_size, seed)
    state["d2t"] = ids - torch.arange(cfg.draft_vocab_size)  # offsets: target = draft + d2t[draft]
    state["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    state["t2d"][ids] = True
    return state


def make_eagle_dir(root: Path, target_raw_config: dict, draft_vocab: int, form: str = "safetensors",
                   seed: int = 0, std: float = 0.1, **config_overrides) -> Path:
    """Write a tiny random EAGLE-3 checkpoint (config.json + weights in ``form``) under ``root``."""
    raw = draft_raw_config(target_raw_config, draft_vocab, **config_overrides)
    state = random_eagle_state(DraftConfig.from_hf(raw), seed, std)
    return save_eagle(state, raw, root, form)
