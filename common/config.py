"""Target model configuration, read from a Hugging Face ``config.json``.

One frozen dataclass covers the Llama family the runtime serves:

| variant  | what differs                                   | config field            |
|----------|------------------------------------------------|-------------------------|
| Llama 3  | RoPE frequencies rescaled (``rope_type=llama3``)| ``rope_scaling``        |
| Qwen2/2.5| bias on q/k/v projections                      | ``attention_bias``      |
| Qwen3    | RMSNorm on q and k per head, before RoPE       | ``qk_norm``             |
| SmolLM2  | lm_head shares the embedding matrix            | ``tie_word_embeddings`` |
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import ModelNotFoundError, UnsupportedModelError

# Architectures the decoder implements, and the variant flags each implies.
_ARCHITECTURES = {
    "LlamaForCausalLM": {"attention_bias": False, "qk_norm": False},
    "MistralForCausalLM": {"attention_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"attention_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"attention_bias": False, "qk_norm": True},
}
_ROPE_TYPES = ("default", "linear", "llama3")


def check_attention_geometry(cfg, positive: tuple[str, ...], error: type[Exception], what: str) -> None:
    """Raise ``error`` unless the ``positive`` fields are > 0, query heads group evenly over KV
    heads, and head_dim is even (RoPE rotates pairs). Shared by the target's and the draft's configs."""
    for name in positive:
        if getattr(cfg, name) <= 0:
            raise error(f"{what} {name} must be > 0, got {getattr(cfg, name)}")
    if cfg.num_heads % cfg.num_kv_heads:
        raise error(f"{what} num_attention_heads ({cfg.num_heads}) must be a multiple of "
                    f"num_key_value_heads ({cfg.num_kv_heads})")
    if cfg.head_dim % 2:
        raise error(f"{what} head_dim must be even for RoPE, got {cfg.head_dim}")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency rescaling; ``rope_type`` is one of ``default``, ``linear``, ``llama3``."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in _ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_scaling type {self.rope_type!r} is not supported (supported: {', '.join(_ROPE_TYPES)})")
        if self.factor <= 0:
            raise UnsupportedModelError(f"rope_scaling factor must be > 0, got {self.factor}")

    @classmethod
    def from_hf(cls, raw: dict | None) -> "RopeScaling":
        if not raw:
            return cls()
        kind = raw.get("rope_type", raw.get("type", "default"))
        known = {k: raw[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                      "original_max_position_embeddings") if k in raw}
        return cls(rope_type=kind, **known)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Geometry and numerics of a Llama-family decoder. Validated on construction."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self):
        check_attention_geometry(self, ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                                        "num_kv_heads", "head_dim", "max_position_embeddings"),
                                 UnsupportedModelError, "config")
        bad = [t for t in self.eos_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise UnsupportedModelError(f"eos_token_id {bad} outside the vocabulary of {self.vocab_size}")

    def default_capture_layers(self) -> tuple[int, int, int]:
        """Layers whose *input* hidden states EAGLE-3 drafts consume: 2, L//2, L-3."""
        n = self.num_layers
        return (min(2, n - 1), n // 2, max(n - 3, 0))

    @classmethod
    def from_hf(cls, raw: dict) -> "ModelConfig":
        arch = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in _ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {arch!r} is not supported (supported: {', '.join(_ARCHITECTURES)})")
        flags = dict(_ARCHITECTURES[arch])
        flags["attention_bias"] = bool(raw.get("attention_bias", flags["attention_bias"]))
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            return cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.get("rope_theta", 10000.0)),
                rope_scaling=RopeScaling.from_hf(raw.get("rope_scaling")),
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                eos_token_ids=eos_ids,
                bos_token_id=raw.get("bos_token_id"),
                **flags,
            )
        except KeyError as exc:
            raise UnsupportedModelError(f"config.json lacks required field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise UnsupportedModelError(f"config.json has a malformed field: {exc}") from None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        return cls.from_hf(read_config_json(model_dir, "model", UnsupportedModelError))


def read_config_json(directory: str | Path, what: str, invalid: type[Exception]) -> dict:
    """``directory/config.json`` as a dict; ModelNotFoundError if absent, ``invalid`` if not JSON."""
    path = Path(directory)
    if not path.is_dir():
        raise ModelNotFoundError(f"{what} directory {str(path)!r} does not exist")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelNotFoundError(f"{what} directory {str(path)!r} has no config.json")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise invalid(f"{config_file} is not valid JSON: {exc}") from None
