"""``--exact``: the batch-invariant target kernels (kernels/exact_set.py, the default on CUDA), from
the flag to ServerInfo.

Without a GPU the exact kernels run through Triton's interpreter (TRITON_INTERPRET=1, set by
conftest.py): slow, so the models here are tiny (hidden 64, 2 layers) and the outputs short.
"""

import dataclasses

import numpy as np
import pytest
import torch

from cli import main as cli
from client.eagle3_client import Eagle3Client
from common.errors import InvalidRequestError
from common.sampling_params import SamplingParams
from common.tree_settings import TreeSettings
from draft_service.drafter import EagleDrafter
from draft_service.spec_config import SpecConfig
from drafters import OracleDrafter
from kernels import REFERENCE, exact_by_default, select_kernels
from kernels.attention import unpack_mask
from runtime.static_layout import Bucket, StaticLayout
from tiny_eagle import make_target_and_head
from tiny_models import TRITON_DEVICE, target_for
from verify_service import server_config
from verify_service.config import EngineConfig
from verify_service.engine import Engine
from verify_service.model_runner import SeqChunk
from verify_service.server import create_server

PROMPTS = [[5, 6, 7], list(range(10, 30))]
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
EXACT_BF16 = {"device": TRITON_DEVICE, "dtype": "bfloat16", "exact": True}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_target_and_head(tmp_path_factory.mktemp("exact"), num_hidden_layers=2)


@pytest.fixture(scope="module")
def exact_target_only(dirs):
    pytest.importorskip("triton")
    return [r.token_ids for r in Engine(target_for(dirs[0], **EXACT_BF16)).generate(PROMPTS, PARAMS)]


def test_exact_selects_the_batch_invariant_set_on_cuda_or_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    from kernels.exact_set import EXACT

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_kernels("cpu", exact=True) is EXACT
    assert select_kernels("cpu", "triton", exact=True) is EXACT
    assert select_kernels("cpu", "auto").name != "exact"  # off unless asked for
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="--exact needs CUDA"):
        select_kernels("cpu", exact=True)


def test_exact_contradicts_the_reference_kernels():
    with pytest.raises(ValueError, match="reference"):
        select_kernels(TRITON_DEVICE, "reference", exact=True)
    with pytest.raises(InvalidRequestError, match="contradicts") as info:  # refused before the model loads
        EngineConfig("m", device=TRITON_DEVICE, kernels="reference", exact=True)
    assert info.value.field == "exact"


def test_the_config_refuses_exact_on_a_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(InvalidRequestError, match="needs CUDA"):
        EngineConfig("m", device="cpu", exact=True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert EngineConfig("m", device="cpu", exact=True).exact


def test_the_lm_head_goes_through_the_kernel_sets_matmul(dirs):
    """The logits use ``kernels.linear`` (the exact matmul in exact mode), not F.linear directly."""
    target = target_for(dirs[0], kernels="reference")
    seen = []

    def linear(x, w, bias=None):
        seen.append(tuple(w.shape))
        return REFERENCE.linear(x, w, bias)

    target.runner.kernels = dataclasses.replace(REFERENCE, linear=linear)
    target.blocks.ensure_capacity(0, 3)
    target.runner.step([SeqChunk([5, 6, 7], 0, target.blocks.block_table(0), (2,))])
    cfg = target.model_config
    assert seen[-1] == (cfg.vocab_size, cfg.hidden_size)


def test_a_graphed_tree_step_gives_other_kernel_sets_the_bool_mask():
    """A graph's layout holds the mask packed for the Triton set; the exact set takes it unpacked."""
    tree = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], bool)
    chunks = [SeqChunk([1, 2, 3, 4], 20, [3, 7], np.arange(4), positions=[20, 21, 21, 22], custom_mask=tree),
              SeqChunk([6], 9, [2], (0,))]
    lay = StaticLayout(Bucket(2, 4, True), table_width=2, max_seq_len=64, block_size=16, device=torch.device("cpu"))
    lay.fill(chunks)
    want = np.zeros((8, 32), bool)  # (seqs * tokens, 32 columns a word)
    want[:4, :4] = tree
    want[4, 0] = True  # the decode token sees itself
    assert torch.equal(unpack_mask(lay.meta.custom_mask), torch.from_numpy(want))


def _eagle_engine(dirs):
    spec = SpecConfig(str(dirs[1]), tree="dynamic", depth=4, top_k=3, max_nodes=10)
    target = target_for(dirs[0], **EXACT_BF16)
    drafter = EagleDrafter.from_checkpoint(spec, target.model_config, target.model.model.embed_tokens.weight,
                                           target.cfg.max_num_seqs, target.max_model_len, target.cfg.kernels)
    return Engine(target, drafter, spec.settings)


def _oracle_engine(dirs):
    # The oracle guesses with the float32 references (cheap): mostly the bf16 target's own tokens,
    # so trees are accepted deep, next to a wrong sibling at every depth.
    drafter = OracleDrafter(target_for(dirs[0], device="cpu", dtype="float32", kernels="reference"), 3, 1)
    engine = Engine(target_for(dirs[0], **EXACT_BF16), drafter, TreeSettings("dynamic", depth=3, max_nodes=6))
    drafter.engine = engine
    return engine


@pytest.mark.parametrize("make_engine, accepts", [(_eagle_engine, False), (_oracle_engine, True)],
                         ids=["eagle", "oracle"])
