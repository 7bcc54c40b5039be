"""EAGLE-3 draft head configuration, read from the draft's ``config.json``.

The file is a ``LlamaForCausalLM``-style config with ``num_hidden_layers: 1`` plus the
EAGLE-3 fields::

    hidden_size          H   draft width (== target width: tokens use the TARGET's embedding)
    target_hidden_size   Ht  width of each captured target feature (fc reads 3 * Ht)
    vocab_size               the TARGET's vocabulary (d2t maps into it)
    draft_vocab_size         rows of the draft lm_head (a subset of the target vocabulary)
    eagle_config.eagle_aux_hidden_state_layer_ids   target layers whose inputs are captured

``max_position_embeddings`` is deliberately not read: drafts ship 2048 there, and sizing
RoPE from it breaks longer prompts. The runtime sizes RoPE from its own context length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from common.config import ModelConfig, RopeScaling, check_attention_geometry, read_config_json
from common.errors import CheckpointError, UnsupportedModelError


@dataclass(frozen=True, slots=True)
class DraftConfig:
    """Geometry and numerics of an EAGLE-3 draft head. Validated on construction."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    aux_layer_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        check_attention_geometry(self, ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                                        "vocab_size", "draft_vocab_size", "target_hidden_size"),
                                 CheckpointError, "draft config")

    @classmethod
    def from_hf(cls, raw: dict) -> "DraftConfig":
        layers = raw.get("num_hidden_layers", 1)
        if layers != 1:
            raise UnsupportedModelError(f"EAGLE-3 drafts have one layer, config says num_hidden_layers={layers}")
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            vocab = int(raw["vocab_size"])
            aux = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            return cls(
                hidden_size=hidden,
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                intermediate_size=int(raw["intermediate_size"]),
                vocab_size=vocab,
                draft_vocab_size=int(raw.get("draft_vocab_size") or vocab),
                target_hidden_size=int(raw.get("target_hidden_size") or hidden),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.get("rope_theta") or 10000.0),
                rope_scaling=RopeScaling.from_hf(raw.get("rope_scaling")),
                aux_layer_ids=None if aux is None else tuple(int(i) for i in aux),
            )
        except KeyError as exc:
            raise CheckpointError(f"draft config.json lacks required field {exc.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"draft config.json has a malformed field: {exc}") from None

    @classmethod
    def from_dir(cls, draft_dir: str | Path) -> "DraftConfig":
        return cls.from_hf(read_config_json(draft_dir, "draft", CheckpointError))

    def check_compatible(self, target: ModelConfig) -> None:
        """Raise CheckpointError unless this draft can run on top of ``target``."""
        problems = []
        if self.vocab_size != target.vocab_size:
            problems.append(f"draft vocab_size {self.vocab_size} != target vocab_size {target.vocab_size}")
        if self.target_hidden_size != target.hidden_size:
            problems.append(f"draft target_hidden_size {self.target_hidden_size} != "
                            f"target hidden_size {target.hidden_size}")
        if self.hidden_size != target.hidden_size:
            problems.append(f"draft hidden_size {self.hidden_size} != target hidden_size {target.hidden_size} "
                            "(the draft embeds tokens with the target's embedding table)")
        bad = [i for i in self.aux_layer_ids or () if not 0 <= i < target.num_layers]
        if bad:
            problems.append(f"eagle_aux_hidden_state_layer_ids {bad} outside [0, {target.num_layers})")
        if self.draft_vocab_size > self.vocab_size:
            problems.append(f"draft_vocab_size {self.draft_vocab_size} > vocab_size {self.vocab_size}")
        if problems:
            raise CheckpointError("draft checkpoint does not fit the target model: " + "; ".join(problems))

    def capture_layers(self, target: ModelConfig) -> tuple[int, ...]:
        """Target layers whose input hidden states feed ``fc``, in the order fc expects them."""
        return self.aux_layer_ids if self.aux_layer_ids is not None else target.default_capture_layers()
