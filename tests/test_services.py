"""Both services as real processes on temporary unix sockets (shared-memory buffers on the CPU)."""

import sys
import threading
import time
from pathlib import Path

import pytest

from client.eagle3_client import ClientError
from common.sampling_params import SamplingParams
from services import Stack
from tiny_eagle import make_eagle_dir
from tiny_models import target_for, make_model_dir, tiny_config
from verify_service.engine import Engine

PROMPTS = [[5, 6, 7], list(range(10, 50)), [88] * 17, list(range(60, 80)), [1, 2], [3] * 30, [9, 8, 7, 6], [40]]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("svc")
    target = make_model_dir(root / "target", "llama3", seed=5, std=0.3)
    draft = make_eagle_dir(root / "draft", tiny_config("llama3"), draft_vocab=64, seed=1)
    return root, target, draft


@pytest.fixture(scope="module")
def stack(dirs, tmp_path_factory):
    root, target, draft = dirs
    s = Stack(tmp_path_factory.mktemp("stack"), target, draft,
              verify_args=["--tree-nodes", "12", "--tree-depth", "4", "--tree-top-k", "3", "--max-model-len", "4096",
                           "--num-kv-blocks", "128"])  # 2048 tokens of KV
    yield s
    s.close()


def expected(target, prompts, max_tokens):
    engine = Engine(target_for(target))
    return [r.token_ids for r in engine.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True)
                                                        for n in max_tokens])]


def test_greedy_through_grpc_equals_in_process_target_only(stack, dirs):
    want = expected(dirs[1], PROMPTS[:3], [16, 16, 16])
    for prompt, tokens in zip(PROMPTS[:3], want):
        c = stack.client.complete(prompt, max_tokens=16, ignore_eos=True)
        assert c.token_ids == tokens and c.finish_reason == "length"
        assert c.speculation["speculated"] and c.usage.completion_tokens == 16
    assert stack.client.server_info()["draft_connected"]


def test_eight_concurrent_clients(stack, dirs):
    lengths = [5, 30, 12, 8, 25, 3, 17, 9]
    want = expected(dirs[1], PROMPTS, lengths)
    got = [None] * 8

    def run(i):
        got[i] = stack.client.complete(PROMPTS[i], max_tokens=lengths[i], ignore_eos=True).token_ids

    chained = stack.client.metrics()["chained_steps"]
    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == want
    assert stack.client.metrics()["kv_blocks_used"] == 0
    assert stack.client.metrics()["chained_steps"] > chained  # steps of two sequences or more (the default)


def test_cancel_mid_stream_frees_the_kv(stack):
    before = stack.client.metrics()["cancelled_requests"]
    # long enough that even a fast GPU is still generating when the cancel arrives
    stream = stack.client.generate(PROMPTS[1], max_tokens=1500, ignore_eos=True)
    first = next(stream)
    assert first.token_ids
    stream.close()  # cancels the RPC
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = stack.client.metrics()
        if m["cancelled_requests"] == before + 1 and m["kv_blocks_used"] == 0:
            break
        time.sleep(0.1)
    assert m["cancelled_requests"] == before + 1 and m["kv_blocks_used"] == 0 and m["running_requests"] == 0,\
        (m, stack.verify.log()[-3000:])


def test_a_cancel_during_chained_steps_leaves_the_other_streams_exact(stack, dirs):
    """Three requests speculate together on chained steps (two or more sequences); one is cancelled
    mid-stream: the others finish with the target-only tokens, the draft link keeps its session and
    every KV block comes back."""
    want = expected(dirs[1], PROMPTS[:2], [40, 40])
    before = stack.client.metrics()
    doomed = stack.client.generate(PROMPTS[2], max_tokens=1500, ignore_eos=True)
    got = [None, None]

    def run(i):
        got[i] = stack.client.complete(PROMPTS[i], max_tokens=40, ignore_eos=True).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    assert next(doomed).token_ids
    time.sleep(0.2)
    doomed.close()  # cancels the RPC, likely between a chained step and the next
    for t in threads:
        t.join(120)
    assert got == want
    deadline = time.monotonic() + 10
    while stack.client.metrics()["kv_blocks_used"] and time.monotonic() < deadline:
        time.sleep(0.1)
    after = stack.client.metrics()
    assert after["kv_blocks_used"] == 0 and after["chained_steps"] > before["chained_steps"]
    assert after["draft_sessions"] == before["draft_sessions"] and after["draft_errors"] == before["draft_errors"]


