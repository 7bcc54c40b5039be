"""The embedded default model end to end: tokenizer, chat template, generation, CLI."""

import pytest

from hub.default_model import ensure_default_model
from common.errors import InvalidRequestError
from common.sampling_params import SamplingParams
from hub.tokenizer import Tokenizer
from tiny_models import TEST_DEVICE, TEST_DTYPE
from cli.main import main
from verify_service.config import EngineConfig
from verify_service.target import Target
from verify_service.engine import Engine

pytestmark = pytest.mark.slow
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def model_dir():
    return ensure_default_model(progress=False)


@pytest.fixture(scope="module")
def target(model_dir):
    cfg = EngineConfig(str(model_dir), device=TEST_DEVICE, dtype=TEST_DTYPE, max_model_len=2048,
                       max_num_seqs=8, kv_cache_gib=0.5)
    return Target.from_config(cfg)


def test_chat_template_renders_the_documented_format(model_dir):
    tok = Tokenizer(model_dir)
    text = tok.apply_chat_template(FRANCE)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    custom = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, *FRANCE])
    assert custom.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    with pytest.raises(InvalidRequestError, match="unknown role 'robot'"):
        tok.apply_chat_template([{"role": "robot", "content": "hi"}])


def test_tokenizer_round_trip_and_special_tokens(model_dir):
    tok = Tokenizer(model_dir)
    for text in ["Hello, world!", "x = 12345 ** 2", "naïve café — 世界 🙂", "  two\n\tlines"]:
        assert tok.decode(tok.encode(text)) == text
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2  # no BOS prepended; specials are single tokens
    assert tok.vocab_size == 49152


def test_greedy_answer_names_paris(target):
    ids = target.encode(messages=FRANCE)
    result = Engine(target).generate([ids], SamplingParams(max_tokens=32))[0]
    assert "Paris" in result.text
    assert result.finish_reason == "stop" and result.token_ids[-1] == 2  # ends at <|im_end|>


def test_streamed_text_equals_the_decoded_tokens(target):
    ids = target.encode(messages=[{"role": "user", "content": "Write a haiku about the sea, with an emoji."}])
    events = list(Engine(target).stream(ids, SamplingParams(max_tokens=40, temperature=0.8, seed=3)))
    tokens = [t for e in events for t in e.token_ids]
    assert "".join(e.text for e in events) == target.tokenizer.decode(tokens)


def test_stop_string_truncates_text_and_finishes(target):
    ids = target.encode(messages=FRANCE)
    result = Engine(target).generate([ids], SamplingParams(max_tokens=32, stop=("Paris",)))[0]
    assert result.finish_reason == "stop" and "Paris" not in result.text
    assert result.text.endswith("is ")  # "The capital of France is " then the stop string


def test_cli_streams_the_answer(capsys):
    assert main(["generate", "--device", TEST_DEVICE, "--dtype", TEST_DTYPE, "--max-tokens", "32",
                 "What is the capital of France?"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_cli_reports_bad_input_as_an_error(capsys):
    assert main(["generate", "--temperature", "-1", "hi"]) == 2
    assert "temperature: must be finite and >= 0" in capsys.readouterr().err
