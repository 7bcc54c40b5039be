"""A tiny random target that speaks through SmolLM2's tokenizer and chat template, plus a
prompt file: what the training tools need, at a size the CPU trains in seconds."""

import json
import shutil
from pathlib import Path

from tiny_models import make_model_dir

QUESTIONS = ["What is 2+2?", "Name a colour.", "Say hello.", "Count to five.", "What is the sky?",
             "Name a fruit.", "Write a word.", "What day is it?", "Spell cat.", "Name an animal.",
             "Give a number.", "Say goodbye."]


def tiny_chat_target(root: Path) -> tuple[Path, Path]:
    """(model directory, prompt file) under ``root``."""
    from hub.default_model import ensure_default_model
    smol = ensure_default_model(progress=False)
    model = make_model_dir(root / "target", "smollm2", seed=3, std=0.8, vocab_size=49152, eos_token_id=2,
                           max_position_embeddings=512)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol / f, model / f)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "turns": [q]}) + "\n" for i, q in enumerate(QUESTIONS)))
    return model, prompts