@pytest.mark.parametrize("kwargs, field", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"prompt": [5, 97]}, "prompt_token_ids"),
    ({"prompt": [5], "temperature": -1.0}, "temperature"),
    ({"prompt": [5], "temperature": 1e-37}, "temperature"),  # would scale logits to inf: NaN probabilities
    ({"prompt": [5], "top_p": 1.5}, "top_p"),
    ({"prompt": [5], "depth": 9}, "speculation.depth"),
    ({"prompt": [5], "max_nodes": 500}, "speculation.max_nodes"),
])
def test_bad_requests_are_invalid_argument_with_field_details(stack, kwargs, field):
    prompt = kwargs.pop("prompt")
    with pytest.raises(ClientError) as err:
        stack.client.complete(prompt, max_tokens=4, **kwargs)
    assert err.value.code == "INVALID_ARGUMENT"
    assert [f for f, _ in err.value.field_violations] == [field]
    assert stack.client.complete([5, 6], max_tokens=2).token_ids  # still serving


def test_over_capacity_is_resource_exhausted(stack):
    with pytest.raises(ClientError) as err:
        stack.client.complete(list(range(1, 90)), max_tokens=3000)  # 3089 tokens of KV, the cache holds 2048
    assert err.value.code == "RESOURCE_EXHAUSTED" and "KV blocks" in err.value.message
    assert stack.client.complete([5, 6], max_tokens=2).token_ids


def test_killing_the_draft_keeps_outputs_exact_and_restart_resumes(dirs, tmp_path):
    root, target, draft = dirs
    s = Stack(tmp_path, target, draft, verify_args=["--tree-nodes", "12", "--tree-depth", "4", "--tree-top-k", "3"])
    try:
        lengths = [60, 45, 70, 50]
        want = expected(target, PROMPTS[:4], lengths)
        got, first_tokens = [None] * 4, threading.Barrier(5)

        def run(i):
            stream = s.client.generate(PROMPTS[i], max_tokens=lengths[i], ignore_eos=True)
            tokens = list(next(stream).token_ids)
            first_tokens.wait(60)
            for ev in stream:
                tokens += ev.token_ids
            got[i] = tokens

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        first_tokens.wait(60)
        s.draft.kill()  # mid-generation
        for t in threads:
            t.join(180)
        assert got == want
        assert s.client.health("eagle3.speculation") == "NOT_SERVING"
        assert not s.client.metrics()["draft_connected"]
        plain = s.client.complete(PROMPTS[0], max_tokens=6, ignore_eos=True)
        assert not plain.speculation["speculated"]
        s.start_draft()
        again = s.client.complete(PROMPTS[0], max_tokens=6, ignore_eos=True)
        assert again.speculation["speculated"] and again.token_ids == plain.token_ids
        metrics = s.client.metrics()
        assert metrics["draft_sessions"] == 2 and metrics["draft_errors"] == 1  # the session lost mid-traffic
        s.draft.kill()  # while idle: no step was waiting on it, and the loss still counts
        deadline = time.monotonic() + 30
        while s.client.health("eagle3.speculation") == "SERVING" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert s.client.metrics()["draft_errors"] == 2
    finally:
        s.close()


@pytest.mark.parametrize("mode", ["parent_after_child", "too_many_nodes", "token_out_of_vocab"])
def test_malformed_trees_fall_back_to_plain_decoding(dirs, tmp_path, mode):
    root, target, draft = dirs
    s = Stack(tmp_path, target, draft, verify_args=["--tree-nodes", "12", "--tree-depth", "4", "--tree-top-k", "3"],
              start_draft=False)
    try:
        s.start_draft([sys.executable, str(Path(__file__).parent / "faulty_draft.py"), mode])
        c = s.client.complete(PROMPTS[1], max_tokens=10, ignore_eos=True)
        assert c.token_ids == expected(target, [PROMPTS[1]], [10])[0]
        assert not c.speculation["speculated"]  # every tree was refused
        assert s.client.metrics()["draft_errors"] == 8  # every proposal: tokens 2..9 (the 10th needs no tree)
        time.sleep(0.5)
        assert "REJECTED" in s.draft.log()  # the draft was told why
    finally:
        s.close()


