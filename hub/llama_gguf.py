"""Conversion of a llama-architecture GGUF into a Hugging Face checkpoint directory.

Writes config.json (LlamaForCausalLM), model.safetensors (float32, HF tensor names),
tokenizer.json (byte-level BPE for the ``tokenizers`` library) and tokenizer_config.json.
Tensors are dequantized and streamed to disk one at a time, so peak memory is about one
float32 tensor (the 113 MB embedding for SmolLM2-135M) plus its quantized source.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm import tqdm

from common.errors import ConversionError
from hub.gguf import GGUFReader

TOKEN_TYPE_CONTROL = 3  # llama.cpp's token type of special tokens such as <|im_end|>

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
                "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


@dataclass(frozen=True)
class TensorPlan:
    """One output tensor: where it comes from and whether its rows need un-permuting."""

    hf_name: str
    gguf_name: str
    shape: tuple[int, ...]
    rope_heads: int | None  # heads to un-permute by (Q and K only)


def convert_llama_gguf(reader: GGUFReader, out_dir: Path, expected: dict[str, Any] | None = None,
                       progress: bool = True) -> int:
    """Write the HF checkpoint files into ``out_dir``; return the number of tensors written.

    ``expected`` holds config values the GGUF must match (ConversionError otherwise).
    Everything is validated before the large tensor file is written.
    """
    config = build_config(reader)
    if expected is not None:
        check_config(config, expected, reader.path)
    plan = tensor_plan(reader, config)
    tokenizer = build_tokenizer(reader.metadata)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(reader.metadata))
    tokenizer.save(str(out_dir / "tokenizer.json"))
    write_safetensors(out_dir / "model.safetensors", reader, plan, progress)
    return len(plan)


def _f32(x: float) -> float:
    # GGUF stores these as float32; print the shortest float32 decimal so 1e-5 stays 1e-05.
    return float(str(np.float32(x)))


def build_config(reader: GGUFReader) -> dict[str, Any]:
    """HF LlamaForCausalLM config.json values read from the GGUF's llama.* metadata."""
    meta = reader.metadata
    if meta.get("general.architecture") != "llama":
        raise ConversionError(f"{reader.path}: architecture {meta.get('general.architecture')!r}, "
                              f"expected 'llama'")

    def key(name: str) -> Any:
        if f"llama.{name}" not in meta:
            raise ConversionError(f"{reader.path}: metadata key llama.{name} is missing")
        return meta[f"llama.{name}"]

    hidden, heads = key("embedding_length"), key("attention.head_count")
    head_dim = hidden // heads
    if meta.get("llama.rope.dimension_count", head_dim) != head_dim:
        raise ConversionError(f"{reader.path}: partial RoPE (llama.rope.dimension_count) "
                              f"is not supported")
    if any(k.startswith("llama.rope.scaling") for k in meta):
        raise ConversionError(f"{reader.path}: RoPE scaling is not supported")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"), "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv"), "head_dim": head_dim,
        "vocab_size": meta.get("llama.vocab_size", len(meta.get("tokenizer.ggml.tokens", []))),
        "rope_theta": _f32(key("rope.freq_base")),
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": key("context_length"),
        "tie_word_embeddings": "output.weight" not in reader.tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
        "rope_scaling": None,
        "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
    }


def check_config(config: dict[str, Any], expected: dict[str, Any], source: Path) -> None:
    diffs = [f"{k}: GGUF has {config.get(k)!r}, expected {v!r}"
             for k, v in expected.items() if config.get(k) != v]
    if diffs:
        raise ConversionError(f"{source} is not the expected model:\n  " + "\n  ".join(diffs))


def hf_tensor_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if m and m[2] in _LAYER_NAMES:
        return f"model.layers.{m[1]}.{_LAYER_NAMES[m[2]]}.weight"
    m = re.fullmatch(r"(\w+)\.weight", gguf_name)
    if m and m[1] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m[1]]}.weight"
    raise ConversionError(f"GGUF tensor {gguf_name!r} has no Llama counterpart")


