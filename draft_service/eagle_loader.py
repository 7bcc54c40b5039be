"""Loading (and saving) EAGLE-3 draft checkpoints, with every check a broken draft needs.

Two published forms, same tensor names:

| form            | file                | who ships it                  | how it is read                      |
|-----------------|---------------------|-------------------------------|-------------------------------------|
| safetensors     | model.safetensors   | SpecForge (may add embed_tokens) | safetensors, no code execution   |
| PyTorch pickle  | pytorch_model.bin   | official yuhuili/EAGLE3-*     | torch.load(weights_only=True) only  |

A draft that loads but maps its vocabulary wrongly does not crash: it silently drafts the
wrong tokens and acceptance collapses. So the vocabulary map is validated as hard as the
shapes: d2t must be present (when the draft vocabulary is smaller), nonzero, inside the
target vocabulary and injective, and t2d must mark exactly the ids d2t maps to.
"""

from __future__ import annotations

import json
import logging
import pickle
import re
from pathlib import Path
from typing import Mapping

import torch
from safetensors.torch import save_file
from torch import nn

from common.config import ModelConfig
from common.errors import CheckpointError, ModelNotFoundError
from draft_service.eagle_config import DraftConfig
from draft_service.eagle_net import EagleNet
from hub.checkpoint import INDEX_FILE, SINGLE_FILE, iter_tensors

log = logging.getLogger(__name__)

BIN_FILE = "pytorch_model.bin"
_EMBEDDING = "embed_tokens.weight"  # SpecForge stores a copy; the target's table is used instead
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # derived by the runtime, some exporters store it


def load_eagle(draft_dir: str | Path, target: ModelConfig, target_embedding: torch.Tensor,
               dtype: torch.dtype, device, max_positions: int) -> EagleNet:
    """Load and validate an EAGLE-3 draft for ``target``; RoPE sized for ``max_positions``."""
    cfg = DraftConfig.from_dir(draft_dir)
    cfg.check_compatible(target)
    tensors = read_draft_tensors(draft_dir)
    if tensors.pop(_EMBEDDING, None) is not None:
        log.info("draft checkpoint %s stores %s; ignored, the target's embedding is used", draft_dir, _EMBEDDING)
    d2t, t2d = vocab_maps(tensors.pop("d2t", None), tensors.pop("t2d", None), cfg)
    with torch.device("meta"):
        model = EagleNet(cfg)
    state = _checked_weights(model, tensors, dtype, device)
    state.update(d2t=d2t.to(device), t2d=t2d.to(device))
    model.load_state_dict(state, strict=True, assign=True)
    model.attach_embedding(target_embedding)
    model.init_rope(max_positions)
    return model.eval().requires_grad_(False)


