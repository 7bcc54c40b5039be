"""The EAGLE-3 draft head against a naive float64 oracle, and its checkpoint validation."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.config import ModelConfig
from common.errors import CheckpointError, ModelNotFoundError
from runtime.kv_cache import PagedKVCache
from runtime.step_layout import SeqChunk, layout_step
from draft_service.eagle_config import DraftConfig
from draft_service.eagle_loader import load_eagle
from kernels import select_kernels
from naive_llama import _inv_freq
from tiny_eagle import chosen_target_ids, make_eagle_dir
from tiny_models import TEST_DEVICE, TEST_DTYPE, make_model_dir, tiny_config, tolerance

F64 = torch.float64
TARGET_RAW = tiny_config("llama3")  # H = Ht = 64, 4 heads, 2 KV heads, vocab 97, 4 layers
TARGET = ModelConfig.from_hf(TARGET_RAW)
DRAFT_VOCAB = 32
BLOCK = 4
T = 40
DTYPE = getattr(torch, TEST_DTYPE)


# ----------------------------------------------------------------------------- oracle

def _rms(x, w, eps):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def naive_draft(raw, w, embed, ids, hidden):
    """EAGLE-3 draft step over one sequence at positions 0..T-1, dense causal attention, float64.

    Returns (out [T, H] before the final norm, logits [T, draft_vocab]).
    """
    w = {k: v.to(F64) for k, v in w.items() if v.is_floating_point()}
    H, nh = raw["hidden_size"], raw["num_attention_heads"]
    nkv, hd = raw.get("num_key_value_heads", nh), raw.get("head_dim") or H // nh
    eps, n = raw["rms_norm_eps"], len(ids)
    h = hidden.to(F64)
    if h.shape[-1] != H:
        h = h @ w["fc.weight"].T
    p = "midlayer."
    x = torch.cat((_rms(embed.to(F64)[torch.as_tensor(ids)], w[p + "input_layernorm.weight"], eps),
                   _rms(h, w[p + "hidden_norm.weight"], eps)), dim=-1)
    q = (x @ w[p + "self_attn.q_proj.weight"].T).view(n, nh, hd)
    k = (x @ w[p + "self_attn.k_proj.weight"].T).view(n, nkv, hd)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, nkv, hd)
    freqs = torch.outer(torch.arange(n, dtype=F64), _inv_freq(raw, hd))
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    heads = []
    for i in range(nh):
        j = i // (nh // nkv)  # GQA
        qi, kj = q[:, i] * cos + _rotate_half(q[:, i]) * sin, k[:, j] * cos + _rotate_half(k[:, j]) * sin
        scores = (qi @ kj.T / math.sqrt(hd)).masked_fill(~causal, float("-inf"))
        heads.append(torch.softmax(scores, -1) @ v[:, j])
    h = h + torch.cat(heads, -1) @ w[p + "self_attn.o_proj.weight"].T
    y = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
    mlp = (torch.nn.functional.silu(y @ w[p + "mlp.gate_proj.weight"].T) * (y @ w[p + "mlp.up_proj.weight"].T))
    out = h + mlp @ w[p + "mlp.down_proj.weight"].T
    return out, _rms(out, w["norm.weight"], eps) @ w["lm_head.weight"].T


# ----------------------------------------------------------------------------- helpers

@pytest.fixture(scope="module")
def embedding(tmp_path_factory):
    target_dir = make_model_dir(tmp_path_factory.mktemp("target"), "llama3")
    return load_file(str(target_dir / "model.safetensors"))["model.embed_tokens.weight"]


def load(draft_dir, embedding, max_positions=64):
    return load_eagle(draft_dir, TARGET, embedding.to(TEST_DEVICE, DTYPE), DTYPE, TEST_DEVICE, max_positions)


def new_cache(model):
    c = model.config
    return PagedKVCache(1, 32, BLOCK, c.num_kv_heads, c.head_dim, DTYPE, TEST_DEVICE)


def step(model, cache, ids, hidden, kv_start=0, table=(9, 3, 0, 7, 12, 5, 1, 20, 11, 2)):
    """Run the draft over ``ids`` with KV at indices kv_start.. of a scrambled block table."""
    kernels = select_kernels(TEST_DEVICE)
    lay = layout_step([SeqChunk(ids, kv_start, list(table))], BLOCK, torch.device(TEST_DEVICE), kernels)
    with torch.inference_mode():
        return model(lay.input_ids, hidden.to(TEST_DEVICE, DTYPE), lay.meta, cache, kernels)


def inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TARGET.vocab_size, (T,), generator=gen).tolist()
    return ids, torch.randn(T, 3 * TARGET.hidden_size, generator=gen)


def reference(draft_dir, embedding, ids, hidden):
    raw = json.loads((draft_dir / "config.json").read_text())
    return naive_draft(raw, load_file(str(draft_dir / "model.safetensors")), embedding, ids, hidden)


def assert_matches(model, out, ref_out, ref_logits):
    torch.testing.assert_close(out.double().cpu(), ref_out, **tolerance())
    torch.testing.assert_close(model.compute_logits(out).double().cpu(), ref_logits, **tolerance())


# ----------------------------------------------------------------------------- forward

def test_forward_matches_naive_reference_with_features_then_own_output(tmp_path, embedding):
    draft_dir = make_eagle_dir(tmp_path / "d", TARGET_RAW, DRAFT_VOCAB)
    model = load(draft_dir, embedding)
    ids, feats = inputs()
    out = step(model, new_cache(model), ids, feats)  # [T, 3*Ht] -> fc applied
    assert out.shape == (T, TARGET.hidden_size)
    ref_out, ref_logits = reference(draft_dir, embedding, ids, feats)
    assert_matches(model, out, ref_out, ref_logits)
    # Second call: the draft's own H-wide output fed back (fc skipped), fresh sequence.
    out2 = step(model, new_cache(model), ids, out.float().cpu())
    ref_out2, ref_logits2 = reference(draft_dir, embedding, ids, out.double().cpu())
    assert_matches(model, out2, ref_out2, ref_logits2)


def test_chunked_feeding_equals_one_shot(tmp_path, embedding):
    model = load(make_eagle_dir(tmp_path / "d", TARGET_RAW, DRAFT_VOCAB), embedding)
    ids, feats = inputs(1)
    whole = step(model, new_cache(model), ids, feats)
    cache = new_cache(model)
    first = step(model, cache, ids[:20], feats[:20], kv_start=0)
    second = step(model, cache, ids[20:], feats[20:], kv_start=20)
    torch.testing.assert_close(torch.cat((first, second)), whole, **tolerance())


def test_positions_beyond_config_max_position_embeddings(tmp_path, embedding):
    draft_dir = make_eagle_dir(tmp_path / "d", TARGET_RAW, DRAFT_VOCAB, max_position_embeddings=16)
    model = load(draft_dir, embedding, max_positions=64)
    assert model.cos.shape[0] == 64  # sized from the runtime context, not the config's 16
    ids, feats = inputs(2)
    assert_matches(model, step(model, new_cache(model), ids, feats), *reference(draft_dir, embedding, ids, feats))


def test_rope_theta_defaults_to_10000_when_absent(tmp_path, embedding):
    draft_dir = make_eagle_dir(tmp_path / "d", TARGET_RAW, DRAFT_VOCAB, rope_theta=None, rope_scaling=None)
    assert "rope_theta" not in json.loads((draft_dir / "config.json").read_text())
    model = load(draft_dir, embedding)
    assert model.config.rope_theta == 10000.0
    ids, feats = inputs(3)
    assert_matches(model, step(model, new_cache(model), ids, feats), *reference(draft_dir, embedding, ids, feats))


def test_llama3_rope_scaling_is_honoured(tmp_path, embedding):
    scaled = load(make_eagle_dir(tmp_path / "a", TARGET_RAW, DRAFT_VOCAB), embedding)
    plain = load(make_eagle_dir(tmp_path / "b", TARGET_RAW, DRAFT_VOCAB, rope_scaling=None), embedding)
    assert scaled.config.rope_scaling.rope_type == "llama3" and plain.config.rope_scaling.rope_type == "default"
    ids, feats = inputs(4)
    a = scaled.compute_logits(step(scaled, new_cache(scaled), ids, feats))
    b = plain.compute_logits(step(plain, new_cache(plain), ids, feats))
    assert not torch.allclose(a, b, atol=1e-4)


# ----------------------------------------------------------------------------- loading

def test_both_forms_load_identically_and_map_vocab(tmp_path, embedding):
    st = load(make_eagle_dir(tmp_path / "st", TARGET_RAW, DRAFT_VOCAB, form="safetensors", seed=5), embedding)
    pt = load(make_eagle_dir(tmp_path / "pt", TARGET_RAW, DRAFT_VOCAB, form="bin", seed=5), embedding)
    assert (tmp_path / "pt" / "pytorch_model.bin").is_file()
    a, b = st.state_dict(), pt.state_dict()
    assert a.keys() == b.keys() and "d2t" in a and not any("embed" in k for k in a)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert st.d2t.dtype == torch.int64 and st.t2d.dtype == torch.bool and st.fc.weight.dtype == DTYPE
    chosen = chosen_target_ids(TARGET.vocab_size, DRAFT_VOCAB, seed=5)
    draft_ids = torch.arange(DRAFT_VOCAB, device=TEST_DEVICE)
    assert torch.equal((draft_ids + st.d2t[draft_ids]).cpu(), chosen)  # d2t holds offsets
    assert st.t2d.sum() == DRAFT_VOCAB and bool(st.t2d[chosen.to(TEST_DEVICE)].all())
    ids, feats = inputs(5)
    assert st.compute_logits(step(st, new_cache(st), ids[:7], feats[:7])).shape == (7, DRAFT_VOCAB)


def test_embedding_is_shared_and_not_a_parameter(tmp_path, embedding):
    emb = embedding.to(TEST_DEVICE, DTYPE)
    draft_dir = make_eagle_dir(tmp_path / "d", TARGET_RAW, DRAFT_VOCAB)
    state = load_file(str(draft_dir / "model.safetensors"))
    save_file({**state, "embed_tokens.weight": torch.zeros(97, 64)}, str(draft_dir / "model.safetensors"))
    model = load_eagle(draft_dir, TARGET, emb, DTYPE, TEST_DEVICE, 64)  # SpecForge extra: ignored
    assert model.embed_weight.data_ptr() == emb.data_ptr()
    assert not any("embed" in n for n, _ in model.named_parameters())


def test_same_vocab_without_d2t_is_identity(tmp_path, embedding):
    draft_dir = make_eagle_dir(tmp_path / "d", TARGET_RAW, TARGET.vocab_size)
    state = load_file(str(draft_dir / "model.safetensors"))
    save_file({k: v for k, v in state.items() if k not in ("d2t", "t2d")}, str(draft_dir / "model.safetensors"))
    model = load(draft_dir, embedding)
    assert not model.d2t.any() and model.t2d.all() and model.t2d.shape == (TARGET.vocab_size,)


def _rewrite(draft_dir, edit):
    path = str(draft_dir / "model.safetensors")
    save_file(edit(load_file(path)), path)


def _set(name, value_fn):
    return lambda s: {**s, name: value_fn(s)}


def _drop(name):
    return lambda s: {k: v for k, v in s.items() if k != name}


def _flip_t2d(s):
    t2d = s["t2d"].clone()
    t2d[int(torch.nonzero(~t2d)[0])] = True
    return {**s, "t2d": t2d}


def _duplicate_d2t(s):
    d2t = s["d2t"].clone()
    d2t[1] = d2t[0] - 1  # draft ids 0 and 1 both map to the same target id
    return {**s, "d2t": d2t}


BROKEN_TENSORS = {
    "missing_d2t": (_drop("d2t"), "d2t is missing"),
    "zero_d2t": (_set("d2t", lambda s: torch.zeros_like(s["d2t"])), "d2t is all zeros"),
    "d2t_out_of_vocab": (_set("d2t", lambda s: s["d2t"] + 200), "outside"),
    "d2t_not_injective": (_duplicate_d2t, "not injective"),
    "t2d_inconsistent": (_flip_t2d, "t2d is inconsistent"),
    "wrong_fc_shape": (_set("fc.weight", lambda s: torch.zeros(64, 128)), r"'fc.weight' has shape \(64, 128\)"),
    "extra_tensor": (_set("midlayer.extra.weight", lambda s: torch.zeros(3)), "unexpected tensors"),
    "missing_tensor": (_drop("norm.weight"), "lacks 1 tensors: norm.weight"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_TENSORS))
def test_broken_tensors_raise_checkpoint_error(tmp_path, embedding, case):
    edit, message = BROKEN_TENSORS[case]
    draft_dir = make_eagle_dir(tmp_path / "d", TARGET_RAW, DRAFT_VOCAB)
    _rewrite(draft_dir, edit)
    with pytest.raises(CheckpointError, match=message):
        load(draft_dir, embedding)


@pytest.mark.parametrize("overrides, message", [
    ({"vocab_size": 100}, "vocab_size 100 != target vocab_size 97"),
    ({"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1}, "hidden_size 32 != target"),
    ({"target_hidden_size": 48}, "target_hidden_size 48"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}}, r"\[4\] outside \[0, 4\)"),
])
def test_incompatible_config_raises_checkpoint_error(tmp_path, embedding, overrides, message):
    draft_dir = make_eagle_dir(tmp_path / "d", TARGET_RAW, DRAFT_VOCAB, **overrides)
    with pytest.raises(CheckpointError, match=message):
        load(draft_dir, embedding)


def test_draft_vocab_larger_than_vocab_is_rejected():
    raw = {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 8, "vocab_size": 97,
           "draft_vocab_size": 98}
    with pytest.raises(CheckpointError, match="draft_vocab_size 98 > vocab_size 97"):
        DraftConfig.from_hf(raw).check_compatible(TARGET)


def test_truncated_safetensors_raises_checkpoint_error(tmp_path, embedding):
    path = make_eagle_dir(tmp_path / "d", TARGET_RAW, DRAFT_VOCAB) / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="corrupted or truncated"):
        load(path.parent, embedding)


def test_truncated_bin_raises_checkpoint_error(tmp_path, embedding):
    path = make_eagle_dir(tmp_path / "d", TARGET_RAW, DRAFT_VOCAB, form="bin") / "pytorch_model.bin"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="corrupted"):
        load(path.parent, embedding)


class NotATensor:
    """A pickled object weights-only loading must refuse (it could run code on unpickling)."""


def test_bin_with_arbitrary_object_is_refused(tmp_path, embedding):
    draft_dir = make_eagle_dir(tmp_path / "d", TARGET_RAW, DRAFT_VOCAB, form="bin")
    state = torch.load(draft_dir / "pytorch_model.bin", weights_only=True)
    torch.save({**state, "extra": NotATensor()}, draft_dir / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="more than plain tensors"):
        load(draft_dir, embedding)


def test_missing_files_raise_model_not_found(tmp_path, embedding):
    draft_dir = make_eagle_dir(tmp_path / "d", TARGET_RAW, DRAFT_VOCAB)
    (draft_dir / "model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="neither"):
        load(draft_dir, embedding)
    (draft_dir / "config.json").unlink()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load(draft_dir, embedding)
    with pytest.raises(ModelNotFoundError):
        load(tmp_path / "nowhere", embedding)


def test_capture_layers_from_config_or_target_default():
    raw = {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 8, "vocab_size": 97}
    assert DraftConfig.from_hf(raw).capture_layers(TARGET) == TARGET.default_capture_layers()
    aux = DraftConfig.from_hf({**raw, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 3]}})
    assert aux.capture_layers(TARGET) == (0, 2, 3)
    cfg = DraftConfig.from_hf(raw)
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.draft_vocab_size, cfg.target_hidden_size) == (16, 4, 97, 64)


def fused_head(tmp_path, embedding, triton: bool, **reference_fields):
    """A head with its fused projections (as served) and the kernels to run it on: the Triton set (on a
    CPU through Triton's interpreter), or the reference set with ``reference_fields`` replaced."""
    import dataclasses
    from kernels import REFERENCE
    draft_dir = make_eagle_dir(tmp_path / "d", TARGET_RAW, DRAFT_VOCAB)
    model = load(draft_dir, embedding)
    model.fuse_projections()
    if triton:
        pytest.importorskip("triton")
        return draft_dir, model, select_kernels(TEST_DEVICE, "triton")
    return draft_dir, model, dataclasses.replace(REFERENCE, **reference_fields)


@pytest.mark.parametrize("fused", ["separate", "fused", "rope in projection", "triton"])
def test_level_logits_matches_naive_reference(tmp_path, embedding, fused):
    """A tree level's forward and logits from its inputs (``kernels.level_input``: every node's parent
    here its own row of features): with few enough rows (``fused_rows``) through the fused
    projections, the norm and the final norm in their epilogues, and RoPE with the draft's KV write
    in the q/k/v projection's where the kernel set has it (its reference, or the Triton set: on a
    CPU through Triton's interpreter); every way the oracle's."""
    import dataclasses
    from kernels import REFERENCE
    from kernels.fused_linear import scaled_qkv_rope_ref
    draft_dir, model, base = fused_head(tmp_path, embedding, fused == "triton",
                                        scaled_qkv_rope=scaled_qkv_rope_ref if fused != "fused" else None)
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return base.scaled_qkv_rope(*args, **kwargs)

    kernels = dataclasses.replace(base, fused_rows=REFERENCE.fused_rows if fused == "separate" else (lambda hidden: T),
                                  scaled_qkv_rope=counted if base.scaled_qkv_rope is not None else None)
    ids, feats = inputs(2)
    lay = layout_step([SeqChunk(ids, 0, list(range(10)))], BLOCK, torch.device(TEST_DEVICE), kernels)
    mid = model.midlayer
    with torch.inference_mode():
        h = model.fc(feats.to(TEST_DEVICE, DTYPE))
        x, h, _ = kernels.level_input(h[None], torch.arange(T, device=TEST_DEVICE)[None], lay.input_ids[None],
                                      model.embed_weight, mid.input_layernorm.weight, mid.input_layernorm.eps,
                                      mid.hidden_norm.weight, mid.hidden_norm.eps, None,
                                      torch.zeros(T, 1, dtype=torch.int32, device=TEST_DEVICE))
        out, logits = model.level_logits(x, h, lay.meta, new_cache(model), kernels)
    assert logits.dtype == torch.float32 and logits.shape == (T, DRAFT_VOCAB)
    ref_out, ref_logits = reference(draft_dir, embedding, ids, feats)
    torch.testing.assert_close(out.double().cpu(), ref_out, **tolerance())
    torch.testing.assert_close(logits.double().cpu(), ref_logits, **tolerance())
    # one kernel projected q/k/v, rotated q and k and wrote the draft's KV (none in the separate path)
    assert len(calls) == (0 if fused in ("separate", "fused") else 1)


@pytest.mark.parametrize("kernels_name", ["reference", "fused", "triton"])
def test_extend_matches_naive_reference(tmp_path, embedding, kernels_name):
    """The draft's extend over committed tokens (``EagleNet.extend``: the forward, then the LM head at
    the rows asked for): with few enough rows (``fused_rows``) as a tree level goes, the fc in a few-row
    kernel, the embedding and input norms in one ``level_input`` launch, the fused projections and the
    final norm in the last one's epilogue (the reference kernels, or the Triton set through Triton's
    interpreter on a CPU); else ``forward`` and ``compute_logits``. Every way the oracle's."""
    import dataclasses
    from kernels import REFERENCE
    draft_dir, model, base = fused_head(tmp_path, embedding, kernels_name == "triton",
                                        fused_rows=REFERENCE.fused_rows if kernels_name == "reference"
                                        else (lambda hidden: T))
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return base.level_input(*args, **kwargs)

    kernels = dataclasses.replace(base, level_input=counted)
    ids, feats = inputs(3)
    lay = layout_step([SeqChunk(ids, 0, list(range(10)))], BLOCK, torch.device(TEST_DEVICE), kernels)
    rows = torch.tensor([0, T // 2, T - 1], device=TEST_DEVICE)
    with torch.inference_mode():
        out, logits = model.extend(lay.input_ids, feats.to(TEST_DEVICE, DTYPE), lay.meta, new_cache(model), kernels,
                                   rows)
    assert logits.dtype == DTYPE and logits.shape == (3, DRAFT_VOCAB)
    ref_out, ref_logits = reference(draft_dir, embedding, ids, feats)
    torch.testing.assert_close(out.double().cpu(), ref_out, **tolerance())
    torch.testing.assert_close(logits.double().cpu(), ref_logits[rows.cpu()], **tolerance())
    assert len(calls) == (0 if kernels_name == "reference" else 1)  # the fused path: one launch for the inputs
