"""Building a target ``CausalLM`` from checkpoint tensors, or with random weights.

The module tree is created on the meta device (no memory, no init cost) and every
parameter is then assigned from the checkpoint, cast to the serving dtype on the device.
"""

from __future__ import annotations

from typing import Iterable

import torch

from common.config import ModelConfig
from common.errors import CheckpointError
from verify_service.model import CausalLM

# Tensors some exporters store that the runtime derives itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_weights(model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]],
                 dtype: torch.dtype, device) -> None:
    """Assign checkpoint tensors to ``model``'s parameters; every parameter must be provided once."""
    expected = {name: p.shape for name, p in model.named_parameters()}
    state = {}
    for name, tensor in tensors:
        if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and name not in expected):
            continue  # tied checkpoints sometimes also store lm_head; the embedding is used
        if name not in expected:
            raise CheckpointError(f"unexpected tensor {name!r} for a {model.config.architecture}")
        if tuple(tensor.shape) != tuple(expected[name]):
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, the config implies {tuple(expected[name])}")
        state[name] = tensor.to(device=device, dtype=dtype)
    missing = sorted(set(expected) - set(state))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensors: {shown}")
    model.load_state_dict(state, strict=True, assign=True)


def build_model(cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                device, max_positions: int) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(cfg)
    load_weights(model, tensors, dtype, device)
    model.fuse_projections()
    model.init_rope(max_positions)
    return model.eval().requires_grad_(False)


def random_tensors(cfg: ModelConfig, seed: int = 0, std: float = 0.02, device="cpu",
                   dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random weights with the checkpoint's names and shapes (norm weights near 1)."""
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in CausalLM(cfg).named_parameters()}
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * std
        out[name] = (t + 1.0 if "norm" in name else t).to(dtype)
    return out
