"""Paged KV cache and block manager: every way of filling the cache gives the same logits."""

import pytest
import torch

from common.errors import CapacityError
from common.sampling_params import SamplingParams
from tiny_models import target_for, make_model_dir, tolerance
from runtime.block_manager import BlockManager
from verify_service.engine import Engine
from verify_service.model_runner import SeqChunk


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("kv") / "m", "llama3", seed=1)


def run_in_chunks(target, ids, sizes, seq_id=0):
    """Prefill ``ids`` in chunks of the given sizes; returns the logits of every token."""
    rows, start = [], 0
    for n in sizes:
        target.blocks.ensure_capacity(seq_id, start + n)
        chunk = SeqChunk(ids[start:start + n], start, target.blocks.block_table(seq_id),
                         logits_rows=tuple(range(n)))
        rows.append(target.runner.step([chunk]).logits.clone())  # (a graph's output: its static buffer)
        start += n
    return torch.cat(rows)


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_a_prompts_tokens_as_one_step_of_decodes_equal_its_prefill(model_dir, kernels):
    """``decode_tokens``: a prompt chunk's tokens as one-token sequences over its block table, in one
    step (how a CUDA graph of decodes runs a short prompt): the prefill's logits, hidden states and KV,
    after an earlier chunk too (the window of token i is the cache up to its own index); with the
    references and with the Triton kernels (the decode attention over one shared table)."""
    from tiny_models import TRITON_DEVICE
    from verify_service.model_runner import decode_tokens

    if kernels == "triton":
        pytest.importorskip("triton")
    kw = {"kernels": kernels, "device": TRITON_DEVICE, "enforce_eager": True} if kernels == "triton" else {}
    ids = [(5 * i + 2) % 90 for i in range(30)]
    whole, split = target_for(model_dir, **kw), target_for(model_dir, **kw)
    for t in (whole, split):
        t.blocks.ensure_capacity(0, len(ids))
    table = whole.blocks.block_table(0)
    want = whole.runner.step([SeqChunk(ids, 0, table, logits_rows=tuple(range(30)))])
    first = split.runner.step([SeqChunk(ids[:9], 0, table, logits_rows=tuple(range(9)))])
    rest = split.runner.step(decode_tokens([SeqChunk(ids[9:], 9, table, logits_rows=(20,))]))
    assert rest.logits.shape[0] == 21 and rest.query_start_loc == list(range(22))
    torch.testing.assert_close(torch.cat([first.logits, rest.logits]), want.logits, **tolerance())
    torch.testing.assert_close(rest.hidden, want.hidden[9:], **tolerance())
    blocks = -(-len(ids) // whole.kv_cache.block_size)
    torch.testing.assert_close(split.kv_cache.data[:, :, :blocks], whole.kv_cache.data[:, :, :blocks], **tolerance())
    assert decode_tokens([SeqChunk([1, 2], 0, table, positions=[0, 0])]) is None  # a tree's: not a prompt


def test_a_graphed_runner_answers_a_prompt_step_from_its_decode_graph(model_dir, monkeypatch):
    """The runner's side of it (``_prefill_as_decodes``), on the CPU with the graph replay played by the
    eager forward: a prompt chunk and a decode in one step go to the smallest captured decode graph
    that holds their tokens, and come back in the step's own layout (the logits of the rows asked for,
    in chunk order; each chunk's query range) equal to the eager step's; more tokens than any graph
    holds: None (the step runs eagerly)."""
    from runtime.static_layout import Bucket
    from verify_service.model_runner import ModelRunner

    graphed, ref = target_for(model_dir, max_num_seqs=8), target_for(model_dir, max_num_seqs=8)
    runner = graphed.runner
    replayed = []

    def replay(graph, chunks, on_device=None, capture=True):  # the graph's forward, eagerly
        replayed.append((graph, len(chunks)))
        return ModelRunner.step(runner, chunks, capture=capture, eager=True)

    class Captured:
        class layout:
            @staticmethod
            def fits(chunks):
                return True

    monkeypatch.setattr(runner, "_replay", replay)
    runner.graphs._graphs = {Bucket(4, 1, False): None, Bucket(8, 1, False): Captured()}  # 4: not captured
    for t in (graphed, ref):
        t.blocks.ensure_capacity(0, 6)
        t.blocks.ensure_capacity(1, 9)
    chunks = [SeqChunk([3, 1, 4, 1, 5], 0, graphed.blocks.block_table(0), logits_rows=(4,)),
              SeqChunk([7], 8, graphed.blocks.block_table(1), logits_rows=(0,))]
    out = runner._prefill_as_decodes(chunks)
    want = ref.runner.step(chunks)
    assert replayed == [(runner.graphs.captured(Bucket(8, 1, False)), 6)]
    assert out.query_start_loc == want.query_start_loc == [0, 5, 6]
    torch.testing.assert_close(out.logits, want.logits, **tolerance())
    torch.testing.assert_close(out.hidden, want.hidden, **tolerance())
    import verify_service.model_runner as model_runner
    built = []  # a step larger than every graph is refused before a chunk per token is built (5,000
    monkeypatch.setattr(model_runner, "decode_tokens", lambda c: built.append(c))  # tokens: 30 ms)
    assert runner._prefill_as_decodes([SeqChunk(list(range(9)), 0, graphed.blocks.block_table(1))]) is None
    assert len(replayed) == 1 and built == []


def test_chunked_whole_and_token_by_token_prefill_agree(model_dir):
    ids = [(7 * i + 3) % 90 for i in range(45)]  # 45 tokens over 3 blocks of 16
    whole = run_in_chunks(target_for(model_dir), ids, [45])
    chunked = run_in_chunks(target_for(model_dir), ids, [7, 16, 1, 21])
    one_by_one = run_in_chunks(target_for(model_dir), ids, [1] * 45)
    torch.testing.assert_close(chunked, whole, **tolerance())
    torch.testing.assert_close(one_by_one, whole, **tolerance())


def test_mixed_length_batch_equals_each_sequence_alone(model_dir):
    prompts = [[5, 6, 7], list(range(10, 50)), [88] * 17, list(range(60, 80))]
    target = target_for(model_dir)
    alone = [run_in_chunks(target, p, [len(p)], seq_id=100 + i)[-1] for i, p in enumerate(prompts)]
    batch_engine = target_for(model_dir)
    chunks = []
    for i, p in enumerate(prompts):
        batch_engine.blocks.ensure_capacity(i, len(p))
        chunks.append(SeqChunk(p, 0, batch_engine.blocks.block_table(i), logits_rows=(len(p) - 1,)))
    batched = batch_engine.runner.step(chunks).logits
    torch.testing.assert_close(batched, torch.stack(alone), **tolerance())


def test_generator_batch_matches_single_runs_and_frees_every_block(model_dir):
    prompts = [[5, 6, 7], list(range(10, 50)), [88] * 17, list(range(60, 80)), [1, 2]]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (9, 4, 12, 1, 20)]
    target = target_for(model_dir, max_batch_tokens=24)  # forces chunked prefill beside decodes
    engine = Engine(target)
    batched = engine.generate(prompts, params)
    single = [Engine(target_for(model_dir)).generate([p], sp)[0] for p, sp in zip(prompts, params)]
    assert [r.token_ids for r in batched] == [r.token_ids for r in single]
    assert [len(r.token_ids) for r in batched] == [9, 4, 12, 1, 20]
    assert target.blocks.num_used_blocks == 0


