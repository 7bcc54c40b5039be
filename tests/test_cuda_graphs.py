"""Graphed steps: a static, padded layout gives the eager layout's results (on any device,
through the Triton kernels), and on CUDA replayed graphs give the eager path's tokens."""

import numpy as np
import pytest
import torch

from common.sampling_params import SamplingParams
from kernels.attention_triton import pack_mask
from runtime.static_layout import Bucket, StaticLayout
from runtime.step_layout import SeqChunk, layout_step
from tiny_models import TRITON_DEVICE, make_model_dir, target_for
from verify_service.engine import Engine
from verify_service.target_graphs import MAX_GRAPH_TOKENS, graph_buckets

triton = pytest.importorskip("triton")

TREE = np.array([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]], bool)


def chunks_for(target, lengths):
    """A verification-shaped step: a 5-node tree, a decode token, a 3-node chain."""
    tables = []
    for sid, n in enumerate(lengths):
        target.blocks.ensure_capacity(sid, n + 8)
        tables.append(target.blocks.block_table(sid))
    chain = np.tril(np.ones((3, 3), bool))
    return [SeqChunk([4, 9, 11, 3, 7], lengths[0], tables[0], logits_rows=np.arange(5),
                     positions=lengths[0] + np.array([0, 1, 1, 2, 2]), custom_mask=TREE),
            SeqChunk([8], lengths[1], tables[1], logits_rows=(0,)),
            SeqChunk([1, 2, 3], lengths[2], tables[2], logits_rows=np.arange(3),
                     positions=lengths[2] + np.arange(3), custom_mask=chain)]


def test_static_layout_pads_and_packs():
    chunks = [SeqChunk([1, 2, 3, 4, 5], 20, [3, 7], logits_rows=np.arange(5), positions=[20, 21, 21, 22, 22],
                       custom_mask=TREE),
              SeqChunk([6], 9, [2], logits_rows=(0,))]
    lay = StaticLayout(Bucket(4, 8, True), table_width=3, max_seq_len=64, block_size=16, device=torch.device("cpu"))
    assert lay.fits(chunks) and not lay.fits(chunks * 3)
    qsl = lay.fill(chunks)
    m = lay.meta
    assert qsl.tolist() == [0, 5, 6] and m.query_start_loc.tolist() == [0, 5, 6, 6, 6]
    assert m.seq_lens.tolist() == [25, 10, 0, 0] and m.block_tables.tolist()[:2] == [[3, 7, 0], [2, 0, 0]]
    slots = m.slot_mapping.tolist()
    assert slots[:6] == [7 * 16 + 4 + i for i in range(5)] + [2 * 16 + 9] and set(slots[6:]) == {-1}
    assert lay.input_ids.tolist()[:6] == [1, 2, 3, 4, 5, 6] and m.positions.tolist()[:6] == [20, 21, 21, 22, 22, 9]
    want = np.zeros((32, 5), bool)
    want[:5] = TREE
    want[5, 0] = True  # the decode token sees itself
    assert torch.equal(m.custom_mask, pack_mask(torch.from_numpy(want)))
    assert m.mask_start.tolist() == [20, 9, 0, 0] and m.max_query_len == 8 and m.max_seq_len == 64


def test_static_layout_packs_every_chunks_mask_in_its_rows():
    """Masks of several trees of mixed sizes (and a decode token) land packed in their own rows, each
    as ``pack_mask`` packs it alone."""
    gen = np.random.default_rng(1)
    chunks, want = [], np.zeros((64, 16), bool)
    at = 0
    for n in (5, 1, 16, 9):
        mask = np.tril(gen.random((n, n)) < 0.5) | np.eye(n, dtype=bool)
        chunks.append(SeqChunk(np.zeros(n, np.int64), 3, [1], logits_rows=np.arange(n), custom_mask=mask)
                      if n > 1 else SeqChunk([0], 3, [1], logits_rows=(0,)))
        want[at:at + n, :n] = mask if n > 1 else True
        at += n
    lay = StaticLayout(Bucket(4, 16, True), table_width=2, max_seq_len=64, block_size=16, device=torch.device("cpu"))
    lay.fill(chunks)
    assert torch.equal(lay.meta.custom_mask, pack_mask(torch.from_numpy(want)))


