"""Prompts the target writes itself (Magpie): the user-turn prefix, what is kept, resuming."""

import json
from dataclasses import dataclass

import pytest

from common.errors import InvalidRequestError
from tools.train.data import load_prompts
from tools.train.self_prompts import generate_self_prompts, user_turn_prefix
from tiny_chat import tiny_chat_target
from tiny_models import target_for
from verify_service.sequence import FinishReason

SMOL_PREFIX = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
               "<|im_start|>user\n")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    model, _ = tiny_chat_target(tmp_path_factory.mktemp("sp"))
    return target_for(model, dtype="float32", device="cpu")


def test_user_turn_prefix_is_the_template_up_to_the_user_message(target):
    prefix = user_turn_prefix(target)
    assert target.tokenizer.decode(prefix, skip_special_tokens=False) == SMOL_PREFIX
    chat = target.encode(messages=[{"role": "user", "content": "Name a fruit."}])
    assert chat[:len(prefix)] == prefix  # what an answered prompt starts with


@dataclass
class Result:
    text: str
    finish_reason: FinishReason


class ScriptedEngine:
    """Answers attempt k (its sampling seed) from a script; records what it was asked."""

    def __init__(self, target, script):
        self.target, self.script, self.seeds = target, script, []

    def generate(self, prompts, params):
        assert all(p == prompts[0] for p in prompts)
        self.seeds += [p.seed for p in params]
        return [Result(*self.script(p.seed)) for p in params]


def script(seed):
    if seed % 5 == 1:
        return f"cut {seed}", FinishReason.LENGTH  # the turn never closed: dropped
    if seed % 5 == 2:
        return "  ", FinishReason.STOP  # empty: dropped
    if seed % 5 == 3:
        return "A repeated question?", FinishReason.STOP  # kept once
    return f" Question {seed}? ", FinishReason.STOP


def test_kept_prompts_closed_distinct_non_empty_and_resumable(target, tmp_path):
    out = tmp_path / "self.jsonl"
    engine = ScriptedEngine(target, script)
    got = generate_self_prompts(engine, out, count=4, batch=3, seed=100, progress=False)
    assert got == ["Question 100?", "A repeated question?", "Question 104?", "Question 105?"]
    assert engine.seeds == list(range(100, 106))  # batches of 3 until 4 were kept
    assert load_prompts(out) == got  # a prompt file train-draft reads
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["attempt"] for line in lines] == [0, 3, 4, 5]
    more = ScriptedEngine(target, script)
    assert generate_self_prompts(more, out, count=6, batch=3, seed=100, progress=False)[4:] ==\
        ["Question 109?", "Question 110?"]
    assert more.seeds[0] == 106  # resumed after the last kept attempt: no sample repeats a kept one


def test_a_target_that_never_closes_a_turn_stops(target, tmp_path, caplog):
    engine = ScriptedEngine(target, lambda seed: ("endless", FinishReason.LENGTH))
    assert generate_self_prompts(engine, tmp_path / "s.jsonl", count=2, batch=8, progress=False) == []
    assert len(engine.seeds) == 20 and "seldom closes a user turn" in caplog.text
    with pytest.raises(InvalidRequestError, match="count"):
        generate_self_prompts(engine, tmp_path / "s.jsonl", count=0, progress=False)


@pytest.mark.slow
def test_smollm2_writes_chat_prompts(tmp_path):
    from hub.default_model import ensure_default_model
    from verify_service.engine import Engine

    smol = target_for(ensure_default_model(progress=False), dtype="float32", device="cpu", kv_cache_gib=0.1,
                      max_model_len=256)
    got = generate_self_prompts(Engine(smol), tmp_path / "p.jsonl", count=3, max_tokens=64, batch=4,
                                progress=False)
    assert len(got) == 3 and len(set(got)) == 3
    assert all(len(q.split()) >= 3 and "<|im" not in q for q in got), got
