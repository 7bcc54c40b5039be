"""One-process composition: the target engine with (optionally) the EAGLE-3 drafter beside it."""

from __future__ import annotations

from common.spec_config import SpecConfig
from verify_service.config import EngineConfig
from verify_service.engine import TargetEngine
from verify_service.generator import Generator


def build_generator(cfg: EngineConfig, spec: SpecConfig | None = None) -> Generator:
    """Load the target (and the draft head when ``spec`` is given) and wire them together.

    The draft is checked against the target (vocabulary, hidden size, captured layers)
    before anything runs; a mismatch raises CheckpointError instead of decoding badly.
    """
    engine = TargetEngine.from_config(cfg)
    if spec is None:
        return Generator(engine)
    from draft_service.drafter import EagleDrafter  # the draft side's code, only when asked for

    drafter = EagleDrafter.from_checkpoint(spec, engine.model_config, engine.model.model.embed_tokens.weight,
                                           cfg.max_num_seqs, engine.max_model_len)
    return Generator(engine, drafter, spec)
