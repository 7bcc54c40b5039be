"""The per-step link through real services: steps on the unix step socket (a hand-written draft
on it: trees that speculate, then garbage, oversized frames, floods, a wrong token, a step on
the wrong channel, a replaced handshake), the same greedy output from both transports with the
real draft, and the Session stream when the internal link is TCP."""

import queue
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from link import step_socket
from link.convert import descriptor_from_proto
from link.protocol import StepReply, TreeRef
from link.shared_buffers import BufferImporter
from link.step_frames import FrameLimits, StepFrames, hello_frame
from protos.eagle3.v1 import draft_link_pb2 as pb
from protos.eagle3.v1 import draft_link_pb2_grpc as pb_grpc
from services import Stack
from test_draft_link_security import HAND_DRAFTS, VERIFY_ARGS, expected, generated, handshake_request
from tiny_eagle import make_target_and_head

pytestmark = pytest.mark.skipif(not step_socket.supported(), reason="SOCK_SEQPACKET and SO_PEERCRED: Linux")
PROMPT, N = [5, 6, 7], 12


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_target_and_head(tmp_path_factory.mktemp("step"))


@pytest.fixture(scope="module")
def stack(dirs, tmp_path_factory):
    """A verify service with no draft: the tests below are its drafts, one at a time (on the CPU:
    ``HAND_DRAFTS``)."""
    s = Stack(tmp_path_factory.mktemp("stack"), dirs[0], dirs[1], start_draft=False,
              verify_args=[*VERIFY_ARGS, "--draft-timeout-s", "3"], device=HAND_DRAFTS)
    yield s
    s.close()


class HandDraft:
    """A draft written by hand: handshake, the step socket's hello, the Session stream, then steps
    answered by the test."""

    def __init__(self, stack: Stack, model_dir: Path, token: bytes | None = None, dial: bool = True):
        wait_for(lambda: stack.client.health("eagle3.speculation") == "NOT_SERVING")  # the last one has left
        self.stack, self.channel = stack, grpc.insecure_channel(stack.internal)
        stub = pb_grpc.DraftLinkStub(self.channel)
        request = handshake_request(model_dir)
        request.step_transport = pb.STEP_TRANSPORT_UNIX_SOCKET
        self.hello = stub.Handshake(request, timeout=30)
        assert self.hello.HasField("step_socket") and len(self.hello.step_socket.token) == 32
        self.path = Path(stack.internal.removeprefix("unix:")).parent / self.hello.step_socket.name
        self.frames = StepFrames(FrameLimits(self.hello.max_trees, self.hello.max_feature_rows))
        self.sock = None
        if dial:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self.sock.connect(str(self.path))
            self.sock.send(hello_frame(token or self.hello.step_socket.token))
            self.sock.settimeout(60)
        self.outgoing: queue.Queue = queue.Queue()
        self.outgoing.put(pb.DraftMessage(open=pb.SessionOpen(
            session_id=self.hello.session_id, generation=self.hello.generation,
            step_transport=pb.STEP_TRANSPORT_UNIX_SOCKET)))
        self.responses = stub.Session(iter(self.outgoing.get, None))

    def step(self):
        """The next step the verify side sends (None: it closed the socket)."""
        try:
            frame = self.sock.recv(self.frames.limits.call_bytes + 1)
        except ConnectionResetError:  # closed with frames of ours unread
            return None
        return self.frames.decode_call(memoryview(frame)) if frame else None

    def answer(self, call, trees=()) -> None:
        self.sock.send(self.frames.encode_reply(StepReply(call.step_id, list(trees), 1000)))

    def status(self) -> str:
        """How the Session stream ended."""
        try:
            list(self.responses)
        except grpc.RpcError as err:
            return err.code().name
        return "OK"

    def close(self) -> None:
        self.outgoing.put(None)
        if self.sock is not None:
            self.sock.close()
        self.responses.cancel()
        self.channel.close()


