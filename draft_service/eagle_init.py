"""Fresh EAGLE-3 heads for a target: config and randomly initialised weights.

Used to smoke-test the speculative path before a head is trained (acceptance near zero is
expected), and as the starting point of training.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draft_service.eagle_config import DraftConfig
from draft_service.eagle_loader import save_eagle
from draft_service.eagle_net import EagleNet


def draft_raw_config(target_raw_config: dict, draft_vocab: int, **overrides) -> dict:
    """A draft config.json matching the target; an override of None removes that key."""
    t = target_raw_config
    raw = {
        "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1,
        "hidden_size": t["hidden_size"], "target_hidden_size": t["hidden_size"],
        "num_attention_heads": t["num_attention_heads"],
        "num_key_value_heads": t.get("num_key_value_heads", t["num_attention_heads"]),
        "intermediate_size": t["intermediate_size"], "rms_norm_eps": t.get("rms_norm_eps", 1e-5),
        "vocab_size": t["vocab_size"], "draft_vocab_size": draft_vocab,
        "rope_theta": t.get("rope_theta", 10000.0), "rope_scaling": t.get("rope_scaling"),
        "max_position_embeddings": 2048,  # what published drafts ship; never limits RoPE here
    }
    if "head_dim" in t:
        raw["head_dim"] = t["head_dim"]
    raw.update(overrides)
    return {k: v for k, v in raw.items() if v is not None}


def random_eagle_state(cfg: DraftConfig, target_ids: torch.Tensor, seed: int = 0,
                       std: float = 0.02) -> dict[str, torch.Tensor]:
    """Random weights under the checkpoint names; draft id i stands for ``target_ids[i]``."""
    assert target_ids.shape == (cfg.draft_vocab_size,)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in EagleNet(cfg).named_parameters()}
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=gen) * std
        state[name] = t + 1.0 if "norm" in name else t
    state["d2t"] = target_ids - torch.arange(cfg.draft_vocab_size)  # offsets: target = draft + d2t[draft]
    state["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    state["t2d"][target_ids] = True
    return state


def write_random_head(out_dir: str | Path, target_raw_config: dict, draft_vocab: int, seed: int = 0,
                      std: float = 0.02, form: str = "safetensors", **config_overrides) -> Path:
    """A randomly initialised head whose draft vocabulary is a random subset of the target's."""
    raw = draft_raw_config(target_raw_config, draft_vocab, **config_overrides)
    cfg = DraftConfig.from_hf(raw)
    gen = torch.Generator().manual_seed(seed + 1000)
    ids = torch.randperm(cfg.vocab_size, generator=gen)[:draft_vocab]
    return save_eagle(random_eagle_state(cfg, ids, seed, std), raw, out_dir, form)
