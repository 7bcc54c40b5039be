"""Tiny random-weight model directories for each Llama-family variant (fast CPU tests)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from common.config import ModelConfig
from verify_service.config import EngineConfig
from verify_service.target import Target
from verify_service.loader import random_tensors

BASE = {
    "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "max_position_embeddings": 256, "eos_token_id": 96, "bos_token_id": 95,
}

VARIANTS = {
    "llama3": {"architectures": ["LlamaForCausalLM"], "rope_theta": 500000.0,
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": True},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "head_dim": 32},
    "smollm2": {"architectures": ["LlamaForCausalLM"], "tie_word_embeddings": True,
                "num_key_value_heads": 1, "num_hidden_layers": 5},
}


def tiny_config(variant: str = "llama3", **overrides) -> dict:
    return {**BASE, **VARIANTS[variant], **overrides}


def make_model_dir(root: Path, variant: str = "llama3", seed: int = 0, std: float = 0.1,
                   shards: int = 1, **overrides) -> Path:
    """Write config.json + safetensors (sharded with an index when shards > 1) under ``root``."""
    raw = tiny_config(variant, **overrides)
    cfg = ModelConfig.from_hf(raw)
    tensors = random_tensors(cfg, seed=seed, std=std)
    if cfg.attention_bias:  # random biases, so the bias path is really exercised
        tensors = {k: (v + 0.05 if k.endswith(".bias") else v) for k, v in tensors.items()}
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(raw))
    if shards == 1:
        save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
        return root
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(root / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


# The suite runs on the CPU in float32 by default; on a GPU host set EAGLE3_TEST_DEVICE=cuda
# and EAGLE3_TEST_DTYPE=bfloat16 to run the same tests there (tolerances follow the dtype).
TEST_DEVICE = os.environ.get("EAGLE3_TEST_DEVICE", "cpu")
TEST_DTYPE = os.environ.get("EAGLE3_TEST_DTYPE", "float32")
# Where the Triton kernels run: natively on a GPU, else on the CPU through Triton's interpreter.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# EAGLE3_TEST_GRAPHS_ON_CPU=1: every ``target_for`` engine on a CPU takes the graphed paths (each replay
# an eager forward, ``EngineConfig.graphs_on_cpu``) unless its test says otherwise: a sweep of the GPU's
# step paths on the CPU. Tests that pin the eager paths' own counts then fail by design; a crash is a bug.
GRAPHS_ON_CPU = os.environ.get("EAGLE3_TEST_GRAPHS_ON_CPU", "") == "1"
_TOLERANCES = {"float32": (2e-5, 1e-4), "float16": (2e-2, 2e-2), "bfloat16": (8e-2, 5e-2)}


def tolerance(dtype: str = TEST_DTYPE) -> dict:
    """assert_close tolerances for logits computed in ``dtype``."""
    atol, rtol = _TOLERANCES[dtype]
    return {"atol": atol, "rtol": rtol}


def target_for(model_dir: Path, capture: tuple[int, ...] = (), **overrides) -> Target:
    """A small engine on the test device; ``overrides`` are EngineConfig fields. The fast kernels
    unless ``exact`` says otherwise (on CUDA the engine's default is the exact set: the tests that
    want it ask for it, the rest keep testing the fast set on the GPU too)."""
    kw = {"kv_cache_gib": 0.01, "max_num_seqs": 4, "device": TEST_DEVICE, "dtype": TEST_DTYPE,
          "graphs_on_cpu": GRAPHS_ON_CPU, "exact": False, **overrides}
    return Target.from_config(EngineConfig(str(model_dir), **kw), capture_layers=capture)