def test_block_manager_allocates_frees_and_truncates():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert len(bm.ensure_capacity(1, 9)) == 3
    assert len(bm.ensure_capacity(1, 12)) == 3  # still fits
    bm.ensure_capacity(2, 4)
    assert bm.num_used_blocks == 4
    bm.truncate(1, 5)
    assert len(bm.block_table(1)) == 2 and bm.num_used_blocks == 3
    bm.free(1)
    bm.free(2)
    bm.free(99)  # unknown: no-op
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 8


def test_block_manager_exhaustion_is_typed_and_allocates_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.ensure_capacity(1, 12)
    with pytest.raises(CapacityError, match="KV cache exhausted"):
        bm.ensure_capacity(2, 8)
    assert bm.num_free_blocks == 1 and bm.block_table(2) == []


def test_request_larger_than_the_whole_cache_is_refused(model_dir):
    target = target_for(model_dir, num_kv_blocks=8)  # 8 blocks of 16 tokens
    engine = Engine(target)
    with pytest.raises(CapacityError, match="KV blocks"):
        engine.add_request(list(range(1, 60)), SamplingParams(max_tokens=150))


def test_requests_beyond_capacity_wait_instead_of_failing(model_dir):
    target = target_for(model_dir, num_kv_blocks=8)  # 8 blocks of 16 tokens
    engine = Engine(target)
    prompts = [list(range(3, 73)) for _ in range(3)]  # 5 blocks each: one fits at a time
    results = engine.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    assert all(len(r.token_ids) == 4 for r in results)
    assert target.blocks.num_used_blocks == 0


def test_kv_cache_size_follows_the_memory_budget(model_dir):
    target = target_for(model_dir, kv_cache_gib=1.25e-4, dtype="float32")
    assert target.kv_cache.bytes_per_block(target.model_config, 16, target.dtype) == 16384
    assert target.blocks.num_blocks == 8  # 1.25e-4 GiB / 16 KiB per block
