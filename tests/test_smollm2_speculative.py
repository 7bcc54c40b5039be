"""SmolLM2 with a randomly initialised EAGLE-3 head of the right shapes: speculative greedy
output equals target-only greedy output, for a chain and a dynamic tree, on real prompts."""

import json

import pytest

from hub.default_model import ensure_default_model
from common.sampling_params import SamplingParams
from draft_service.spec_config import SpecConfig
from tiny_eagle import make_eagle_dir
from tiny_models import TEST_DEVICE, TEST_DTYPE
from cli.main import main
from verify_service.config import EngineConfig
from tools.inprocess import build_engine

pytestmark = pytest.mark.slow
QUESTIONS = ["What is the capital of France?", "Write a short poem about rain.",
             "Explain what a hash table is in two sentences."]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    model_dir = ensure_default_model(progress=False)
    raw = json.loads((model_dir / "config.json").read_text())
    head = make_eagle_dir(tmp_path_factory.mktemp("smol") / "head", raw, draft_vocab=4096, seed=0, std=0.02)
    return model_dir, head


def engine_cfg(model_dir):
    return EngineConfig(str(model_dir), device=TEST_DEVICE, dtype=TEST_DTYPE, max_model_len=1024,
                        max_num_seqs=4, kv_cache_gib=0.25)


@pytest.mark.parametrize("tree, depth", [("chain", 3), ("dynamic", 5)])
def test_random_head_greedy_equals_target_only(dirs, tree, depth):
    model_dir, head = dirs
    base = build_engine(engine_cfg(model_dir))
    prompts = [base.target.encode(messages=[{"role": "user", "content": q}]) for q in QUESTIONS]
    params = SamplingParams(max_tokens=40)
    expected = [r.token_ids for r in base.generate(prompts, params)]
    spec = SpecConfig(str(head), tree=tree, depth=depth, top_k=4, max_nodes=20)
    results = build_engine(engine_cfg(model_dir), spec).generate(prompts, params)
    assert [r.token_ids for r in results] == expected
    assert all(r.speculation.steps > 0 and r.speculation.draft_tokens > 0 for r in results)


def test_cli_with_a_draft_prints_speculation_metrics(dirs, capsys):
    assert main(["generate", "--device", TEST_DEVICE, "--dtype", TEST_DTYPE, "--max-tokens", "24", "--stats",
                 "--draft", str(dirs[1]), "--tree", "chain", "--tree-depth", "3",
                 "What is the capital of France?"]) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out and "[speculation:" in captured.err and "tau " in captured.err


def test_cli_rejects_a_bad_tree_setting_before_loading(dirs, capsys):
    assert main(["generate", "--draft", str(dirs[1]), "--tree-depth", "0", "hi"]) == 2
    assert "depth: must be an integer in [1, 32]" in capsys.readouterr().err


def test_stop_string_with_speculation(dirs):
    """A stop string ends a speculative generation exactly where it ends target-only generation."""
    model_dir, head = dirs
    base = build_engine(engine_cfg(model_dir))
    ids = base.target.encode(messages=[{"role": "user", "content": QUESTIONS[0]}])
    params = SamplingParams(max_tokens=40, stop=("Paris",))
    want = base.generate([ids], params)[0]
    got = build_engine(engine_cfg(model_dir), SpecConfig(str(head), tree="chain", depth=4)).generate([ids], params)[0]
    assert got.text == want.text and got.token_ids == want.token_ids and got.finish_reason == "stop"
    assert "Paris" not in got.text
