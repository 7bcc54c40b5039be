"""Speculative generation with a real (randomly initialised) EAGLE-3 head on tiny targets:
greedy output equals target-only output for every tree shape, batch and stop condition."""

import json

import pytest

from common.sampling_params import SamplingParams
from draft_service.spec_config import SpecConfig
from draft_service.drafter import EagleDrafter
from tiny_eagle import make_eagle_dir, run_steps
from tiny_models import TRITON_DEVICE, target_for, make_model_dir, tiny_config
from verify_service.engine import Engine

PROMPTS = [[5, 6, 7], list(range(10, 50)), [88] * 17, list(range(60, 80)), [1, 2]]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    target_dir = make_model_dir(root / "target", "llama3", seed=5, std=0.3)
    draft = make_eagle_dir(root / "draft", tiny_config("llama3"), draft_vocab=64, seed=1)
    static = root / "tree.json"
    static.write_text(json.dumps({"paths": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1]]}))
    return target_dir, draft, static


def eagle_engine(dirs, tree, eager: bool = False, **engine_kw):
    """``eager``: no graphs on either side, on any test device (the eager paths' own behaviour)."""
    target_dir, draft, static = dirs
    spec = SpecConfig(str(draft), tree=tree, depth=4, top_k=3, max_nodes=10,
                      static_tree_file=str(static) if tree == "static" else None)
    target = target_for(target_dir, **({"enforce_eager": True} if eager else {}), **engine_kw)
    drafter = EagleDrafter.from_checkpoint(spec, target.model_config, target.model.model.embed_tokens.weight,
                                           target.cfg.max_num_seqs, target.max_model_len, target.cfg.kernels,
                                           cuda_graphs=not eager)
    return Engine(target, drafter, spec.settings)