def test_graph_buckets():
    buckets = graph_buckets(max_num_seqs=20, max_tree_tokens=24, prompt_tokens=300)
    decode = [b.seqs for b in buckets if not b.tree]
    assert decode == [1, 2, 4, 8, 16, 20, 64, 128, 256]  # the last three: prompt steps only
    assert {b.tokens for b in buckets if b.tree} == {2, 4, 8, 16, 24}
    assert max(b.seqs for b in buckets if b.tree) == 20
    assert all(b.num_tokens <= MAX_GRAPH_TOKENS for b in buckets)
    assert [b.seqs for b in graph_buckets(128, 24, 512) if not b.tree][-4:] == [120, 128, 256, 512]


def test_bucket_choice_is_the_smallest_fitting_one_captured_first(tmp_path):
    """``TargetGraphs.bucket_for`` (cached bucket lists) picks what a fresh scan of ``graph_buckets``
    picks: the smallest captured bucket that fits, else the smallest fitting one."""
    runner = target_for(make_model_dir(tmp_path / "m", "llama3", seed=2, std=0.3), max_num_seqs=20).runner
    buckets = runner.graphs.buckets()
    gen = np.random.default_rng(0)
    for _ in range(200):
        sizes = [int(n) for n in gen.integers(1, 40, size=int(gen.integers(1, 22)))]
        tree = bool(gen.integers(0, 2))
        chunks = [SeqChunk(np.zeros(n if tree else 1, np.int64), 0, [0], logits_rows=np.arange(n if tree else 1),
                           custom_mask=np.ones((n, n), bool) if tree else None) for n in sizes]
        runner.graphs._graphs = {b: (object() if gen.random() < 0.3 else None) for b in buckets if gen.random() < 0.5}
        most = max(sizes) if tree else 1
        fitting = [b for b in buckets if b.tree == tree and not b.ragged and len(chunks) <= b.seqs <= 20 and b.tokens >= most]
        captured = [b for b in fitting if runner.graphs.captured(b) is not None]
        want = min(captured or fitting, key=lambda b: (b.num_tokens, b.tokens)) if fitting else None
        assert runner.graphs.bucket_for(chunks) == want
    runner.graphs._graphs = {}