def read_draft_tensors(draft_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the draft checkpoint on the CPU, from safetensors or pytorch_model.bin."""
    root = Path(draft_dir)
    if not root.is_dir():
        raise ModelNotFoundError(f"draft directory {str(root)!r} does not exist")
    if (root / SINGLE_FILE).is_file() or (root / INDEX_FILE).is_file():
        return dict(iter_tensors(root))
    if (root / BIN_FILE).is_file():
        return _read_bin(root / BIN_FILE)
    raise ModelNotFoundError(f"draft directory {str(root)!r} holds neither {SINGLE_FILE} nor {BIN_FILE}")


def _read_bin(path: Path) -> dict[str, torch.Tensor]:
    # weights_only=True: tensors, primitive containers and nothing else. Never unpickle
    # arbitrary objects from a downloaded checkpoint (that would run code from the file).
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        detail = re.search(r"WeightsUnpickler error: ([^\n]*)", str(exc))
        why = detail.group(1) if detail else str(exc).splitlines()[0]
        raise CheckpointError(f"{path} is corrupted or holds more than plain tensors "
                              f"(refused by weights-only loading: {why})") from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is corrupted or truncated: {str(exc).splitlines()[0]}") from None
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                            for k, v in obj.items()):
        raise CheckpointError(f"{path} is not a flat mapping of tensor names to tensors")
    return obj


def vocab_maps(d2t: torch.Tensor | None, t2d: torch.Tensor | None,
               cfg: DraftConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated (d2t int64 [draft_vocab] offsets, t2d bool [vocab]) for ``cfg``.

    target_id = draft_id + d2t[draft_id]; t2d[target_id] is True exactly for mapped ids.
    """
    V, Vd = cfg.vocab_size, cfg.draft_vocab_size
    if d2t is None:
        if Vd < V:
            raise CheckpointError(
                f"broken checkpoint: d2t is missing while draft_vocab_size {Vd} < vocab_size {V}; "
                "identity offsets would map draft ids to the wrong target tokens")
        d2t = torch.zeros(Vd, dtype=torch.int64)  # same vocabulary: identity map
    if tuple(d2t.shape) != (Vd,) or d2t.is_floating_point() or d2t.dtype == torch.bool:
        raise CheckpointError(f"d2t must be an integer tensor of shape ({Vd},), got {d2t.dtype} {tuple(d2t.shape)}")
    d2t = d2t.to(torch.int64)
    if Vd < V and not bool(d2t.any()):
        raise CheckpointError(
            f"broken checkpoint: d2t is all zeros while draft_vocab_size {Vd} < vocab_size {V}; "
            "it would map draft ids to the wrong target tokens")
    targets = torch.arange(Vd) + d2t  # (Vd,)
    if int(targets.min()) < 0 or int(targets.max()) >= V:
        bad = int(torch.nonzero((targets < 0) | (targets >= V))[0])
        raise CheckpointError(f"d2t maps draft id {bad} to target id {int(targets[bad])}, outside [0, {V})")
    if targets.unique().numel() != Vd:
        raise CheckpointError(f"d2t is not injective: {Vd} draft ids map to only "
                              f"{targets.unique().numel()} distinct target ids")
    mask = torch.zeros(V, dtype=torch.bool)
    mask[targets] = True
    if t2d is not None:
        _check_t2d(t2d, mask)
    return d2t, mask


def _check_t2d(t2d: torch.Tensor, mask: torch.Tensor) -> None:
    if tuple(t2d.shape) != tuple(mask.shape) or t2d.is_floating_point():
        raise CheckpointError(f"t2d must be a bool tensor of shape {tuple(mask.shape)}, "
                              f"got {t2d.dtype} {tuple(t2d.shape)}")
    diff = torch.nonzero((t2d != 0) != mask).flatten()
    if diff.numel():
        first = int(diff[0])
        raise CheckpointError(
            f"t2d is inconsistent with d2t at {diff.numel()} target ids (first: {first}, t2d says "
            f"{bool(t2d[first])}, d2t says {bool(mask[first])}); t2d must be True exactly at the mapped ids")


def _checked_weights(model: EagleNet, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype,
                     device) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` from ``tensors``, shape-checked and cast; nothing else allowed."""
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    unexpected = sorted(n for n in tensors if n not in expected and not n.endswith(_IGNORED_SUFFIXES))
    if unexpected:
        raise CheckpointError(f"draft checkpoint has unexpected tensors: {', '.join(unexpected[:5])}")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(f"draft checkpoint lacks {len(missing)} tensors: {', '.join(missing[:5])}")
    state = {}
    for name, shape in expected.items():
        got = tensors[name]
        if tuple(got.shape) != shape:
            raise CheckpointError(f"draft tensor {name!r} has shape {tuple(got.shape)}, "
                                  f"the config implies {shape}")
        if not got.is_floating_point():
            raise CheckpointError(f"draft tensor {name!r} has dtype {got.dtype}, expected floating point")
        state[name] = got.to(device=device, dtype=dtype)
    return state


def save_eagle(model_or_state: nn.Module | Mapping[str, torch.Tensor], config_dict: dict,
               out_dir: str | Path, form: str = "safetensors") -> Path:
    """Write ``config.json`` plus the weights under the standard names, as ``form``.

    ``form`` is "safetensors" (model.safetensors) or "bin" (pytorch_model.bin, a plain
    tensor dict loadable with weights_only=True). The target embedding is never written.
    """
    if form not in ("safetensors", "bin"):
        raise ValueError(f"form must be 'safetensors' or 'bin', got {form!r}")
    state = model_or_state.state_dict() if isinstance(model_or_state, nn.Module) else model_or_state
    state = {name: t.detach().to("cpu").clone().contiguous() for name, t in state.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config_dict, indent=2))
    if form == "safetensors":
        save_file(state, str(out / SINGLE_FILE), metadata={"format": "pt"})
    else:
        torch.save(state, out / BIN_FILE)
    return out