def target_only(target_dir, prompts, params, **engine_kw):
    return [r.token_ids for r in Engine(target_for(target_dir, **engine_kw)).generate(prompts, params)]


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("tree", ["chain", "static", "dynamic"])
def test_greedy_output_equals_target_only_for_every_tree(dirs, tree, graphs):
    """``graphs``: the target's graphed paths on a CPU too (each replay eager): chained trees verified
    straight from the draft's trees on the device, a stop token mid-tree, max_tokens cut short."""
    free_run = target_only(dirs[0], [PROMPTS[1]], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    stop = free_run[9]  # lands mid-tree for the second prompt
    params = [SamplingParams(max_tokens=n, stop_token_ids=(stop,)) for n in (9, 30, 14, 2, 25)]
    engine = eagle_engine(dirs, tree, max_batch_tokens=32, graphs_on_cpu=graphs)
    results = engine.generate(PROMPTS, params)
    assert [r.token_ids for r in results] == target_only(dirs[0], PROMPTS, params)
    assert results[1].finish_reason == "stop"
    assert all(r.speculation.steps > 0 for r in results if len(r.token_ids) > 2)
    assert engine.target.blocks.num_used_blocks == 0 and engine.drafter.blocks.num_used_blocks == 0
    assert (engine.steps_ahead > 0) == (graphs or engine.target.device.type == "cuda")


def test_draft_cache_holds_exactly_the_committed_rows(dirs):
    """(Eager: a chained step's graph keeps the blocks of its tree rows between steps.)"""
    engine = eagle_engine(dirs, "dynamic", eager=True)
    seq_id = engine.add_request(PROMPTS[3], SamplingParams(max_tokens=20, ignore_eos=True))
    for _ in range(4):
        engine.step()
        seq = engine.sequences[seq_id]
        rows = engine.drafter.rows[seq_id]
        assert rows == seq.num_tokens - 1  # every committed position's feature, and nothing else
        bs = engine.drafter.kv.block_size
        assert len(engine.drafter.blocks.block_table(seq_id)) == -(-rows // bs)


def test_spec_config_is_validated_up_front(dirs, tmp_path):
    from common.errors import InvalidRequestError, ModelNotFoundError
    with pytest.raises(ModelNotFoundError, match="draft directory"):
        SpecConfig(str(tmp_path / "missing"))
    with pytest.raises(InvalidRequestError, match="tree: must be one of"):
        SpecConfig(str(dirs[1]), tree="beam")
    with pytest.raises(InvalidRequestError, match="depth"):
        SpecConfig(str(dirs[1]), depth=0)
    with pytest.raises(InvalidRequestError, match="static_tree_file"):
        SpecConfig(str(dirs[1]), tree="static")
    with pytest.raises(InvalidRequestError, match="top_k"):
        SpecConfig(str(dirs[1]), top_k=1000)


@pytest.mark.parametrize("tree", ["dynamic", "static"])
def test_tree_scores_equal_sequential_draft_runs(dirs, tree):
    """Every node's cumulative draft log-prob equals walking its path one row at a time
    through a plain causal cache: tree masks, positions and parent hidden states line up."""
    import torch
    from link.protocol import DraftFeed, ProposeRequest
    from runtime.step_layout import SeqChunk

    engine = eagle_engine(dirs, tree)
    target, drafter = engine.target, engine.drafter
    history = PROMPTS[1]
    n = len(history)
    target.blocks.ensure_capacity(0, n)
    feats = target.runner.step([SeqChunk(history, 0, target.blocks.block_table(0))]).captured
    feed = DraftFeed(0, 0, feats[:-1], torch.tensor(history[1:]).numpy())
    cand = drafter.step([feed], [ProposeRequest(0, 4)])[0]
    assert cand.num_nodes > 3
    d2t = drafter.net.d2t
    draft_id = {int(d + d2t[d]): d for d in range(d2t.numel())}
    for i in range(cand.num_nodes):
        path, j = [], i
        while j >= 0:
            path.insert(0, int(cand.tokens[j]))
            j = int(cand.parents[j])
        ref = eagle_engine(dirs, tree).drafter
        ref.step([feed], [])
        h, logp, total, m = ref.last_out[0], ref.last_logp[0], 0.0, n - 1
        for depth, tok in enumerate(path):
            total += float(logp[draft_id[tok]])
            ref.blocks.ensure_capacity(0, m + depth + 1)
            out, lp = ref._run([SeqChunk([tok], m + depth, ref.blocks.block_table(0), logits_rows=(0,))], h[None])
            h, logp = out[0], lp[0]
        assert abs(total - float(cand.log_probs[i])) < 1e-4, (i, path, total, float(cand.log_probs[i]))


TRITON_PARAMS = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (6, 9, 4)]


@pytest.fixture(scope="module")
def triton_only(dirs):
    """Target-only tokens on the Triton kernels, checked once against the references'."""
    pytest.importorskip("triton")
    prompts = PROMPTS[:3]
    tokens = target_only(dirs[0], prompts, TRITON_PARAMS, kernels="triton", device=TRITON_DEVICE)
    assert tokens == target_only(dirs[0], prompts, TRITON_PARAMS, kernels="reference", device=TRITON_DEVICE)
    return tokens


@pytest.mark.parametrize("tree", ["chain", "dynamic"])
def test_triton_kernels_give_the_reference_tokens(dirs, tree, triton_only):
    """The whole engine on the Triton kernels (Triton's interpreter without a GPU): target-only
    output equals the references', and speculation on them equals target-only on them."""
    engine = eagle_engine(dirs, tree, kernels="triton", device=TRITON_DEVICE)
    assert engine.target.runner.kernels.name == engine.drafter.kernels.name == "triton"
    results = engine.generate(PROMPTS[:3], TRITON_PARAMS)
    assert [r.token_ids for r in results] == triton_only
    assert sum(r.speculation.steps for r in results) > 0


def test_the_in_process_drafters_trees_skip_the_structural_checks(dirs, monkeypatch):
    """Trees the in-process drafter grows are valid by construction: the coordinator does not check
    them (every other provider's are checked: tests/test_speculative.py, the link's fuzz tests)."""
    import verify_service.draft_coordinator as coordinator
    from runtime.tree import invalid_trees

    calls = []
    monkeypatch.setattr(coordinator, "invalid_trees", lambda *a: calls.append(1) or invalid_trees(*a))
    engine = eagle_engine(dirs, "dynamic")
    assert engine.drafter.trusted_trees
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    assert [r.token_ids for r in engine.generate(PROMPTS, params)] == target_only(dirs[0], PROMPTS, params)
    assert engine.speculation_totals().steps > 0 and not calls
    engine.drafter.trusted_trees = False  # the same trees, from a provider not trusted: checked
    engine.generate(PROMPTS[:1], params)
    assert calls


@pytest.mark.parametrize("tree", ["chain", "static", "dynamic"])
@pytest.mark.parametrize("sampled", [False, True])
def test_the_draft_chained_after_acceptance_gives_the_unchained_steps(dirs, tree, sampled):
    """Steps of trees alone hand the draft its rows on the device before the step's one wait
    (``DraftCoordinator.draft_on_device``); the tokens, acceptance and trees are the ones the
    draft gets after the host commits, through a stop token mid-tree and max_tokens cut short.
    (Eager: trees verified from the device are scheduled at their full size, so steps of graphs
    may hold fewer sequences within the token budget; their tokens are compared elsewhere.)"""
    free_run = target_only(dirs[0], [PROMPTS[1]], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    extra = dict(temperature=0.8, seed=3) if sampled else {}
    params = [SamplingParams(max_tokens=n, stop_token_ids=(free_run[9],), **extra) for n in (9, 30, 14, 2, 25)]
    runs = []
    for chain in (True, False):
        engine = eagle_engine(dirs, tree, eager=True, max_batch_tokens=32)
        engine.speculation.chain = chain
        runs.append((run_steps(engine, PROMPTS, params), engine.speculation.chained_steps,
                     engine.drafter.blocks.num_used_blocks,
                     engine.released_speculation.accepted_tokens))
    (chained, n_chained, used, accepted), (unchained, n_unchained, _, want_accepted) = runs
    assert n_chained > 5 and n_unchained == 0
    assert chained == unchained and accepted == want_accepted and used == 0


def test_rows_packed_on_the_device_are_the_hosts_concatenation():
    """``pack_rows`` (what a graphed chained extend is fed) lays rows out as the host does: each
    sequence's first ``counts`` columns, back to back, zero past the last."""
    import torch
    from kernels.draft_rows import pack_rows_ref as pack_rows
    counts = torch.tensor([2, 0, 3, 1])
    tokens = torch.arange(16).view(4, 4)
    features = torch.randn(4, 4, 5)
    ids, hidden = pack_rows(counts, tokens, features, 12)
    n = counts.tolist()
    want_ids = torch.cat([tokens[i, :n[i]] for i in range(4)])
    want_hidden = torch.cat([features[i, :n[i]] for i in range(4)])
    assert ids[:6].tolist() == want_ids.tolist() and not ids[6:].any()
    assert torch.equal(hidden[:6], want_hidden) and not hidden[6:].any()


def test_the_chained_draft_reserves_no_row_past_its_capacity(dirs, monkeypatch):
    """``step_on_device`` with a sequence at the end of its context beside one bringing the step's
    widest feed (5 rows): each reserves its own rows, never past the drafter's capacity (its block
    table must fit the extend graph's)."""
    import numpy as np
    import torch
    from link.protocol import DraftFeed
    target_dir, draft, _ = dirs
    spec = SpecConfig(str(draft), tree="dynamic", depth=4, top_k=3, max_nodes=10)
    target = target_for(target_dir, max_model_len=64)
    drafter = EagleDrafter.from_checkpoint(spec, target.model_config, target.model.model.embed_tokens.weight,
                                           target.cfg.max_num_seqs, target.max_model_len, target.cfg.kernels,
                                           cuda_graphs=False)  # (the eager path, on any test device)
    width, dev = len(drafter.capture_layers) * target.model_config.hidden_size, target.device
    for seq, n in ((0, 63), (1, 3)):
        drafter.step([DraftFeed(seq, 0, torch.zeros(n, width, device=dev), np.arange(n) % 50 + 1)], [])
    asked = []
    real = drafter.blocks.ensure_capacity
    monkeypatch.setattr(drafter.blocks, "ensure_capacity", lambda s, n: asked.append(n) or real(s, n))
    D = 5
    trees = drafter.step_on_device([0, 1], [63, 3], [2, 11], torch.tensor([1, 5], device=dev),
                                   torch.ones(2, D, dtype=torch.long, device=dev), torch.zeros(2, D, width, device=dev),
                                   spec.settings).collect()
    assert set(trees) == {0, 1} and asked and max(asked) <= drafter._capacity
    assert drafter.rows[0] == 64 and drafter.rows[1] == 8  # the eager path settles as it feeds


def test_trees_verified_from_the_device_reach_past_max_tokens_never_past_the_context(dirs):
    """``trees_fit`` (a chained step's trees verified whole from the device) lets a tree reach past a
    request's max_tokens (the tokens it commits beyond are cut at commit) but not past the context;
    their host copies are attached whole, a host-laid tree is cut to what max_tokens leaves."""
    from runtime.tree import CandidateTree

    engine = eagle_engine(dirs, "chain")
    sid = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()  # the prompt: one token out, two left
    seq, coordinator = engine.sequences[sid], engine.speculation
    tree = CandidateTree.chain([1, 2, 3, 4])  # depth 4: past max_tokens
    assert coordinator.trees_fit([sid, 12345])  # (a finished or unknown sequence: its tree is left out)
    coordinator.attach({sid: tree})
    assert seq.tree.max_depth == 1  # two tokens left: a node and the bonus
    coordinator.attach({sid: tree}, whole=True)
    assert seq.tree is tree
    coordinator.max_model_len = seq.num_tokens + 3  # room for depth 3 only
    assert not coordinator.trees_fit([sid])
    coordinator.max_model_len = seq.num_tokens + 4
    assert coordinator.trees_fit([sid])