@pytest.mark.parametrize("kernels", ["triton", "reference"])
@pytest.mark.parametrize("bucket", [Bucket(4, 8, True), Bucket(3, 16, True)])
def test_static_layout_forward_equals_eager_layout(tmp_path, bucket, kernels):
    """The model on a padded static layout (as a graph replays it) matches the eager layout row by
    row: padding rows read nothing, write nothing and disturb no real row (with the references too:
    their padding rows, sequence 0's first row by their indices, once overwrote its query)."""
    target = target_for(make_model_dir(tmp_path / "m", "llama3", seed=2, std=0.3), kernels=kernels,
                        max_model_len=96, device=TRITON_DEVICE, enforce_eager=True)
    kernels, runner = target.runner.kernels, target.runner
    prompts = [list(range(3, 30)), list(range(40, 51)), list(range(7, 20))]
    for sid, p in enumerate(prompts):  # prefill the three sequences
        target.blocks.ensure_capacity(sid, len(p))
        runner.step([SeqChunk(p, 0, target.blocks.block_table(sid), logits_rows=(len(p) - 1,))])
    chunks = chunks_for(target, [len(p) for p in prompts])
    saved = target.kv_cache.data.clone()
    eager = layout_step(chunks, target.kv_cache.block_size, target.device, kernels)
    with torch.inference_mode():
        want = target.model.compute_logits(
            target.model(eager.input_ids, eager.meta, target.kv_cache, kernels).hidden[eager.logits_rows])
        kv_after = target.kv_cache.data.clone()
        target.kv_cache.data.copy_(saved)
        static = StaticLayout(bucket, 8, target.max_model_len, target.kv_cache.block_size, target.device)
        qsl = static.fill(chunks)
        got = target.model.compute_logits(target.model(static.input_ids, runner._graph_meta(static), target.kv_cache,
                                                       kernels).hidden)
    torch.testing.assert_close(got[:qsl[-1]], want, atol=1e-4, rtol=1e-4)
    # (GEMMs of 9 and of 32 rows block their sums differently on a GPU: a few ulps apart)
    torch.testing.assert_close(target.kv_cache.data, kv_after, atol=1e-4, rtol=1e-4, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphed_engine_gives_the_eager_tokens(tmp_path, dtype):
    model_dir = make_model_dir(tmp_path / "m", "llama3", seed=4, std=0.3)
    prompts = [list(range(3, 40)), [5, 6, 7], list(range(60, 75)), [9] * 21]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (12, 30, 7, 20)]
    runs = {}
    for eager in (False, True):
        target = target_for(model_dir, device="cuda", dtype=dtype, kernels="triton", enforce_eager=eager)
        engine = Engine(target)
        runs[eager] = [r.token_ids for r in engine.generate(prompts, params)]
        assert (target.runner.graph_steps > 0) != eager
    assert runs[False] == runs[True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_short_prompt_replays_a_decode_graph_with_the_eager_tokens(tmp_path):
    """A prompt of at most as many tokens as the largest decode or prompt graph has sequences runs as
    that graph (its tokens as one-token sequences): one replay, the eager engine's tokens. Without the
    prompt graphs, a prompt longer than the largest decode graph replays a ragged graph."""
    model_dir = make_model_dir(tmp_path / "m", "llama3", seed=4, std=0.3)
    prompts = [list(range(3, 9)), [5, 6, 7], list(range(20, 31)), [(7 * i) % 90 for i in range(100)]]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    eager = Engine(target_for(model_dir, device="cuda", dtype="float32", kernels="triton", enforce_eager=True))
    for prompt_graphs in (True, False):  # decode graphs of 8 at most; prompt graphs of 64, 128 and 256
        target = target_for(model_dir, device="cuda", dtype="float32", kernels="triton", max_num_seqs=8)
        target.runner.capture([b for b in target.runner.graphs.buckets() if not b.tree and not b.ragged
                               and (prompt_graphs or b.seqs <= 8)])
        engine = Engine(target)
        for prompt in prompts:
            engine.add_request(prompt, params)
            before, ragged = target.runner.graph_steps, target.runner.ragged_steps
            first = engine.step()  # the whole prompt in one step, its first token drawn
            assert first and first[0].token_ids
            assert target.runner.graph_steps == before + 1
            assert target.runner.ragged_steps == ragged + (not prompt_graphs and len(prompt) > 8)
            got = first[0].token_ids + [t for ev in engine.run_until_done() for t in ev.token_ids]
            assert got == eager.generate([prompt], params)[0].token_ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("prompt_len", [20, 700])
def test_a_mixed_step_runs_its_trees_on_a_graph_and_gives_the_eager_outputs(tmp_path, prompt_len):
    """Trees and a decode followed by a prompt chunk (a request arriving while others verify): the
    prompt chunk runs first (a prompt graph of one-token rows, or a ragged graph when longer than
    the largest), the rest on its tree graph; logits, captured features and row offsets are the one
    eager forward's."""
    target = target_for(make_model_dir(tmp_path / "m", "llama3", seed=2, std=0.3), kernels="triton",
                        max_model_len=1024, device="cuda", dtype="float32")
    runner = target.runner
    runner.set_capture_layers((0, 1))
    prompts = [list(range(3, 30)), list(range(40, 51)), list(range(7, 20))]
    for sid, p in enumerate(prompts):
        target.blocks.ensure_capacity(sid, len(p))
        runner.step([SeqChunk(p, 0, target.blocks.block_table(sid), logits_rows=(len(p) - 1,))])
    chunks = chunks_for(target, [len(p) for p in prompts])
    target.blocks.ensure_capacity(3, prompt_len)
    prompt = SeqChunk([(5 * i) % 90 for i in range(prompt_len)], 0, target.blocks.block_table(3),
                      logits_rows=(prompt_len - 1,))
    runner.capture([b for b in runner.graphs.buckets() if not b.tree])  # the prompt graphs
    saved = target.kv_cache.data.clone()
    eager = layout_step(chunks + [prompt], target.kv_cache.block_size, target.device, runner.kernels)
    with torch.inference_mode():
        out = target.model(eager.input_ids, eager.meta, target.kv_cache, runner.kernels, runner.capture_layers)
        want = target.model.compute_logits(out.hidden[eager.logits_rows])
    target.kv_cache.data.copy_(saved)
    before, ragged = runner.graph_steps, runner.ragged_steps
    got = runner.step(chunks + [prompt])
    assert runner.graph_steps == before + 2  # the trees' graph, the prompt's
    assert runner.ragged_steps == ragged + (prompt_len > 512)
    assert got.query_start_loc == eager.query_start_loc.tolist()
    torch.testing.assert_close(got.logits, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.captured, out.captured, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.hidden, out.hidden, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_requests_arriving_beside_trees_give_the_target_only_tokens(tmp_path):
    """Speculative decoding on CUDA (float32, graphs on) while requests keep arriving: their prompt
    chunks share steps with the others' trees (split steps: the prompt's forward, then the trees'
    graph); every output is the target-only engine's."""
    from tiny_eagle import make_eagle_dir
    from tiny_models import tiny_config

    model_dir = make_model_dir(tmp_path / "m", "llama3", seed=5, std=0.3)
    draft = make_eagle_dir(tmp_path / "d", tiny_config("llama3"), draft_vocab=64, seed=1)
    prompts = [[5, 6, 7], list(range(10, 50)), [88] * 17, list(range(60, 80)), [1, 2]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = [r.token_ids for r in Engine(target_for(model_dir, device="cuda", dtype="float32", kernels="triton",
                                                   max_num_seqs=8)).generate(prompts, params)]
    engine = speculate_with_arrivals(target_for(model_dir, device="cuda", dtype="float32", kernels="triton",
                                                max_num_seqs=8), draft, prompts, params)
    assert engine.outputs == want
    assert engine.target.runner.split_steps > 0 and engine.released_speculation.accepted_tokens > 0


def speculate_with_arrivals(target, draft_dir, prompts, params) -> Engine:
    """A tiny dynamic-tree head on ``target``; one request arrives every two steps. The engine's
    ``outputs``: each request's tokens, in arrival order."""
    from draft_service.drafter import EagleDrafter
    from draft_service.spec_config import SpecConfig

    spec = SpecConfig(str(draft_dir), tree="dynamic", depth=4, top_k=3, max_nodes=10)
    drafter = EagleDrafter.from_checkpoint(spec, target.model_config, target.model.model.embed_tokens.weight,
                                           target.cfg.max_num_seqs, target.max_model_len, target.cfg.kernels)
    engine = Engine(target, drafter, spec.settings)
    ids, got = [], {}
    for prompt in prompts:
        ids.append(engine.add_request(prompt, params))
        for _ in range(2):
            for ev in engine.step():
                got.setdefault(ev.seq_id, []).extend(ev.token_ids)
    for ev in engine.run_until_done():
        got.setdefault(ev.seq_id, []).extend(ev.token_ids)
    engine.outputs = [got[i] for i in ids]
    return engine


def test_a_prompt_step_too_big_for_the_prompt_graphs_replays_a_ragged_graph(tmp_path):
    """Four long prompts and a short one arriving together (543 tokens, past the largest prompt graph
    of one-token rows): their step replays a ragged graph (``Bucket.ragged``), target-only and with
    the draft fed its captured rows; every output is the eager engine's. With ``graphs_on_cpu`` on a
    CPU (reference kernels) and the real graphs on a GPU (the Triton kernels' ragged grid)."""
    from draft_service.drafter import EagleDrafter
    from draft_service.spec_config import SpecConfig
    from tiny_eagle import make_eagle_dir
    from tiny_models import tiny_config

    model_dir = make_model_dir(tmp_path / "m", "llama3", seed=5, std=0.3)
    prompts = [[(7 * i + j) % 90 + 1 for j in range(n)] for i, n in enumerate((150, 140, 130, 120))] + [[5, 6, 7]]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    want = [r.token_ids for r in Engine(target_for(model_dir, max_num_seqs=8, enforce_eager=True)).generate(prompts, params)]
    graphed = dict(max_num_seqs=8, graphs_on_cpu=True)
    plain = Engine(target_for(model_dir, **graphed))
    assert [r.token_ids for r in plain.generate(prompts, params)] == want
    assert plain.target.runner.ragged_steps == 1

    target = target_for(model_dir, **graphed)
    spec = SpecConfig(str(make_eagle_dir(tmp_path / "d", tiny_config("llama3"), draft_vocab=64, seed=1)),
                      tree="dynamic", depth=4, top_k=3, max_nodes=10)
    drafter = EagleDrafter.from_checkpoint(spec, target.model_config, target.model.model.embed_tokens.weight,
                                           target.cfg.max_num_seqs, target.max_model_len, target.cfg.kernels)
    engine = Engine(target, drafter, spec.settings)
    assert [r.token_ids for r in engine.generate(prompts, params)] == want
    assert target.runner.ragged_steps == 1 and engine.released_speculation.accepted_tokens > 0


def test_warm_up_does_nothing_on_a_cpu(tmp_path):
    target = target_for(make_model_dir(tmp_path / "m", "llama3", seed=4), device="cpu", dtype="float32")
    assert target.runner.warm_up(64) == 0.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_warm_up_compiles_and_captures_without_changing_tokens(tmp_path):
    """The start-up warm-up (dummy prefill and mixed steps writing block 0, decode captures)
    leaves nothing behind that a request could see."""
    model_dir = make_model_dir(tmp_path / "m", "llama3", seed=4, std=0.3)
    prompts = [list(range(3, 40)), [5, 6, 7]]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (12, 30)]
    runs = {}
    for warm in (False, True):
        target = target_for(model_dir, device="cuda", dtype="float32", kernels="triton")
        if warm:
            assert target.runner.warm_up(48) > 0 and list(target.runner.graphs)
        runs[warm] = [r.token_ids for r in Engine(target).generate(prompts, params)]
    assert runs[True] == runs[False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton compiles on a GPU")
def test_exact_warm_up_covers_prompts_joining_decodes_past_a_key_chunk(tmp_path):
    """After the start-up warm-up an exact-mode engine compiles nothing while prompt pieces of 64
    tokens or more join sequences decoding past one key chunk (SmolLM2's attention geometry; the
    scenario of ``benchmarks/warm_up_coverage.py``). Before the warm-up ran a 96-token piece
    (``model_runner.WARM_PIECES``) the attention's prompt tile split over key chunks compiled while
    serving, a stall of every stream (SmolLM2 on one H200, 16 and 64 concurrent requests, 018f487).
    Since exact-mode prompt steps replay ragged graphs, no step of the scenario launches the exact
    attention from Python at all."""
    from benchmarks.warm_up_coverage import main

    model_dir = make_model_dir(tmp_path / "m", "llama3", seed=4, std=0.3, hidden_size=576, num_attention_heads=9,
                               num_key_value_heads=3, num_hidden_layers=2)
    report = main(["--model", str(model_dir), "--device", "cuda", "--dtype", "bfloat16", "--exact",
                   "--waves", "1,3,8"])
    assert report["exact_attention_launches"] == []  # every prompt step on a graph
    assert report["compilations_after_warm_up"] == 0


def test_decode_graphs_join_the_features_only_for_steps_that_feed_the_draft(tmp_path):
    """A decode graph keeps the captured layers' inputs apart: a step that feeds the draft joins its
    rows after the replay (the eager forward's features), a step that does not gets none and
    launches nothing for them. A tree's graph joins them inside (its acceptance graphs read them)."""
    target = target_for(make_model_dir(tmp_path / "m", "llama3", seed=3, std=0.3), max_num_seqs=4,
                        graphs_on_cpu=True)
    runner = target.runner
    runner.set_capture_layers((0, 1))
    lengths = [9, 5]
    for sid, n in enumerate(lengths):
        target.blocks.ensure_capacity(sid, n + 1)
        runner.step([SeqChunk(list(range(3, 3 + n)), 0, target.blocks.block_table(sid), logits_rows=(n - 1,))],
                    capture=False)
    decodes = [SeqChunk([7 + sid], n, target.blocks.block_table(sid), logits_rows=(0,))
               for sid, n in enumerate(lengths)]
    saved = target.kv_cache.data.clone()
    eager = layout_step(decodes, target.kv_cache.block_size, target.device, runner.kernels)
    with torch.inference_mode():
        want = target.model(eager.input_ids, eager.meta, target.kv_cache, runner.kernels, runner.capture_layers)
    for capture in (True, False):
        target.kv_cache.data.copy_(saved)
        before = runner.graph_steps
        got = runner.step(decodes, capture=capture)
        assert runner.graph_steps == before + 1
        graph = runner.graphs.captured(runner.graphs.bucket_for(decodes))
        assert graph.captured is None and len(graph.parts) == 2
        if capture:
            torch.testing.assert_close(got.captured, want.captured)
            assert all(got.captured.data_ptr() != p.data_ptr() for p in graph.parts)  # the caller's own
        else:
            assert got.captured is None
        torch.testing.assert_close(got.hidden, want.hidden)
    tree = runner.graphs.get(Bucket(2, 4, True))
    assert tree.captured is not None and not tree.parts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graphs_captured_again_after_the_capture_layers_change(tmp_path):
    """New capture layers drop the graphs and their memory pool; the next captures take a new pool
    (reusing the freed one failed inside PyTorch's allocator)."""
    model_dir = make_model_dir(tmp_path / "m", "llama3", seed=4, std=0.3)
    target = target_for(model_dir, device="cuda", dtype="float32", kernels="triton")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    first = Engine(target).generate([[5, 6, 7]], params)[0].token_ids
    target.runner.set_capture_layers((0, 1))
    assert Engine(target).generate([[5, 6, 7]], params)[0].token_ids == first
    assert list(target.runner.graphs)


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_the_warm_up_placeholders_run_on_every_kernel_set(tmp_path, kernels):
    """What the CUDA warm-up runs besides its graphs: a prompt piece beside a placeholder tree (an
    eager masked step) and the acceptance kernels on a placeholder chain."""
    from verify_service.model_runner import _chain_chunk

    target = target_for(make_model_dir(tmp_path / "m", "llama3"), kernels=kernels,
                        device=TRITON_DEVICE if kernels == "triton" else "cpu")
    runner, bs = target.runner, target.kv_cache.block_size
    prefill = SeqChunk(np.zeros(12, np.int64), 3, [0] * 2, logits_rows=(11,))
    out = runner.step([prefill, _chain_chunk(8, 15, bs)])
    assert out.logits.shape[0] == 1 + 8 and torch.isfinite(out.logits).all()
    runner._warm_acceptance(8, bs)


def test_every_graphed_path_gives_the_eager_tokens_with_graphs_run_eagerly_on_a_cpu(tmp_path):
    """``graphs_on_cpu``: on a CPU each graph's replay is an eager forward (``runtime/graphs.py``), so
    the paths CUDA graphs take run in CI. Target-only: decode graphs launched ahead, prompts as
    decodes. Speculative, requests arriving every two steps: split steps (a prompt's forward, then
    the trees' graph), and chained trees verified straight from the draft's trees on the device,
    accepted by the acceptance graph. Every output is the eager target-only engine's. (On a GPU test
    device the same runs take the real graphs.)"""
    from tiny_eagle import make_eagle_dir
    from tiny_models import tiny_config

    model_dir = make_model_dir(tmp_path / "m", "llama3", seed=5, std=0.3)
    draft = make_eagle_dir(tmp_path / "d", tiny_config("llama3"), draft_vocab=64, seed=1)
    prompts = [[5, 6, 7], list(range(10, 50)), [88] * 17, list(range(60, 80)), [1, 2]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = [r.token_ids for r in Engine(target_for(model_dir, max_num_seqs=8, enforce_eager=True)).generate(prompts, params)]
    plain = Engine(target_for(model_dir, max_num_seqs=8, graphs_on_cpu=True))
    assert [r.token_ids for r in plain.generate(prompts, params)] == want
    assert plain.target.runner.graph_steps > 0 and plain.decode_steps_ahead > 0

    engine = speculate_with_arrivals(target_for(model_dir, max_num_seqs=8, graphs_on_cpu=True), draft, prompts, params)
    assert engine.outputs == want
    assert engine.target.runner.split_steps > 0 and engine.steps_ahead > 0 and engine.verifier.graph_accepts > 0
    assert engine.released_speculation.accepted_tokens > 0
    assert engine.target.blocks.num_used_blocks == 0 and engine.drafter.blocks.num_used_blocks == 0


def test_decode_and_prompt_graphs_give_their_greedy_tokens_and_the_sampler_takes_them(tmp_path):
    """A decode or prompt graph computes each logits row's argmax inside it (``StepOutput.greedy``, the
    kernel set's ``argmax``): equal to the argmax of its logits, and a greedy sampler takes it with no
    argmax of its own; the tokens are the eager engine's, which computes them in the sampler. (On a CPU
    through ``graphs_on_cpu``; on a GPU test device the real graphs and the Triton kernel.)"""
    import dataclasses

    model_dir = make_model_dir(tmp_path / "m", "llama3", seed=5, std=0.3)
    prompts = [[5, 6, 7], list(range(10, 30)), [88] * 9]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    eager = Engine(target_for(model_dir, device=TRITON_DEVICE, max_num_seqs=8, enforce_eager=True))
    want = [r.token_ids for r in eager.generate(prompts, params)]
    target = target_for(model_dir, device=TRITON_DEVICE, max_num_seqs=8, graphs_on_cpu=True)
    engine = Engine(target)
    calls = []

    def counted(logits):
        calls.append(logits.shape[0])
        return target.runner.kernels.argmax(logits)

    engine.sampler.kernels = dataclasses.replace(engine.sampler.kernels, argmax=counted)
    assert [r.token_ids for r in engine.generate(prompts, params)] == want
    assert target.runner.graph_steps > 0 and calls == []  # every step graphed: no argmax in the sampler
    for sid in (100, 101):
        target.blocks.ensure_capacity(sid, 16)
    chunks = [SeqChunk([4], 7, target.blocks.block_table(100), logits_rows=(0,)),
              SeqChunk([9], 3, target.blocks.block_table(101), logits_rows=(0,))]
    with torch.inference_mode():
        out = target.runner.step(chunks)
    assert out.greedy is not None and torch.equal(out.greedy, out.logits.argmax(dim=-1))


def test_a_ragged_graph_of_more_tokens_than_a_sequence_holds_captures(tmp_path):
    """A ragged bucket's placeholder rows (its capture's inputs) spread its tokens over its sequences:
    with few sequences and a short ``max_model_len`` (2048 tokens over 4 sequences of at most 200),
    a row's position would lie past the RoPE table. The capture must run, and the step's tokens be
    the eager engine's (on a GPU, the placeholder positions read the table out of bounds: an illegal
    memory access)."""
    model_dir = make_model_dir(tmp_path / "m", "llama3", seed=5, std=0.3)
    prompts = [[(7 * i + j) % 90 + 1 for j in range(n)] for i, n in enumerate((150, 140, 130, 120))]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    small = dict(max_num_seqs=4, max_model_len=200)
    want = [r.token_ids for r in Engine(target_for(model_dir, enforce_eager=True, **small)).generate(prompts, params)]
    graphed = Engine(target_for(model_dir, graphs_on_cpu=True, **small))
    assert [r.token_ids for r in graphed.generate(prompts, params)] == want
    assert graphed.target.runner.ragged_steps == 1


class _Cycle:
    """An object that refers to itself: freed only by a garbage collection."""

    def __init__(self, obj):
        self.obj, self.me = obj, self


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_capture_survives_garbage_that_holds_an_old_graph():
    """An unreachable graph of earlier work, in a reference cycle, is not collected while another graph
    is being captured (destroying a graph then invalidates the capture): ``capture_graph`` keeps the
    collector off for the capture, however much the forward allocates, and on again after."""
    import gc

    from runtime.graphs import capture_graph
    dev = torch.device("cuda")
    old, _ = capture_graph(lambda: torch.zeros(4, device=dev) + 1, dev)
    _Cycle(old)
    del old
    x = torch.ones(8, device=dev)

    def forward():
        _ = [_Cycle(i) for i in range(5000)]  # enough new objects to trigger automatic collections
        return x * 2

    assert gc.isenabled()
    graph, out = capture_graph(forward, dev)
    assert gc.isenabled()
    x.fill_(3.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full((8,), 6.0, device=dev))
    gc.collect()  # the old graph goes now, outside any capture


def test_an_exact_tree_graph_builds_its_ancestor_table_from_the_packed_mask(tmp_path, monkeypatch):
    """A tree graph hands the layout's packed mask to the kernel set's ``prepare_attention`` as it is
    (``ModelRunner._graph_meta``): on the batch-invariant set the ancestor table then takes one launch
    from the words on CUDA (``ancestor_table_triton``) inside the graph, where the mask unpacked first
    took the torch table's 13 launches a tree step. The same table either way."""
    import dataclasses

    from kernels import attention_exact
    from kernels.attention import unpack_mask

    target = target_for(make_model_dir(tmp_path / "m", "llama3", seed=2, std=0.3), kernels="triton", exact=True,
                        max_model_len=96, device=TRITON_DEVICE, enforce_eager=True)
    runner = target.runner
    static = StaticLayout(Bucket(4, 8, True), 8, target.max_model_len, target.kv_cache.block_size, target.device)
    static.fill(chunks_for(target, [20, 9, 14]))
    given, tables = [], []
    prepare = runner.kernels.prepare_attention
    assert prepare is attention_exact.prepare_attention_exact
    monkeypatch.setattr(runner, "kernels", dataclasses.replace(
        runner.kernels, prepare_attention=lambda meta: given.append(meta.custom_mask.dtype) or prepare(meta)))
    kernel = attention_exact.ancestor_table_triton
    monkeypatch.setattr(attention_exact, "ancestor_table_triton", lambda words: tables.append(1) or kernel(words))
    got = runner._graph_meta(static).custom_mask
    assert given == [torch.int32]  # the packed words, once
    assert len(tables) == (1 if static.meta.custom_mask.is_cuda else 0)  # one launch on CUDA
    want = attention_exact.ancestor_table(unpack_mask(static.meta.custom_mask))
    assert torch.equal(got.cpu(), want.cpu())