def expected_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of the config with its (out_features, in_features) shape."""
    d, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, d)
    layer = {"self_attn.q_proj": (q, d), "self_attn.k_proj": (kv, d), "self_attn.v_proj": (kv, d),
             "self_attn.o_proj": (d, q), "mlp.gate_proj": (inter, d), "mlp.up_proj": (inter, d),
             "mlp.down_proj": (d, inter), "input_layernorm": (d,), "post_attention_layernorm": (d,)}
    for i in range(cfg["num_hidden_layers"]):
        shapes.update({f"model.layers.{i}.{k}.weight": s for k, s in layer.items()})
    return shapes


def tensor_plan(reader: GGUFReader, cfg: dict[str, Any]) -> list[TensorPlan]:
    """Map every GGUF tensor to its HF name; the names and shapes must match the config."""
    by_hf = {hf_tensor_name(name): info for name, info in reader.tensors.items()}
    want = expected_shapes(cfg)
    missing, extra = sorted(set(want) - set(by_hf)), sorted(set(by_hf) - set(want))
    wrong = [f"{k}: {by_hf[k].shape} != {want[k]}" for k in want if k in by_hf
             and by_hf[k].shape != want[k]]
    if missing or extra or wrong:
        raise ConversionError(f"{reader.path}: tensors do not match the config: missing "
                              f"{missing[:5]}, unexpected {extra[:5]}, wrong shape {wrong[:5]}")
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    return [TensorPlan(hf, info.name, info.shape, heads.get(hf.split(".")[-2]))
            for hf, info in by_hf.items()]


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo the Q/K row permutation of llama.cpp's convert_hf_to_gguf.py ``permute``.

    HF's rotate-half RoPE rotates row j of each head with row j + head_dim/2; llama.cpp's
    kernels rotate adjacent rows (2j, 2j+1), so its converter interleaves the two halves:
    GGUF row 2j + h = HF row h * head_dim/2 + j. This puts the rows back.
    """
    half = w.shape[0] // n_head // 2
    per_head = w.reshape(n_head, half, 2, *w.shape[1:])           # (nh, hd/2, 2, in)
    return per_head.swapaxes(1, 2).reshape(w.shape)               # (nh, 2, hd/2, in) -> rows


def write_safetensors(path: Path, reader: GGUFReader, plan: list[TensorPlan],
                      progress: bool = True) -> None:
    """Stream float32 tensors into a safetensors file, dequantizing one at a time.

    File layout: header length u64 | JSON header (space padded to 8 bytes) | raw data,
    each tensor at its [begin, end) data_offsets, in plan order.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in plan:
        n_bytes = 4 * int(np.prod(t.shape, dtype=np.int64))
        header[t.hf_name] = {"dtype": "F32", "shape": list(t.shape),
                             "data_offsets": [offset, offset + n_bytes]}
        offset += n_bytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for t in tqdm(plan, desc="converting", unit="tensor", disable=not progress):
            w = reader.dequantize(t.gguf_name)
            if t.rope_heads:
                w = unpermute_rope_rows(w, t.rope_heads)
            f.write(np.ascontiguousarray(w, dtype="<f4").data)


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """Byte-level BPE equivalent to llama.cpp's ``gpt2`` model with the ``smollm`` pre-tokenizer."""
    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    if model != "gpt2" or pre != "smollm":
        raise ConversionError(f"tokenizer {model!r}/{pre!r} is not supported (need gpt2/smollm)")
    tokens: list[str] = _require(meta, "tokenizer.ggml.tokens")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in _require(meta, "tokenizer.ggml.merges")]
    if len(vocab) != len(tokens) or any(len(m) != 2 for m in merges):
        raise ConversionError("tokenizer vocabulary has duplicate tokens or malformed merges")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    # llama.cpp's smollm regexes: every digit on its own, then the GPT-2 split.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    types = _require(meta, "tokenizer.ggml.token_type")
    control = [tokens[i] for i, t in enumerate(types) if t == TOKEN_TYPE_CONTROL]
    # Registered as special added tokens so text like "<|im_end|>" is never split.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    moved = [t for t in control if tok.token_to_id(t) != vocab[t]]
    if moved:
        raise ConversionError(f"special tokens changed ids when registered: {moved[:5]}")
    return tok


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    tokens = _require(meta, "tokenizer.ggml.tokens")
    return {"chat_template": _require(meta, "tokenizer.chat_template"),
            "bos_token": tokens[_require(meta, "tokenizer.ggml.bos_token_id")],
            "eos_token": tokens[_require(meta, "tokenizer.ggml.eos_token_id")],
            "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False))}


def _require(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise ConversionError(f"GGUF metadata key {key} is missing")
    return meta[key]


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