def test_broken_chained_trees_are_replaced_on_the_device_and_the_output_stays_exact(dirs, tmp_path):
    """A draft whose chained steps' trees break every invariant (a token outside the vocabulary, a
    parent after its child): each is checked where it lands, replaced by a well-formed stand-in
    before anything reads it, counted and reported to the draft; the output is target-only's."""
    root, target, draft = dirs
    s = Stack(tmp_path, target, draft, verify_args=["--tree-nodes", "12", "--tree-depth", "4", "--tree-top-k", "3",
                                                    "--chain-min-seqs", "1"], start_draft=False)
    try:
        s.start_draft([sys.executable, str(Path(__file__).parent / "faulty_draft.py"), "chained_garbage"])
        first = []
        for prompt in PROMPTS[:2]:
            c = s.client.complete(prompt, max_tokens=24, ignore_eos=True)
            assert c.token_ids == expected(target, [prompt], [24])[0]
            first.append(s.client.metrics())
        # Every chained step's trees refused: all of the first request's once the second starts (the
        # trees of a request's last chained step are read by the engine's next step).
        m = first[1]
        assert 0 < first[0]["chained_steps"] <= m["draft_errors"] <= m["chained_steps"]
        time.sleep(0.5)
        assert "REJECTED" in s.draft.log() and "breaks the tree invariants" in s.draft.log()
    finally:
        s.close()


def test_per_request_speculation_settings(stack, dirs):
    want = expected(dirs[1], [PROMPTS[2]], [12])[0]
    before = stack.client.metrics()["decode_steps_ahead"]
    off = stack.client.complete(PROMPTS[2], max_tokens=12, ignore_eos=True, speculate=False)
    # Alone on the server, a request without speculation decodes as target-only decoding does, each
    # step launched before the last one's token reached the host (a draft attached, no policy).
    assert stack.client.metrics()["decode_steps_ahead"] - before >= 9
    chain = stack.client.complete(PROMPTS[2], max_tokens=12, ignore_eos=True, tree="chain", depth=2)
    assert off.token_ids == chain.token_ids == want
    assert not off.speculation["speculated"]
    s = chain.speculation
    assert s["speculated"] and s["draft_tokens"] <= 2 * s["steps"]  # chains of at most 2 nodes


@pytest.mark.parametrize("kind", [99, -1])
def test_an_unknown_tree_kind_is_invalid_argument(stack, kind):
    """Enum values the server does not know are refused, not replaced by the server's tree."""
    import grpc

    from protos.eagle3.v1 import generation_pb2, generation_pb2_grpc

    request = generation_pb2.GenerateRequest(max_tokens=2)
    request.token_ids.ids.extend([5, 6])
    request.speculation.tree = kind
    with grpc.insecure_channel(stack.public) as channel:
        with pytest.raises(grpc.RpcError) as err:
            list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "speculation.tree" in err.value.details()


def test_an_error_quoting_a_huge_input_is_cut_not_replaced(stack):
    """A 200,000-character role: the real error (INVALID_ARGUMENT naming the field), cut short."""
    with pytest.raises(ClientError) as err:
        stack.client.complete([{"role": "r" * 200_000, "content": "hi"}], max_tokens=2)
    assert err.value.code == "INVALID_ARGUMENT"
    assert [f for f, _ in err.value.field_violations] == ["messages[0].role"]
    assert len(err.value.message) < 1200 and "more characters" in err.value.message


@pytest.mark.parametrize("raw", [
    b"\xff\xff\xff\xff",  # not a protobuf message
    bytes([(1 << 3) | 2, 2]) + b"\xff\xfe",  # GenerateRequest.text = invalid UTF-8
])
def test_a_malformed_request_is_invalid_argument(stack, raw):
    import grpc

    with grpc.insecure_channel(stack.public) as channel:
        generate = channel.unary_stream("/eagle3.v1.Generation/Generate")  # raw bytes, no serializer
        with pytest.raises(grpc.RpcError) as err:
            list(generate(raw, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert "not a valid GenerateRequest" in err.value.details()
    assert stack.client.complete([5, 6], max_tokens=2).token_ids  # still serving


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_answers_under_both_names(stack, version):
    """grpcurl asks grpc.reflection.v1 first; older clients v1alpha. Both list the services."""
    import grpc
    from grpc_reflection.v1alpha import reflection_pb2 as pb

    with grpc.insecure_channel(stack.public) as channel:
        info = channel.stream_stream(f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                                     request_serializer=pb.ServerReflectionRequest.SerializeToString,
                                     response_deserializer=pb.ServerReflectionResponse.FromString)
        [answer] = list(info(iter([pb.ServerReflectionRequest(list_services="")]), timeout=30))
    names = {s.name for s in answer.list_services_response.service}
    assert {"eagle3.v1.Generation", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection"} <= names
