"""The internal draft link against a hostile or broken peer (either side): one draft at a time,
no buffering of what nobody asked for, a target that no shared-memory write can change, a
read-only embedding on the draft side, and handshake sizes checked before anything is allocated."""

import json
import queue
import subprocess
import sys
import time

import grpc
import pytest
import torch

from common.errors import CapacityError, LinkProtocolError
from common.sampling_params import SamplingParams
from draft_service.drafter import EagleDrafter
from draft_service.eagle_config import DraftConfig
from draft_service.handshake_checks import LIMITS, checked_handshake
from draft_service.spec_config import SpecConfig
from link.convert import descriptor_to_proto
from link.shared_buffers import BufferExporter, BufferImporter, host_identity
from protos.eagle3.v1 import draft_link_pb2 as pb
from protos.eagle3.v1 import draft_link_pb2_grpc as pb_grpc
from services import ROOT, Stack
from tiny_eagle import make_target_and_head
from tiny_models import target_for, tiny_config
from verify_service.engine import Engine

VERIFY_ARGS = ["--tree-nodes", "12", "--tree-depth", "4", "--tree-top-k", "3", "--max-model-len", "512",
               "--num-kv-blocks", "64"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_target_and_head(tmp_path_factory.mktemp("link"))


def expected(model_dir, prompt, n):
    return Engine(target_for(model_dir)).generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))[0].token_ids


def generated(stack, prompt, n):
    return [t for ev in stack.client.generate(prompt, max_tokens=n, ignore_eos=True) for t in ev.token_ids]


# The device of a service that hand-written drafts dial: the CPU whatever EAGLE3_TEST_DEVICE says (their
# handshake says "cpu" and they map host memory; a service on the GPU refuses such a draft).
HAND_DRAFTS = "cpu"