def test_bf16_greedy_speculative_output_equals_target_only(dirs, exact_target_only, make_engine, accepts):
    """Tree steps (and, with the oracle, deep accepted nodes) give the target-only tokens, bit for bit."""
    engine = make_engine(dirs)
    assert engine.target.runner.kernels.name == "exact" and engine.target.dtype == torch.bfloat16
    results = engine.generate(PROMPTS, PARAMS)
    assert [r.token_ids for r in results] == exact_target_only
    assert all(r.speculation.steps > 0 for r in results)
    assert (sum(r.speculation.accepted_tokens for r in results) > 0) == accepts  # the random head accepts none


@pytest.mark.parametrize("flags, setting", [([], None), (["--exact"], True), (["--no-exact"], False)])
def test_server_info_reports_exact_numerics(dirs, tmp_path, flags, setting):
    """The flag reaches the engine's config unresolved (unset: the device's default) and
    ServerInfo reports what the engine runs: without the flag, exact on CUDA and not on a CPU."""
    exact = setting if setting is not None else torch.device(TRITON_DEVICE).type == "cuda"
    if exact:
        pytest.importorskip("triton")
    args = cli.build_parser().parse_args(["serve-verify", "--model", str(dirs[0]), "--device", TRITON_DEVICE,
                                          "--no-speculation", "--num-kv-blocks", "16",
                                          "--listen", f"unix:{tmp_path}/api.sock", *flags])
    cfg = server_config.from_args(args, str(dirs[0]))
    assert cfg.engine.exact is setting
    server = create_server(cfg)
    try:
        with Eagle3Client(cfg.listen, timeout_s=60) as client:
            assert client.server_info()["exact_numerics"] is exact
    finally:
        server.stop(0)


def test_exact_by_default_on_cuda_unless_the_references_are_asked_for():
    assert exact_by_default("cuda", "auto") and exact_by_default("cuda", "triton")
    assert not exact_by_default("cuda", "reference")  # --kernels reference alone is no contradiction
    assert not exact_by_default("cpu", "auto") and not exact_by_default("cpu", "triton")
    EngineConfig("m", device=TRITON_DEVICE, kernels="reference")  # exact unset: no refusal
    with pytest.raises(InvalidRequestError, match="true, false or unset") as info:
        EngineConfig("m", exact="yes")
    assert info.value.field == "exact"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the default is the exact set on CUDA only")
def test_a_cuda_engine_runs_the_exact_set_unless_told_not_to(dirs):
    assert target_for(dirs[0], device="cuda", dtype="bfloat16", exact=None).runner.kernels.name == "exact"
    assert target_for(dirs[0], device="cuda", dtype="bfloat16", exact=False).runner.kernels.name == "triton"
    assert target_for(dirs[0], device="cuda", dtype="bfloat16", kernels="reference",
                      exact=None).runner.kernels.name == "reference"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_exact_mode_replays_cuda_graphs_with_the_eager_tokens(dirs):
    """Decode and tree steps replay graphs (the tree's mask unpacked for the exact set inside them)."""
    eager = Engine(target_for(dirs[0], **EXACT_BF16, enforce_eager=True))
    want = [r.token_ids for r in eager.generate(PROMPTS, PARAMS)]
    assert eager.target.runner.graph_steps == 0
    for engine in (Engine(target_for(dirs[0], **EXACT_BF16)), _eagle_engine(dirs), _oracle_engine(dirs)):
        assert [r.token_ids for r in engine.generate(PROMPTS, PARAMS)] == want
        assert engine.target.runner.graph_steps > 0


def test_the_row_tile_probe_reads_a_target_layer(dirs, monkeypatch):
    """The engine probes its first layer's fused weights before any step on a GPU
    (``verify_service/target.py``); the layer's names are the probe's (here through the interpreter:
    the tiny model's K under 1024 keeps every row tile's bits)."""
    pytest.importorskip("triton")
    from kernels import exact_set

    monkeypatch.setattr(exact_set, "_ROW_COUNT_TILES", {})
    target = target_for(dirs[0], **EXACT_BF16)
    assert exact_set.probe_layer(target.model.model.layers[0]) is True
    device = target.model.model.norm.weight.device
    assert exact_set._ROW_COUNT_TILES == {(device, torch.bfloat16): True}
    assert exact_set.row_count_tiles(torch.zeros(1, device=device, dtype=torch.bfloat16)) is (device.type == "cuda")


def test_a_prompt_step_too_big_for_the_prompt_graphs_replays_a_ragged_graph(dirs, monkeypatch):
    """Prompts arriving together past the largest prompt graph of one-token rows replay a ragged graph
    with the exact kernels too (their attention on the ragged grid), and give the eager engine's
    tokens. With ``graphs_on_cpu`` on a CPU (through Triton's interpreter, the graphs' sizes cut to
    16-token prompt graphs and a 64-token ragged one), real graphs of the shipped sizes on a GPU."""
    from verify_service import target_graphs

    if not torch.cuda.is_available():
        monkeypatch.setattr(target_graphs, "PROMPT_GRAPH_TOKENS", 16)
        monkeypatch.setattr(target_graphs, "RAGGED_GRAPH_TOKENS", (64,))
    lens = (20, 15, 10, 3) if not torch.cuda.is_available() else (150, 140, 130, 120, 3)
    prompts = [[(7 * i + j) % 90 + 1 for j in range(n)] for i, n in enumerate(lens)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    eager = Engine(target_for(dirs[0], **EXACT_BF16, max_num_seqs=8, enforce_eager=True))
    want = [r.token_ids for r in eager.generate(prompts, params)]
    graphed = Engine(target_for(dirs[0], **EXACT_BF16, max_num_seqs=8, graphs_on_cpu=True))
    assert [r.token_ids for r in graphed.generate(prompts, params)] == want
    assert graphed.target.runner.ragged_steps == 1
