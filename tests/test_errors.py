"""Bad input raises a typed error whose message says what is wrong."""

import json

import pytest

from common.errors import (CheckpointError, InvalidRequestError, ModelNotFoundError,
                           UnsupportedModelError)
from common.sampling_params import SamplingParams
from tiny_models import target_for, make_model_dir
from verify_service.config import EngineConfig
from verify_service.engine import Engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model_dir = make_model_dir(tmp_path_factory.mktemp("e") / "m", "llama3")
    return Engine(target_for(model_dir, max_model_len=64))


def test_empty_prompt(engine):
    with pytest.raises(InvalidRequestError, match="prompt: the prompt is empty"):
        engine.add_request([], SamplingParams())


def test_prompt_longer_than_the_context(engine):
    with pytest.raises(InvalidRequestError, match="64 tokens; the context holds 64") as err:
        engine.add_request([5] * 64, SamplingParams())
    assert err.value.field == "prompt"


def test_token_id_out_of_range(engine):
    with pytest.raises(InvalidRequestError, match=r"token id 97 is outside the vocabulary \[0, 97\)"):
        engine.add_request([5, 97], SamplingParams())
    with pytest.raises(InvalidRequestError, match="token id -1"):
        engine.add_request([-1], SamplingParams())


def test_stop_token_id_out_of_range(engine):
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        engine.add_request([5], SamplingParams(stop_token_ids=(1000,)))


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -3}, "max_tokens"),
    ({"top_k": -1}, "top_k"), ({"stop": ("",)}, "stop"), ({"seed": -5}, "seed"),
])
def test_sampling_parameters_out_of_range(kwargs, field):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field and "must" in str(err.value)


def test_max_tokens_is_clipped_to_the_context(engine):
    result = engine.generate([[5] * 60], SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert len(result.token_ids) == 4 and result.finish_reason == "length"


def test_unknown_model_directory(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        target_for(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        target_for(tmp_path / "empty")


def test_truncated_safetensors(tmp_path):
    model_dir = make_model_dir(tmp_path / "m", "llama3")
    f = model_dir / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="corrupted or truncated"):
        target_for(model_dir)


def test_corrupted_safetensors_header(tmp_path):
    model_dir = make_model_dir(tmp_path / "m", "llama3")
    f = model_dir / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:24] = b"\xff" * 16  # inside the JSON header
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted or truncated"):
        target_for(model_dir)


def test_missing_shard_and_wrong_shapes(tmp_path):
    sharded = make_model_dir(tmp_path / "s", "llama3", shards=2)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="missing shards"):
        target_for(sharded)
    wrong = make_model_dir(tmp_path / "w", "llama3")
    raw = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**raw, "intermediate_size": 128}))
    with pytest.raises(CheckpointError, match="has shape"):
        target_for(wrong)


def test_unsupported_architecture_and_rope(tmp_path):
    model_dir = make_model_dir(tmp_path / "m", "llama3")
    raw = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**raw, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        target_for(model_dir)
    (model_dir / "config.json").write_text(json.dumps({**raw, "rope_scaling": {"rope_type": "yarn", "factor": 4}}))
    with pytest.raises(UnsupportedModelError, match="yarn"):
        target_for(model_dir)


def test_bad_engine_config():
    with pytest.raises(InvalidRequestError, match="dtype"):
        EngineConfig("x", dtype="float8")
    with pytest.raises(InvalidRequestError, match="block_size"):
        EngineConfig("x", block_size=0)