def handshake_request(model_dir) -> pb.HandshakeRequest:
    cfg = json.loads((model_dir / "config.json").read_text())
    return pb.HandshakeRequest(
        expected_target=pb.ModelIdentity(vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"]),
        location=pb.PeerLocation(host_id=host_identity(), device_type="cpu"), draft_name="rogue")


def test_a_second_draft_is_refused_while_one_is_connected(dirs, tmp_path):
    model_dir, draft_dir = dirs
    s = Stack(tmp_path, model_dir, draft_dir, verify_args=VERIFY_ARGS, device=HAND_DRAFTS)
    try:
        with grpc.insecure_channel(s.internal) as channel:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.DraftLinkStub(channel).Handshake(handshake_request(model_dir), timeout=30)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "one draft at a time" in err.value.details()
        assert s.client.health("eagle3.speculation") == "SERVING"  # the real draft kept the link
        assert generated(s, [5, 6, 7], 20) == expected(model_dir, [5, 6, 7], 20)
    finally:
        s.close()


def test_the_verify_side_bounds_the_handshake_request(dirs, tmp_path):
    model_dir, draft_dir = dirs
    s = Stack(tmp_path, model_dir, draft_dir, verify_args=VERIFY_ARGS, start_draft=False, device=HAND_DRAFTS)
    try:
        request = handshake_request(model_dir)
        request.draft_name = "x" * 100_000
        with grpc.insecure_channel(s.internal) as channel:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.DraftLinkStub(channel).Handshake(request, timeout=30)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "draft_name" in err.value.details()
    finally:
        s.close()


def test_a_flood_of_results_ends_the_session_and_nothing_is_buffered(dirs, tmp_path):
    model_dir, draft_dir = dirs
    s = Stack(tmp_path, model_dir, draft_dir, verify_args=VERIFY_ARGS, start_draft=False, device=HAND_DRAFTS)
    try:
        with grpc.insecure_channel(s.internal) as channel:
            stub = pb_grpc.DraftLinkStub(channel)
            hello = stub.Handshake(handshake_request(model_dir), timeout=30)
            outgoing = queue.Queue()
            outgoing.put(pb.DraftMessage(open=pb.SessionOpen(session_id=hello.session_id, generation=hello.generation)))
            flood = pb.DraftMessage(result=pb.StepResult(step_id=12345, trees=[pb.TreeRef(seq_id=1, tree_slot=0,
                                                                                         num_nodes=3)] * 500))
            for _ in range(200):  # results nobody asked for
                outgoing.put(flood)
            responses = stub.Session(iter(outgoing.get, None))
            deadline = time.monotonic() + 60
            while s.client.health("eagle3.speculation") == "SERVING" or "nobody asked for" not in s.verify.log():
                assert time.monotonic() < deadline, s.verify.log()[-2000:]
                time.sleep(0.2)
            outgoing.put(None)
            responses.cancel()
        assert generated(s, [5, 6, 7], 20) == expected(model_dir, [5, 6, 7], 20)
        s.start_draft()  # the real draft connects once the rogue is gone
        assert generated(s, [9, 8, 7], 20) == expected(model_dir, [9, 8, 7], 20)
    finally:
        s.close()


def test_the_target_keeps_its_own_embedding(dirs):
    """Zeroing the shared table (what a peer could do) leaves the target's logits unchanged."""
    from verify_service.server import _export_buffers
    from verify_service.server_config import VerifyServerConfig
    from verify_service.config import EngineConfig
    from common.tree_settings import TreeSettings

    model_dir, _ = dirs
    target = target_for(model_dir)
    cfg = VerifyServerConfig(EngineConfig(str(model_dir), device="cpu", max_num_seqs=4), TreeSettings("chain", depth=3))
    before = Engine(target).generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    exporter, buffers = _export_buffers(target, cfg, target.model_config.default_capture_layers())
    try:
        assert torch.equal(buffers["embedding"], target.model.model.embed_tokens.weight)
        buffers["embedding"].zero_()
        after = Engine(target).generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
        assert after == before
    finally:
        exporter.close()


def test_a_read_only_mapping_cannot_be_written(tmp_path):
    """The draft maps the embedding read-only: a write through it kills the writer, not the data."""
    with BufferExporter(torch.device("cpu")) as exporter:
        shared = exporter.share("embedding", torch.arange(12, dtype=torch.float32).view(3, 4))
        desc = exporter.descriptors()[0]
        with BufferImporter(torch.device("cpu")) as importer:
            view = importer.open(desc, read_only=True)
            assert torch.equal(view, shared)  # reads work
            del view
        script = (f"import sys, torch; sys.path.insert(0, {str(ROOT)!r})\n"
                  "from link.shared_buffers import BufferImporter, BufferDescriptor\n"
                  f"d = BufferDescriptor(**{desc.__dict__!r})\n"
                  "t = BufferImporter(torch.device('cpu')).open(d, read_only=True)\n"
                  "t[0, 0] = 99.0\n"
                  "print('WROTE')\n")
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert run.returncode != 0 and "WROTE" not in run.stdout
        assert torch.equal(shared, torch.arange(12, dtype=torch.float32).view(3, 4))


def fake_hello(draft: DraftConfig, target_cfg: dict, **sizes) -> pb.HandshakeResponse:
    s = {"max_trees": 4, "max_tree_nodes": 8, "max_feature_rows": 64, "max_model_len": 256, **sizes}
    hidden = draft.target_hidden_size
    shapes = {"features": ((s["max_feature_rows"], 3 * hidden), "float32"),
              "embedding": ((draft.vocab_size, hidden), "float32"),
              "tree_tokens": ((s["max_trees"], s["max_tree_nodes"]), "int64"),
              "tree_parents": ((s["max_trees"], s["max_tree_nodes"]), "int64"),
              "tree_log_probs": ((s["max_trees"], s["max_tree_nodes"]), "float32"),
              "chain_feeds": ((s["max_trees"], 9), "int64"),
              "chain_trees": ((4, s["max_trees"], s["max_tree_nodes"]), "int64")}
    from link.shared_buffers import BufferDescriptor
    descs = [BufferDescriptor(name, "shm", shape, dtype, 1, shm_name=f"x-{name}", host_id="h")
             for name, (shape, dtype) in shapes.items()]
    return pb.HandshakeResponse(session_id=1, generation=1, buffers=[descriptor_to_proto(d) for d in descs],
                                target_config_json=json.dumps(target_cfg), **s)


@pytest.mark.parametrize("change, message", [
    ({"max_trees": 2**32 - 1}, "max_trees"), ({"max_model_len": 2**32 - 1}, "max_model_len"),
    ({"max_tree_nodes": 0}, "max_tree_nodes"), ({"drop": "tree_parents"}, "missing: tree_parents"),
    ({"duplicate": "features"}, "repeated buffer"), ({"reshape": "embedding"}, "buffer 'embedding'"),
    ({"dtype": "tree_tokens"}, "buffer 'tree_tokens'"), ({"config": "{not json"}, "does not parse"),
    ({"device_memory": "tree_parents"}, "'tree_parents' is cuda_ipc memory, expected shared host memory"),
    ({"drop": "chain_feeds"}, "missing: chain_feeds"), ({"reshape": "chain_trees"}, "buffer 'chain_trees'"),
    ({"reshape": "chain_feeds"}, "buffer 'chain_feeds'"), ({"widen": "chain_feeds"}, "unexpected or repeated buffer"),
])
def test_the_draft_checks_the_handshake_before_allocating(dirs, change, message):
    _, draft_dir = dirs
    draft = DraftConfig.from_dir(draft_dir)
    target_cfg = tiny_config("llama3")
    sizes = {k: v for k, v in change.items() if k in LIMITS}
    hello = fake_hello(draft, target_cfg, **sizes)
    bufs = list(hello.buffers)
    if "drop" in change:
        bufs = [b for b in bufs if b.name != change["drop"]]
    if "duplicate" in change:
        bufs += [b for b in bufs if b.name == change["duplicate"]]
    if "reshape" in change:
        next(b for b in bufs if b.name == change["reshape"]).shape[0] += 1
    if "dtype" in change:
        next(b for b in bufs if b.name == change["dtype"]).dtype = "float64"
    if "widen" in change:  # wider than any tree's depth: refused before its shape is looked at
        next(b for b in bufs if b.name == change["widen"]).shape[1] = 2**20
    if "device_memory" in change:
        next(b for b in bufs if b.name == change["device_memory"]).backend = pb.BUFFER_BACKEND_CUDA_IPC
    del hello.buffers[:]
    hello.buffers.extend(bufs)
    if "config" in change:
        hello.target_config_json = change["config"]
    with pytest.raises(LinkProtocolError, match=message):
        checked_handshake(hello, draft)
    checked_handshake(fake_hello(draft, target_cfg), draft)  # the unchanged handshake passes


def test_the_draft_refuses_a_cache_larger_than_memory(dirs):
    """Sizes within the limits can still ask for more memory than exists: refused with the numbers,
    before the allocation."""
    model_dir, draft_dir = dirs
    target = target_for(model_dir)
    spec = SpecConfig(str(draft_dir), tree="chain", depth=3)
    with pytest.raises(CapacityError, match="draft KV cache"):
        EagleDrafter.from_checkpoint(spec, target.model_config, target.model.model.embed_tokens.weight,
                                     LIMITS["max_trees"], LIMITS["max_model_len"])


@pytest.mark.parametrize("n", [0, 65537])
def test_a_chained_step_size_out_of_range_is_refused(dirs, n):
    from common.errors import InvalidRequestError
    from verify_service.config import EngineConfig
    from verify_service.server_config import VerifyServerConfig

    with pytest.raises(InvalidRequestError) as info:
        VerifyServerConfig(EngineConfig(str(dirs[0])), None, chain_min_seqs=n)
    assert info.value.field == "chain_min_seqs"
