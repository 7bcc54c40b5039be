"""The target forward against the naive float64 oracle, for each Llama-family variant."""

import json

import pytest
import torch
from safetensors.torch import load_file

from naive_llama import naive_forward
from tiny_models import target_for, make_model_dir, tolerance
from verify_service.model_runner import SeqChunk

VARIANTS = ["llama3", "qwen2", "qwen3", "smollm2"]


def full_logits(target, ids, seq_id=0):
    target.blocks.ensure_capacity(seq_id, len(ids))
    chunk = SeqChunk(ids, 0, target.blocks.block_table(seq_id), logits_rows=tuple(range(len(ids))))
    return target.runner.step([chunk])


@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_matches_naive_reference(tmp_path, variant):
    model_dir = make_model_dir(tmp_path / variant, variant)
    target = target_for(model_dir, capture=(1, 2, 3))
    ids = list(range(3, 60))  # past the llama3 variant's original context (32): all RoPE bands used
    out = full_logits(target, ids)
    ref_logits, ref_caps = naive_forward(json.loads((model_dir / "config.json").read_text()),
                                         load_file(str(model_dir / "model.safetensors")), ids, (1, 2, 3))
    torch.testing.assert_close(out.logits.double().cpu(), ref_logits, **tolerance())
    torch.testing.assert_close(out.captured.double().cpu(), torch.cat(ref_caps, dim=-1), **tolerance())


def test_rope_scaling_changes_the_output(tmp_path):
    """Guards against scaling silently ignored: llama3 scaling must alter long-range logits."""
    plain = target_for(make_model_dir(tmp_path / "a", "llama3", rope_scaling=None))
    scaled = target_for(make_model_dir(tmp_path / "b", "llama3"))
    ids = list(range(3, 60))
    assert not torch.allclose(full_logits(plain, ids).logits, full_logits(scaled, ids).logits, atol=1e-4)


def test_sharded_checkpoint_equals_single_file(tmp_path):
    single = target_for(make_model_dir(tmp_path / "one", "qwen2", seed=3))
    sharded = target_for(make_model_dir(tmp_path / "three", "qwen2", seed=3, shards=3))
    ids = [5, 9, 11, 2, 40]
    torch.testing.assert_close(full_logits(single, ids).logits, full_logits(sharded, ids).logits)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_dtypes_load_and_run(tmp_path, dtype):
    model_dir = make_model_dir(tmp_path / "m", "llama3")
    target = target_for(model_dir, dtype=dtype)
    assert target.model.model.embed_tokens.weight.dtype == getattr(torch, dtype)
    assert target.kv_cache.data.dtype == getattr(torch, dtype)
    ref = full_logits(target_for(model_dir, dtype="float32"), [4, 8, 15, 16, 23, 42]).logits
    low = full_logits(target, [4, 8, 15, 16, 23, 42]).logits
    assert low.dtype == getattr(torch, dtype)  # the model's dtype: consumers upcast what they sample from
    torch.testing.assert_close(low.float().cpu(), ref.cpu(), **tolerance(dtype))


def test_default_capture_layers_are_2_half_and_l_minus_3():
    from common.config import ModelConfig
    from tiny_models import tiny_config
    cfg = ModelConfig.from_hf(tiny_config("llama3", num_hidden_layers=32))
    assert cfg.default_capture_layers() == (2, 16, 29)