def wait_for(condition, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def in_thread(fn) -> dict:
    out = {}
    thread = threading.Thread(target=lambda: out.update(value=fn()), daemon=True)
    thread.start()
    out["thread"] = thread
    return out


def test_trees_from_the_step_socket_speculate_and_the_output_stays_exact(stack, dirs):
    model_dir, _ = dirs
    want = expected(model_dir, PROMPT, N)
    full = PROMPT + want  # the greedy sequence: the oracle tree is its continuation
    draft = HandDraft(stack, model_dir)
    try:
        wait_for(lambda: stack.client.health("eagle3.speculation") == "SERVING")
        errors = stack.client.metrics()["draft_errors"]
        client = in_thread(lambda: stack.client.complete(PROMPT, max_tokens=N, ignore_eos=True))
        with BufferImporter("cpu") as importer:
            bufs = {b.name: importer.open(descriptor_from_proto(b)).numpy() for b in draft.hello.buffers}
            calls, root = [], 0
            draft.sock.settimeout(0.2)
            while client["thread"].is_alive():
                try:
                    call = draft.step()
                except TimeoutError:  # between steps: until the client has its answer
                    continue
                assert call is not None and len(calls) < 50
                calls.append(call)
                for f in call.feeds:
                    root = f.start + len(f.next_tokens)  # the newest token's position
                trees = []
                for slot, p in enumerate(call.proposals):
                    chain = full[root + 1:root + 1 + min(3, p.max_depth)]
                    bufs["tree_tokens"][slot, :len(chain)] = chain
                    bufs["tree_parents"][slot, :len(chain)] = np.arange(len(chain)) - 1
                    bufs["tree_log_probs"][slot, :len(chain)] = 0
                    trees.append(TreeRef(p.seq_id, slot, len(chain)))
                draft.answer(call, trees)
            del bufs
        done = client["value"]
        assert done.token_ids == want and done.speculation["speculated"]
        assert done.speculation["accepted_tokens"] >= N // 2  # the oracle's chains were taken
        first = calls[0].feeds[0]
        assert (first.start, first.buffer_row, first.next_tokens.tolist()) == (0, 0, PROMPT[1:] + want[:1])
        assert stack.client.metrics()["draft_errors"] == errors
    finally:
        draft.close()
    wait_for(lambda: stack.client.health("eagle3.speculation") == "NOT_SERVING")
    assert not draft.path.exists()


@pytest.mark.parametrize("fault, reason", [
    ("garbage", "not a step result"),
    ("oversized", "over the"),
    ("flood", "nobody asked for"),
    ("wrong_step", "answered another step"),
    ("result_on_the_stream", "a step on the stream"),
    ("silence", "no answer in time"),
])
def test_a_misbehaving_step_socket_loses_its_session(stack, dirs, fault, reason):
    model_dir, _ = dirs
    draft = HandDraft(stack, model_dir)
    try:
        wait_for(lambda: stack.client.health("eagle3.speculation") == "SERVING")
        errors = stack.client.metrics()["draft_errors"]
        if fault == "flood":  # answers before anything was asked
            for _ in range(3):
                draft.sock.send(draft.frames.encode_reply(StepReply(1, [], 0)))
        client = in_thread(lambda: generated(stack, PROMPT, N))
        call = draft.step()
        if fault == "garbage":
            draft.sock.send(b"\x00" * 40)
        elif fault == "oversized":
            draft.sock.send(b"E3SR" + b"\x00" * (draft.frames.limits.reply_bytes + 8))
        elif fault == "wrong_step":
            draft.answer(type(call)(call.step_id + 1, [], [], [], []))
        elif fault == "result_on_the_stream":
            draft.outgoing.put(pb.DraftMessage(result=pb.StepResult(step_id=call.step_id)))
        client["thread"].join(60)
        assert client["value"] == expected(model_dir, PROMPT, N)  # decoded without the draft, exactly
        wait_for(lambda: stack.client.health("eagle3.speculation") == "NOT_SERVING")
        assert stack.client.metrics()["draft_errors"] == errors + 1
        assert reason in stack.verify.log()
        while draft.step() is not None:  # the verify side tore the socket down (after steps in flight)
            pass
        assert draft.status() == "OK"  # and ended the stream
    finally:
        draft.close()


def test_a_wrong_token_is_refused(stack, dirs):
    model_dir, _ = dirs
    errors = stack.client.metrics()["draft_errors"]
    draft = HandDraft(stack, model_dir, token=b"\x01" * 32)
    try:
        assert draft.status() == "FAILED_PRECONDITION"
        assert draft.sock.recv(64) == b""  # closed from the verify side
        assert not draft.path.exists()
        assert stack.client.health("eagle3.speculation") == "NOT_SERVING"
        assert stack.client.metrics()["draft_errors"] == errors  # never live: no session lost
    finally:
        draft.close()
    assert generated(stack, PROMPT, N) == expected(model_dir, PROMPT, N)


def test_a_newer_handshake_replaces_the_offer_and_a_closed_session_tears_its_socket_down(stack, dirs):
    model_dir, _ = dirs
    first = HandDraft(stack, model_dir, dial=False)  # a handshake, then a stream opened without connecting ...
    assert first.status() == "FAILED_PRECONDITION"  # ... is refused once no connection came in time
    assert not first.path.exists()
    first.close()
    wait_for(lambda: stack.client.health("eagle3.speculation") == "NOT_SERVING")
    channel = grpc.insecure_channel(stack.internal)
    stub = pb_grpc.DraftLinkStub(channel)
    request = handshake_request(model_dir)
    request.step_transport = pb.STEP_TRANSPORT_UNIX_SOCKET
    old = stub.Handshake(request, timeout=30)
    old_path = Path(stack.internal.removeprefix("unix:")).parent / old.step_socket.name
    assert old_path.exists()
    draft = HandDraft(stack, model_dir)  # a newer handshake: the old offer is withdrawn
    try:
        assert not old_path.exists() and draft.hello.step_socket.token != old.step_socket.token
        wait_for(lambda: stack.client.health("eagle3.speculation") == "SERVING")
        errors = stack.client.metrics()["draft_errors"]
        draft.outgoing.put(None)  # the draft closes its link: a clean end
        assert draft.step() is None and draft.status() == "OK"
        wait_for(lambda: stack.client.health("eagle3.speculation") == "NOT_SERVING")
        assert stack.client.metrics()["draft_errors"] == errors
    finally:
        draft.close()
    stream_only = handshake_request(model_dir)  # a draft that does not ask for the socket is offered none
    assert not stub.Handshake(stream_only, timeout=30).HasField("step_socket")
    channel.close()


def test_both_transports_give_the_same_greedy_output(dirs, tmp_path):
    """The stream, the step socket with chained steps (the default; here for steps of one sequence too)
    and without: the same output."""
    model_dir, draft_dir = dirs
    prompts = [[5, 6, 7], list(range(10, 40)), [88] * 9]
    want = [expected(model_dir, p, 24) for p in prompts]
    variants = {"stream": (["--step-transport", "stream"], "stream"),
                "socket": (["--step-transport", "socket"], "step socket, chained"),
                "unchained": (["--step-transport", "socket", "--chained-steps", "off"], "step socket")}
    s = Stack(tmp_path, model_dir, draft_dir, verify_args=[*VERIFY_ARGS, "--chain-min-seqs", "1"], start_draft=False)
    try:
        outputs, chained = {}, {}
        for name, (args, says) in variants.items():
            s.draft_args = ["--log-level", "info", *args]
            before = s.client.metrics()["chained_steps"]
            s.start_draft()
            completions = [s.client.complete(p, max_tokens=24, ignore_eos=True) for p in prompts]
            assert all(c.speculation["speculated"] for c in completions)
            outputs[name] = [c.token_ids for c in completions]
            chained[name] = s.client.metrics()["chained_steps"] - before
            assert f"steps on the {says})" in s.draft.log()
            s.draft.stop()
            wait_for(lambda: s.client.health("eagle3.speculation") == "NOT_SERVING")
        assert outputs["stream"] == outputs["socket"] == outputs["unchained"] == want
        assert chained["socket"] > 10 and chained["stream"] == chained["unchained"] == 0
        metrics = s.client.metrics()
        assert metrics["draft_sessions"] == 3 and metrics["draft_errors"] == 0
        assert 0 < metrics["draft_compute_p50_us"] <= metrics["draft_compute_p99_us"]
        assert list((tmp_path / "run").glob("step-*")) == []  # no step socket left behind
    finally:
        s.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC events need a GPU")
def test_chained_steps_through_cuda_ipc_give_the_target_only_output(dirs, tmp_path):
    """Both services on the GPU (float32): chained steps pass their rows and trees through CUDA IPC
    buffers and events; greedy output is the same server's without speculation, at one request and
    at four."""
    model_dir, draft_dir = dirs
    prompts = [[5, 6, 7], list(range(10, 40)), [88] * 9, [3, 1, 4, 1, 5]]
    s = Stack(tmp_path, model_dir, draft_dir, verify_args=[*VERIFY_ARGS, "--chain-min-seqs", "1"],
              draft_args=["--log-level", "info"], device="cuda", dtype="float32")
    try:
        assert "steps on the step socket, chained)" in s.draft.log()
        want = [s.client.complete(p, max_tokens=24, ignore_eos=True, speculate=False).token_ids for p in prompts]
        got = [s.client.complete(p, max_tokens=24, ignore_eos=True).token_ids for p in prompts]
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda p: s.client.complete(p, max_tokens=24, ignore_eos=True).token_ids, prompts))
        assert got == together == want
        metrics = s.client.metrics()
        assert metrics["chained_steps"] > 20 and metrics["draft_errors"] == 0
        # Batches of one to four sequences compiled nothing on the verify side after its warm-up (each
        # compilation stalls a step; the tree-layout kernels once did at every new batch size).
        late = [line for line in s.verify.log().splitlines() if "after the verify service's warm-up" in line]
        assert late == []
    finally:
        s.close()


def test_a_tcp_link_steps_on_the_session_stream(dirs, tmp_path):
    model_dir, draft_dir = dirs
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    s = Stack(tmp_path, model_dir, draft_dir, verify_args=VERIFY_ARGS, start_draft=False,
              internal=f"127.0.0.1:{port}", draft_args=["--log-level", "info"], device=HAND_DRAFTS)
    try:
        request = handshake_request(model_dir)
        request.step_transport = pb.STEP_TRANSPORT_UNIX_SOCKET
        with grpc.insecure_channel(s.internal) as channel:
            assert not pb_grpc.DraftLinkStub(channel).Handshake(request, timeout=30).HasField("step_socket")
        s.start_draft()
        c = s.client.complete(PROMPT, max_tokens=N, ignore_eos=True)
        assert c.token_ids == expected(model_dir, PROMPT, N) and c.speculation["speculated"]
        assert "steps on the stream)" in s.draft.log()
    finally:
        s.close()
