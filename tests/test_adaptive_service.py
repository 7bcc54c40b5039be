"""Adaptive speculation in the verify service: the flag, the cost table file, and its choices in
GetMetrics and Prometheus, through the real services (shared-memory buffers on the CPU)."""

import json

import prometheus_client
import pytest
import torch

from cli import main as cli
from client.eagle3_client import _to_dict
from common.sampling_params import SamplingParams
from common.tree_settings import TreeSettings, tree_sizes
from protos.eagle3.v1 import generation_pb2 as pb
from services import Stack
from test_prometheus import metrics_url, scrape
from tiny_eagle import make_eagle_dir
from tiny_models import TEST_DEVICE, make_model_dir, target_for, tiny_config
from verify_service import api_convert, server_config
from verify_service.engine import Engine
from verify_service.metrics import families
from verify_service.sequence import SpeculationMetrics
from verify_service.stats import VerifyStats

PROMPTS = [[5, 6, 7], list(range(10, 50)), [88] * 17]


def parse(*flags):
    args = cli.build_parser().parse_args(["serve-verify", "--model", "m", *flags])
    return server_config.from_args(args, "m")


def test_the_flag_turns_it_on_off_and_auto_follows_the_device(monkeypatch):
    assert parse("--device", "cpu").adaptive_speculation is False  # auto by default: off on a CPU ...
    monkeypatch.setattr(server_config, "engine_config", lambda args, model_dir: None)  # (no CUDA check here)
    assert parse("--device", "cuda").adaptive_speculation is True  # ... on with CUDA
    assert parse("--device", "cuda", "--adaptive-speculation", "off").adaptive_speculation is False
    monkeypatch.undo()
    assert parse("--device", "cpu", "--adaptive-speculation", "auto").adaptive_speculation is False
    assert parse("--device", "cpu", "--adaptive-speculation", "on").adaptive_speculation is True
    assert parse("--device", "cpu", "--adaptive-speculation", "off").adaptive_speculation is False
    assert parse("--device", "cpu", "--adaptive-speculation", "on", "--no-speculation").adaptive_speculation is False
    assert parse("--adaptive-speculation", "on", "--cost-table", "c.json").cost_table == "c.json"


def stats(**kw) -> VerifyStats:
    base = dict(running_requests=0, waiting_requests=0, completed_requests=1, cancelled_requests=0,
                generated_tokens=5, kv_blocks_used=0, kv_blocks_total=8, speculative_steps=2, plain_steps=3,
                speculation=SpeculationMetrics(), draft_connected=True, draft_sessions=1, draft_errors=0,
                refused_trees=0, control_plane_p50_us=0.0, control_plane_p99_us=0.0)
    return VerifyStats(**{**base, **kw})


def test_choices_reach_get_metrics_and_prometheus():
    s = stats(adaptive_speculation=True, adaptive_tree_nodes=4, adaptive_decisions={0: 3, 4: 2}, detached_requests=7,
              left_draft_requests=5)
    reply = _to_dict(api_convert.server_metrics(s))
    assert reply["adaptive_speculation"] and reply["adaptive_tree_nodes"] == 4
    assert reply["adaptive_steps_by_tree_nodes"] == {0: 3, 4: 2}
    fams = {f.name: f for f in families(s)}
    assert {sample.labels["tree_nodes"]: sample.value for sample in fams["eagle3_verify_adaptive_decisions"].samples} \
        == {"0": 3, "4": 2}
    assert fams["eagle3_verify_adaptive_tree_nodes"].samples[0].value == 4
    assert fams["eagle3_verify_requests_without_draft"].samples[0].value == 7
    assert fams["eagle3_verify_requests_left_draft"].samples[0].value == 5
    assert "eagle3_verify_adaptive_decisions" not in {f.name for f in families(stats())}  # fixed tree: none
    assert not pb.ServerMetrics().adaptive_speculation and prometheus_client  # the field's default: off


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("adaptive_svc")
    return (make_model_dir(root / "target", "llama3", seed=5, std=0.3),
            make_eagle_dir(root / "draft", tiny_config("llama3"), draft_vocab=64, seed=1), root)


def test_services_with_adaptive_speculation_keep_the_output_and_report_their_choices(dirs, tmp_path):
    target, draft, root = dirs
    table = root / "costs.json"
    stack = Stack(tmp_path, target, draft, verify_args=[
        "--tree-nodes", "12", "--tree-depth", "4", "--tree-top-k", "3", "--max-model-len", "512",
        "--adaptive-speculation", "on", "--cost-table", str(table), "--metrics-port", "0"])
    try:
        want = [r.token_ids for r in Engine(target_for(target)).generate(
            PROMPTS, SamplingParams(max_tokens=20, ignore_eos=True))]
        for prompt, tokens in zip(PROMPTS, want):
            assert stack.client.complete(prompt, max_tokens=20, ignore_eos=True).token_ids == tokens
        m = stack.client.metrics()
        # A choice each request: trees or plain steps, decided step by step, or (where the start-up
        # costs say trees do not pay at batch 1: a loaded machine's timings) no draft from the start
        without_draft = scrape(metrics_url(stack.verify))["eagle3_verify_requests_without_draft_total"]
        assert m["adaptive_speculation"] and sum(m["adaptive_steps_by_tree_nodes"].values()) + without_draft > 0
        assert set(m["adaptive_steps_by_tree_nodes"]) <= {0, *tree_sizes(TreeSettings("dynamic", 4, 3, 12))}
        here = torch.cuda.get_device_name() if TEST_DEVICE.startswith("cuda") else "cpu"
        assert json.loads(table.read_text())["meta"]["device"] == here  # measured at start-up, written
    finally:
        stack.close()
