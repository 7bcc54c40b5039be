"""Prompts the target writes itself (the Magpie recipe): chat-like training data in the
target's own distribution, with no prompt set needed.

The chat template is rendered up to where a user message begins and the target samples
from there until it closes the turn; what it wrote is a user prompt::

    <|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n  ->  "How do I ...?"<|im_end|>
    '------------- the template's user-turn prefix ----------'   '-- sampled, kept --'

Prompts are appended to a JSONL file in the prompt-file format ({"turns": [...]}) as they
come, so an interrupted run resumes, and the file can be passed to ``train-draft --prompts``.
Only turns the target closed itself are kept (a turn cut by the length limit is dropped),
and exact repeats are dropped. A target that seldom closes a user turn (not a chat model)
stops the run after ``max_attempts`` samples, with a warning, rather than looping forever.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from tqdm import tqdm

from common.errors import InvalidRequestError, UnsupportedModelError
from common.sampling_params import SamplingParams
from verify_service.engine import Engine
from verify_service.sequence import FinishReason
from verify_service.target import Target

log = logging.getLogger(__name__)
_MARK = "\u2063EAGLE3-USER-TURN\u2063"  # placeholder content; never produced by a real prompt


def user_turn_prefix(target: Target) -> list[int]:
    """Token ids of the chat template up to the first character of a user message."""
    if target.tokenizer is None:
        raise UnsupportedModelError("the target has no tokenizer: self-written prompts need one")
    text = target.tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], add_generation_prompt=False)
    cut = text.find(_MARK)
    if cut < 0:
        raise UnsupportedModelError("the chat template does not place the user message verbatim")
    return target.tokenizer.encode(text[:cut])


def generate_self_prompts(engine: Engine, out_path: Path, count: int, max_tokens: int = 128,
                          temperature: float = 1.0, top_p: float = 0.95, batch: int = 256, seed: int = 0,
                          progress: bool = True, deadline: float | None = None,
                          max_attempts: int | None = None) -> list[str]:
    """Sample until ``out_path`` holds ``count`` distinct prompts (or ``deadline`` passes, or
    ``max_attempts`` samples were drawn, default 10 per prompt wanted); returns the prompts in
    the file. Attempt k samples with seed ``seed + k``, and each line records its attempt, so a
    resumed run draws new samples, not the same ones again."""
    if count <= 0:
        raise InvalidRequestError("count", f"must be > 0, got {count}")
    max_attempts = 10 * count if max_attempts is None else max_attempts
    lines = _read(out_path)
    seen = {line["turns"][0] for line in lines}
    attempt = lines[-1]["attempt"] + 1 if lines else 0
    prefix = user_turn_prefix(engine.target)
    bar = tqdm(total=count, initial=min(len(lines), count), desc="self-prompts", disable=not progress)
    with out_path.open("a") as f:
        while len(lines) < count and (deadline is None or time.monotonic() <= deadline):
            if attempt >= max_attempts:
                log.warning("%d samples gave %d of %d prompts: the target seldom closes a user turn",
                            attempt, len(lines), count)
                break
            n = min(batch, 2 * (count - len(lines)) + 8, max_attempts - attempt)  # over-draw: some are dropped
            params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed + attempt + j)
                      for j in range(n)]
            for j, result in enumerate(engine.generate([prefix] * n, params)):
                text = result.text.strip()
                if result.finish_reason != FinishReason.STOP or not text or text in seen or len(lines) >= count:
                    continue
                seen.add(text)
                lines.append({"id": len(lines), "source": "self", "attempt": attempt + j, "turns": [text]})
                f.write(json.dumps(lines[-1]) + "\n")
                bar.update(1)
            attempt += n
            f.flush()
    bar.close()
    return [line["turns"][0] for line in lines]


def _read(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
