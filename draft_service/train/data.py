"""Self-distillation data: the target answers the training prompts; answers are kept as token ids.

Examples are appended to a JSONL file as they are generated, so an interrupted run resumes
where it stopped. Features and logits are not stored: the trainer recomputes them with the
target engine for every batch (cheap next to generation, and no terabytes of features).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from common.errors import InvalidRequestError, ModelNotFoundError
from common.sampling_params import SamplingParams
from verify_service.generator import Generator


@dataclass(frozen=True, slots=True)
class Example:
    ids: list[int]  # prompt (chat template applied) followed by the target's answer
    answer_start: int  # index of the first answer token


def load_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    """First turns of a JSONL prompt file ({"turns": [...]} per line)."""
    p = Path(path)
    if not p.is_file():
        raise ModelNotFoundError(f"prompt file {str(p)!r} does not exist")
    prompts = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            turns = json.loads(line)["turns"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise InvalidRequestError("prompts", f"{p}:{n} is not a JSON object with a 'turns' list") from None
        if turns and isinstance(turns[0], str) and turns[0].strip():
            prompts.append(turns[0])
    if not prompts:
        raise InvalidRequestError("prompts", f"{p} holds no prompts")
    return prompts[:limit]


def read_examples(path: Path) -> list[Example]:
    if not path.is_file():
        return []
    return [Example(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def generate_examples(gen: Generator, prompts: list[str], out_path: Path, max_new_tokens: int,
                      batch: int = 16, sampled_every: int = 2, seed: int = 0, progress: bool = True) -> list[Example]:
    """Answer every prompt not yet in ``out_path`` (greedy, and sampled at temperature 0.7 for
    every ``sampled_every``-th prompt) and append the examples; returns all of them."""
    done = read_examples(out_path)
    todo = list(enumerate(prompts))[len(done):]
    bar = tqdm(total=len(prompts), initial=len(done), desc="answers", disable=not progress)
    with out_path.open("a") as f:
        for i in range(0, len(todo), batch):
            chunk = todo[i:i + batch]
            ids = [gen.engine.encode(messages=[{"role": "user", "content": q}]) for _, q in chunk]
            params = [SamplingParams(max_tokens=max_new_tokens, temperature=0.7 if k % sampled_every else 0.0,
                                     seed=seed + k) for k, _ in chunk]
            for prompt, result in zip(ids, gen.generate(ids, params)):
                ex = Example(prompt + result.token_ids, len(prompt))
                f.write(json.dumps({"ids": ex.ids, "answer_start": ex.answer_start}) + "\n")
                done.append(ex)
            f.flush()
            bar.update(len(chunk))
    bar.close()
    return done


def iter_batches(examples: list[Example], batch: int, seed: int, start_step: int = 0) -> Iterator[list[Example]]:
    """Endless shuffled batches; deterministic in (seed, step) so a resumed run sees the same order."""
    import random

    step = start_step
    per_epoch = max(1, len(examples) // batch)
    while True:
        epoch, k = divmod(step, per_epoch)
        order = list(range(len(examples)))
        random.Random(seed + epoch).shuffle(order)
        yield [examples[j] for j in order[k * batch:(k + 1) * batch]]
        step += 1
