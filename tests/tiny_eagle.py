"""Tiny random EAGLE-3 draft checkpoints that fit the tiny targets of ``tiny_models``."""

from __future__ import annotations

from pathlib import Path

import torch

from draft_service.eagle_init import draft_raw_config, write_random_head

__all__ = ["chosen_target_ids", "draft_raw_config", "make_eagle_dir"]


def chosen_target_ids(vocab: int, draft_vocab: int, seed: int = 0) -> torch.Tensor:
    """The target ids of draft ids 0..draft_vocab-1 chosen by ``make_eagle_dir`` with ``seed``."""
    gen = torch.Generator().manual_seed(seed + 1000)
    return torch.randperm(vocab, generator=gen)[:draft_vocab]


def make_eagle_dir(root: Path, target_raw_config: dict, draft_vocab: int, form: str = "safetensors",
                   seed: int = 0, std: float = 0.1, **config_overrides) -> Path:
    """A tiny random EAGLE-3 checkpoint (config.json + weights in ``form``) under ``root``."""
    config_overrides.setdefault("intermediate_size", 80)
    return write_random_head(root, target_raw_config, draft_vocab, seed, std, form, **config_overrides)


def make_target_and_head(root: Path, **overrides) -> tuple[Path, Path]:
    """The tiny llama3 target (seed 5) and a random EAGLE-3 head for it: the pair the service tests
    run. ``overrides`` (e.g. ``num_hidden_layers=2``) change both configs."""
    from tiny_models import make_model_dir, tiny_config

    return (make_model_dir(root / "target", "llama3", seed=5, std=0.3, **overrides),
            make_eagle_dir(root / "draft", tiny_config("llama3", **overrides), draft_vocab=64, seed=1))


def run_steps(engine, prompts: list[list[int]], params: list) -> list[tuple[list, list]]:
    """Run ``prompts`` to the end, step by step: per step, the tokens each sequence committed (by
    sequence: the order of a step's events is no contract), then every live sequence's next tree
    (tokens and parents). Two engines that draft alike give equal lists."""
    for prompt, p in zip(prompts, params):
        engine.add_request(prompt, p)
    steps = []
    while engine.has_work:
        events = engine.step()
        engine.attach_trees()  # a chained step's trees come with the next step: taken now, to compare
        steps.append((sorted((e.seq_id, e.token_ids) for e in events),
                      sorted((s.seq_id, s.tree.tokens.tolist(), s.tree.parents.tolist())
                             for s in engine.sequences.values() if s.tree is not None)))
    return steps
