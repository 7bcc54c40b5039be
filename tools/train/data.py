"""Self-distillation data: the target answers the training prompts; answers are kept as token ids.

Examples are appended to a JSONL file as they are generated, so an interrupted run resumes
where it stopped. Features and logits are not stored: the trainer recomputes them with the
target engine for every batch (cheap next to generation, and no terabytes of features).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from common.errors import InvalidRequestError, ModelNotFoundError
from common.sampling_params import SamplingParams
from verify_service.engine import Engine


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
    """Every line of an examples file, skipped prompts (empty ``ids``) included."""
    if not path.is_file():
        return []
    return [Example(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def generate_examples(engine: Engine, prompts: list[str], out_path: Path, max_new_tokens: int,
                      batch: int = 64, sampled_every: int = 2, seed: int = 0, progress: bool = True,
                      max_prompt_tokens: int = 1024, deadline: float | None = None) -> list[Example]:
    """Answer the prompts not yet in ``out_path`` (greedy, and sampled at temperature 0.7 for
    every ``sampled_every``-th prompt), appending one line per prompt; returns every line.

    A prompt longer than ``max_prompt_tokens`` is recorded as skipped (empty ids), so line n
    always belongs to prompt n. Stops between batches once ``deadline`` (time.monotonic())
    passes; the caller sees fewer lines than prompts and runs again to continue.
    """
    done = read_examples(out_path)
    todo = list(enumerate(prompts))[len(done):]
    bar = tqdm(total=len(prompts), initial=len(done), desc="answers", disable=not progress)
    with out_path.open("a") as f:
        for i in range(0, len(todo), batch):
            if deadline is not None and time.monotonic() > deadline:
                break
            chunk = todo[i:i + batch]
            encoded = [engine.target.encode(messages=[{"role": "user", "content": q}]) for _, q in chunk]
            keep = [j for j, ids in enumerate(encoded) if len(ids) <= max_prompt_tokens]
            params = [SamplingParams(max_tokens=max_new_tokens, temperature=0.7 if chunk[j][0] % sampled_every else 0.0,
                                     seed=seed + chunk[j][0]) for j in keep]
            results = dict(zip(keep, engine.generate([encoded[j] for j in keep], params))) if keep else {}
            for j, ids in enumerate(encoded):
                ex = Example(ids + results[j].token_ids, len(ids)) if j in results else Example([], 0)
                f.write(json.dumps({"ids": ex.ids, "answer_start": ex.answer_start}) + "\n")
                done.append(ex)
            f.flush()
            bar.update(len(chunk))
    bar.close()
    return done


def iter_batches(examples: list[Example], batch: int, seed: int, start_step: int = 0,
                 bucket_batches: int = 32) -> Iterator[list[Example]]:
    """Endless shuffled batches of similar lengths; deterministic in (seed, step) so a resumed
    run sees the same order.

    Each epoch shuffles the examples, sorts every window of ``bucket_batches`` batches by
    length, cuts the windows into batches and shuffles the batches. A batch is padded to its
    longest sequence, so mixing lengths would spend about half of the unrolled draft's
    [B, T, T] attention and [B, T, V] logits on padding (chat prompts run from 30 to 500+
    tokens); ``bucket_batches=1`` turns the sorting off.
    """
    import random

    step = start_step
    per_epoch = max(1, len(examples) // batch)
    shuffled_epoch, batches = None, []
    while True:
        epoch, k = divmod(step, per_epoch)
        if epoch != shuffled_epoch:  # once per epoch: shuffling 50k ids costs ~20 ms of host time
            rng = random.Random(seed + epoch)
            order = list(range(len(examples)))
            rng.shuffle(order)
            order = order[:per_epoch * batch] if len(order) >= batch else order
            window = batch * max(1, bucket_batches)
            for w in range(0, len(order), window):
                order[w:w + window] = sorted(order[w:w + window], key=lambda j: len(examples[j].ids))
            batches = [order[b * batch:(b + 1) * batch] for b in range(per_epoch)]
            rng.shuffle(batches)
            shuffled_epoch = epoch
        yield [examples[j] for j in batches[k]]
        step += 1
