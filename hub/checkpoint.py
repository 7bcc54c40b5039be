"""Reading Hugging Face safetensors checkpoints (single file or sharded with an index).

Every failure to read becomes a typed error naming the file: a missing directory or
file is ModelNotFoundError; an unreadable header, truncation or bad index is CheckpointError.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open

from common.errors import CheckpointError, ModelNotFoundError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a model directory, in index order for sharded checkpoints."""
    root = Path(model_dir)
    if not root.is_dir():
        raise ModelNotFoundError(f"model directory {str(root)!r} does not exist")
    if (root / INDEX_FILE).is_file():
        return _shards_from_index(root)
    if (root / SINGLE_FILE).is_file():
        return [root / SINGLE_FILE]
    raise ModelNotFoundError(f"{str(root)!r} holds neither {SINGLE_FILE} nor {INDEX_FILE}")


def _shards_from_index(root: Path) -> list[Path]:
    try:
        weight_map = json.loads((root / INDEX_FILE).read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{root / INDEX_FILE} is malformed: {exc!r}") from None
    shards = list(dict.fromkeys(weight_map.values()))
    missing = [s for s in shards if not (root / s).is_file()]
    if missing:
        raise ModelNotFoundError(f"{INDEX_FILE} in {str(root)!r} names missing shards: {missing}")
    return [root / s for s in shards]


def iter_tensors(model_dir: str | Path, device: str | torch.device = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the checkpoint, one at a time, on ``device``."""
    for path in checkpoint_files(model_dir):
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except SafetensorError as exc:
            raise CheckpointError(f"{path} is corrupted or truncated: {exc}") from None
        except OSError as exc:
            raise CheckpointError(f"{path} cannot be read: {exc}") from None
