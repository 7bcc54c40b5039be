"""Speculative generation with drafts of known quality: exact output, tau, KV state."""

import numpy as np
import pytest
import torch

from common.sampling_params import SamplingParams
from common.tree_settings import TreeSettings
from drafters import OracleDrafter
from tiny_models import target_for, make_model_dir
from verify_service.engine import Engine
from verify_service.model_runner import SeqChunk

PROMPTS = [[5, 6, 7], list(range(10, 50)), [88] * 17, list(range(60, 80)), [1, 2]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # eos 96 is reachable: the random model emits it now and then, landing mid-tree
    return make_model_dir(tmp_path_factory.mktemp("spec") / "m", "llama3", seed=2, std=0.3)


def spec_engine(model_dir, tmp_path, depth=3, siblings=0, wrong=False, **engine_kw):
    drafter = OracleDrafter(target_for(model_dir), depth, siblings, wrong)
    limits = TreeSettings("chain" if siblings == 0 else "dynamic", depth=depth, max_nodes=max(1, depth * (siblings + 1)))
    engine = Engine(target_for(model_dir, **engine_kw), drafter, limits)
    drafter.engine = engine
    return engine, drafter


def target_only(model_dir, prompts, params):
    return [r.token_ids for r in Engine(target_for(model_dir)).generate(prompts, params)]


@pytest.mark.parametrize("siblings", [0, 2])
def test_oracle_draft_accepts_every_node(model_dir, tmp_path, siblings):
    params = SamplingParams(max_tokens=13, ignore_eos=True)  # 13 = 1 + 3 steps of 4
    engine, drafter = spec_engine(model_dir, tmp_path, depth=3, siblings=siblings)
    result = engine.generate([PROMPTS[1]], params)[0]
    assert result.token_ids == target_only(model_dir, [PROMPTS[1]], params)[0]
    spec = result.speculation
    assert spec.steps == 3 and spec.tau == 4.0  # depth + 1 tokens every step
    assert spec.accepted_per_depth == [3, 3, 3]
    assert spec.draft_tokens == 3 * 3 * (siblings + 1) and spec.rewound_tokens == 3 * 3 * siblings
    assert drafter.released == {result.seq_id}


def test_always_wrong_draft_still_gives_the_target_output(model_dir, tmp_path):
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    engine, _ = spec_engine(model_dir, tmp_path, depth=4, wrong=True)
    result = engine.generate([PROMPTS[0]], params)[0]
    assert result.token_ids == target_only(model_dir, [PROMPTS[0]], params)[0]
    assert result.speculation.tau == 1.0 and result.speculation.accepted_tokens == 0
    assert result.speculation.rewound_tokens == result.speculation.draft_tokens > 0


@pytest.mark.parametrize("wrong", [False, True])
def test_mixed_batch_with_eos_and_max_tokens_mid_tree(model_dir, tmp_path, wrong):
    free_run = target_only(model_dir, [PROMPTS[1]], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    stop = free_run[6]  # a token the target really emits: a stop lands inside a verified tree
    params = [SamplingParams(max_tokens=n, stop_token_ids=(stop,)) for n in (9, 30, 14, 2, 25)]
    engine, _ = spec_engine(model_dir, tmp_path, depth=4, siblings=1, wrong=wrong, max_batch_tokens=24)
    results = engine.generate(PROMPTS, params)
    expected = target_only(model_dir, PROMPTS, params)
    assert [r.token_ids for r in results] == expected
    assert results[1].finish_reason == "stop" and results[1].token_ids[-1] == stop
    assert results[3].finish_reason == "length" and len(results[3].token_ids) == 2
    assert engine.target.blocks.num_used_blocks == 0


def test_kv_cache_after_speculation_equals_target_only_kv(model_dir, tmp_path):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    engine, _ = spec_engine(model_dir, tmp_path, depth=3, siblings=2)
    seq_id = engine.add_request(PROMPTS[3], params)
    for _ in range(3):  # prefill + first token, then two verification steps
        engine.step()
    seq = engine.sequences[seq_id]
    assert seq.speculation.steps == 2
    tokens = seq.prompt_ids + seq.output_ids[:-1]  # every cached position
    assert seq.num_cached == len(tokens)
    ref = target_for(model_dir)
    ref.blocks.ensure_capacity(0, len(tokens))
    ref.runner.step([SeqChunk(tokens, 0, ref.blocks.block_table(0))])

    def cached(target, sid):
        bs = target.kv_cache.block_size
        slots = [target.blocks.block_table(sid)[i // bs] * bs + i % bs for i in range(len(tokens))]
        flat = target.kv_cache.data.flatten(2, 3)  # [L, 2, slots, kvh, d]
        return flat[:, :, torch.tensor(slots)]

    # fp32, but the two runs multiply matrices of different shapes (tree steps vs one prefill): the
    # BLAS blocking, hence the rounding, differs by a few ulps.
    torch.testing.assert_close(cached(engine.target, seq_id), cached(ref, 0), atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("rule", ["seeded", "residual"])
def test_speculative_sampling_matches_the_target_distribution(model_dir, tmp_path, rule):
    """Under sampling, the token drawn through tree acceptance follows the target's distribution.

    The first token is sampled plainly after prefill; the second goes through acceptance
    against the oracle chain. Among runs whose first token is the most common one, the
    second token's frequencies must match softmax(target logits after that token).
    """
    prompt, n = [3, 4, 5], 1500
    params = [SamplingParams(max_tokens=2, temperature=1.0, seed=s, ignore_eos=True) for s in range(n)]
    engine, _ = spec_engine(model_dir, tmp_path, depth=2, max_num_seqs=64, sampling_acceptance=rule)
    pairs = np.array([r.token_ids for r in engine.generate([prompt] * n, params)])
    top = int(np.bincount(pairs[:, 0]).argmax())
    probe = target_for(model_dir)
    probe.blocks.ensure_capacity(0, 4)
    logits = probe.runner.step([SeqChunk(prompt + [top], 0, probe.blocks.block_table(0), (3,))]).logits[0].cpu()
    second = torch.from_numpy(pairs[pairs[:, 0] == top, 1])
    freq = torch.bincount(second, minlength=logits.numel()).double() / len(second)
    tv = 0.5 * (freq - torch.softmax(logits, -1).double()).abs().sum().item()
    tv_wrong = 0.5 * (freq - torch.softmax(logits / 0.5, -1).double()).abs().sum().item()
    # observed: about 0.08 from sampling noise; sampling at the wrong temperature gives about 0.35
    assert len(second) > 500 and tv < 0.15 < tv_wrong, (len(second), tv, tv_wrong)


@pytest.mark.parametrize("siblings", [0, 2])
def test_seeded_sampling_gives_the_target_only_text(model_dir, tmp_path, siblings):
    """Under the default (seeded) acceptance a seed gives the same tokens with or without a draft,
    whatever the draft proposes; the residual rule, lossless in distribution only, does not."""
    params = [SamplingParams(max_tokens=24, temperature=t, top_p=p, seed=seed, ignore_eos=True)
              for seed, (t, p) in enumerate([(0.7, 1.0), (1.0, 1.0), (1.0, 0.9), (0.7, 0.8), (1.3, 1.0)])]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    want = target_only(model_dir, prompts, params)
    for wrong in (False, True):
        engine, _ = spec_engine(model_dir, tmp_path, depth=3, siblings=siblings, wrong=wrong, max_num_seqs=8)
        results = engine.generate(prompts, params)
        assert [r.token_ids for r in results] == want
        if not wrong:
            assert sum(r.speculation.accepted_tokens for r in results) > 0  # the draft did speculate
    residual, _ = spec_engine(model_dir, tmp_path, depth=3, siblings=siblings, max_num_seqs=8,
                              sampling_acceptance="residual")
    assert [r.token_ids for r in residual.generate(prompts, params)] != want


@pytest.mark.slow
def test_stop_string_completed_inside_an_accepted_path(tmp_path):
    """With an always-right draft, the stop string's last token sits mid-commit; text and
    tokens are cut exactly where target-only decoding cuts them."""
    import shutil

    from hub.default_model import ensure_default_model
    smol = ensure_default_model(progress=False)
    model = make_model_dir(tmp_path / "m", "smollm2", seed=3, std=0.8, vocab_size=49152, eos_token_id=2)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol / f, model / f)
    prompt = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
    free = Engine(target_for(model)).generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    target = target_for(model)
    # Completed by the 10th token: steps commit 5 tokens (4 accepted + bonus) after the first,
    # so it is the 4th of the second step's commit and the 5th must be dropped.
    stop = target.tokenizer.decode(free.token_ids[8:10])
    assert stop.strip(), "the chosen tokens must render as text"
    params = SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop,))
    want = Engine(target_for(model)).generate([prompt], params)[0]
    engine, _ = spec_engine(model, tmp_path, depth=4)
    got = engine.generate([prompt], params)[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, "stop")
    assert got.speculation.tau > 1.0 and stop not in got.text and len(got.token_ids) == 10
