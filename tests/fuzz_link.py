"""Fuzzing the internal draft link: a fake draft dials the verify service's unix socket with random
handshakes and sessions, while a normal client generates through the public API.

Properties: every link call ends with OK or a typed status (never INTERNAL or UNKNOWN), the verify
service stays up, and greedy output stays exactly the target's whatever the draft answers
(right, wrong or malformed trees, wrong step ids, floods, stalls, a closed or cancelled stream),
on the Session stream and on the unix step socket (raw frames: garbage, cut, oversized, floods,
results for other steps or with any tree references; with chained steps taken or not, and their
trees in the shared buffer right or random bytes).
"""

from __future__ import annotations

import queue
import socket
import struct
import threading
import time
from dataclasses import dataclass

import grpc
import numpy as np
from grpc_health.v1 import health_pb2
from hypothesis import strategies as st

from fuzz_requests import mutated, raw_message, texts, uints
from link.convert import descriptor_from_proto
from link.protocol import ChainCall, ChainReply, StepReply, TreeRef
from link.shared_buffers import BufferImporter, host_identity
from link.step_frames import CHAIN_REPLY, REPLY_HEADER, TREE, FrameLimits, StepFrames, hello_frame
from protos.eagle3.v1 import draft_link_pb2 as link_pb
from protos.eagle3.v1 import generation_pb2 as pb
from services import Stack
from tiny_models import BASE
from tiny_tokenizer import VOCAB_SIZE

HANDSHAKE, SESSION = "/eagle3.v1.DraftLink/Handshake", "/eagle3.v1.DraftLink/Session"
PROMPTS = ([5, 6, 7, 8], list(range(40, 60)), [88] * 9, [1, 2])
MAX_TOKENS = 8
TIMEOUT_S = 60.0
FIRST = ("open", "open", "open", "wrong_id", "stale_generation", "result", "empty", "end")
ACTIONS = ("answer", "answer", "answer", "answer", "wrong_step", "flood", "empty", "open", "close", "stall")
TREES = ("right", "right", "wrong", "garbage")


FRAMES = ("garbage", "cut", "oversized", "flood", "wrong_step", "any_trees", "too_many_trees", "empty", "right",
          "right", "random_trees")


def valid_handshake(transport: int = link_pb.STEP_TRANSPORT_UNSPECIFIED) -> link_pb.HandshakeRequest:
    """What the real draft service sends for the tiny target, on this host's CPU."""
    return link_pb.HandshakeRequest(
        expected_target=link_pb.ModelIdentity(vocab_size=VOCAB_SIZE, hidden_size=BASE["hidden_size"]),
        location=link_pb.PeerLocation(host_id=host_identity(), device_type="cpu"), draft_name="fuzz",
        step_transport=transport)


def socket_plans() -> st.SearchStrategy[tuple[int, tuple[tuple[str, int], ...], bool]]:
    """(prompt index, the draft's answers on the step socket: (one of FRAMES, a seed) per step,
    whether it takes chained steps)."""
    return st.tuples(st.integers(0, len(PROMPTS) - 1),
                     st.lists(st.tuples(st.sampled_from(FRAMES), st.integers(0, 2**32 - 1)), min_size=1,
                              max_size=6).map(tuple), st.booleans())


@st.composite
def handshakes(draw) -> bytes:
    """A HandshakeRequest with each part right or hostile (sizes, ids, devices, layers)."""
    req = valid_handshake()
    want, loc = req.expected_target, req.location
    if draw(st.booleans()):
        want.vocab_size, want.hidden_size = draw(st.sampled_from([VOCAB_SIZE, 0])), draw(uints(2**32 - 1))
    if draw(st.booleans()):
        want.capture_layers.extend(draw(st.one_of(st.lists(uints(2**32 - 1), max_size=6),
                                                  st.just([1] * 100_000))))
    want.name, want.fingerprint, want.dtype = draw(texts()), draw(texts()), draw(texts())
    if draw(st.booleans()):
        loc.host_id = draw(st.one_of(texts(), st.just("h" * 100_000)))
    if draw(st.booleans()):
        loc.device_type = draw(st.one_of(st.sampled_from(["cuda", "", "CPU"]), texts()))
    loc.gpu_uuid = draw(texts())
    req.limits.tree, req.limits.max_depth = draw(st.integers(-2**31, 2**31 - 1)), draw(uints(2**32 - 1))
    req.draft_name = draw(st.one_of(texts(), st.just("d" * 1_000_000)))
    return req.SerializeToString()


def corrupt_handshakes() -> st.SearchStrategy[bytes]:
    return st.one_of(raw_message(link_pb.HandshakeRequest.DESCRIPTOR),
                     mutated(st.just(valid_handshake().SerializeToString())), st.binary(max_size=64))


def corrupt_session_messages() -> st.SearchStrategy[list[bytes]]:
    """Session requests that are not DraftMessages (or are, with garbage inside), after a valid open."""
    return st.lists(st.one_of(raw_message(link_pb.DraftMessage.DESCRIPTOR), st.binary(max_size=32)),
                    min_size=1, max_size=3)


@dataclass(frozen=True)
class Answer:
    """How the fake draft answers one VerifyMessage."""

    kind: str  # one of ACTIONS
    trees: str  # one of TREES: the greedy continuation (oracle), wrong tokens, random garbage
    seed: int  # of the random tokens / parents / log-probs / slots
    nodes: int  # tree size asked for (0: as the proposal allows; may exceed the buffer)


@dataclass(frozen=True)
class SessionPlan:
    prompt: int  # index into PROMPTS
    first: str  # one of FIRST: the first DraftMessage
    answers: tuple[Answer, ...]  # then plain empty answers


def session_plans() -> st.SearchStrategy[SessionPlan]:
    answer = st.builds(Answer, st.sampled_from(ACTIONS), st.sampled_from(TREES), st.integers(0, 2**32 - 1),
                       st.one_of(st.just(0), st.integers(0, 16)))
    return st.builds(SessionPlan, st.integers(0, len(PROMPTS) - 1), st.sampled_from(FIRST),
                     st.lists(answer, max_size=8).map(tuple))


@dataclass
class LinkOutcome:
    statuses: list[str]  # the link calls' final statuses (CANCELLED by the fake itself left out)
    output: list[int] | None  # the client's tokens (None: its call failed)
    generate_status: str


class FakeDraft:
    """One fuzzed session at a time against ``stack``'s internal socket."""

    def __init__(self, stack: Stack):
        self.stack = stack
        self.channel = grpc.insecure_channel(stack.internal, options=[("grpc.max_receive_message_length", 64 << 20)])
        self.public = grpc.insecure_channel(stack.public)
        self.expected = [self.generate(p, speculate=False)[0] for p in PROMPTS]

    def close(self) -> None:
        self.channel.close()
        self.public.close()

    def call(self, method: str, requests: list[bytes]) -> str:
        """A raw handshake (one request) or session (the requests, then the end): the status."""
        try:
            if method == HANDSHAKE:
                self.channel.unary_unary(HANDSHAKE)(requests[0], timeout=TIMEOUT_S)
            else:
                list(self.channel.stream_stream(SESSION)(iter(requests), timeout=TIMEOUT_S))
        except grpc.RpcError as err:
            return err.code().name
        return "OK"

    def hello(self, transport: int = link_pb.STEP_TRANSPORT_UNSPECIFIED
              ) -> tuple[link_pb.HandshakeResponse | None, str]:
        """A valid handshake, once the previous session is gone: (its answer, its status)."""
        self.wait_disconnected()
        stub = self.channel.unary_unary(HANDSHAKE, response_deserializer=link_pb.HandshakeResponse.FromString)
        try:
            return stub(valid_handshake(transport).SerializeToString(), timeout=TIMEOUT_S), "OK"
        except grpc.RpcError as err:
            return None, err.code().name

    def open_after_handshake(self, requests: list[bytes]) -> list[str]:
        """A valid handshake and open, then ``requests``: both calls' statuses."""
        hello, status = self.hello()
        if hello is None:
            return [status]
        opening = link_pb.DraftMessage(open=link_pb.SessionOpen(session_id=hello.session_id,
                                                                generation=hello.generation))
        return [status, self.call(SESSION, [opening.SerializeToString(), *requests])]

    def generate(self, prompt: list[int], speculate: bool = True) -> tuple[list[int] | None, str]:
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_tokens=MAX_TOKENS, ignore_eos=True)
        if not speculate:
            request.speculation.enabled = False
        stub = self.public.unary_stream("/eagle3.v1.Generation/Generate",
                                        request_serializer=pb.GenerateRequest.SerializeToString,
                                        response_deserializer=pb.GenerateResponse.FromString)
        try:
            return [t for e in stub(request, timeout=TIMEOUT_S) for t in e.delta.token_ids], "OK"
        except grpc.RpcError as err:
            return None, err.code().name

    def speculation_health(self) -> str:
        check = self.public.unary_unary("/grpc.health.v1.Health/Check",
                                        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                        response_deserializer=health_pb2.HealthCheckResponse.FromString)
        status = check(health_pb2.HealthCheckRequest(service="eagle3.speculation"), timeout=TIMEOUT_S).status
        return health_pb2.HealthCheckResponse.ServingStatus.Name(status)

    def wait_disconnected(self, timeout_s: float = 15.0) -> None:
        """Until the verify service has let the previous session go (one draft at a time)."""
        deadline = time.monotonic() + timeout_s
        while self.speculation_health() == "SERVING" and time.monotonic() < deadline:
            time.sleep(0.02)

    def run_session(self, plan: SessionPlan) -> LinkOutcome:
        """Handshake, the plan's session, and a greedy generation through it."""
        hello, status = self.hello()
        if hello is None:
            return LinkOutcome([status], *self.generate(PROMPTS[plan.prompt]))
        with BufferImporter("cpu") as importer:
            buffers = {b.name: importer.open(descriptor_from_proto(b)).numpy() for b in hello.buffers}
            return _Session(self, hello, buffers, plan).run()


    def run_socket_session(self, prompt: int, answers: tuple[tuple[str, int], ...],
                           chained: bool = False) -> LinkOutcome:
        """Handshake, the step socket, the stream, and a greedy generation while the draft answers
        its steps with ``answers`` (then with right ones: sound trees); ``chained``: it takes chained
        steps."""
        hello, status = self.hello(link_pb.STEP_TRANSPORT_UNIX_SOCKET)
        if hello is None or not hello.HasField("step_socket"):
            return LinkOutcome([status, "no step socket offered"], *self.generate(PROMPTS[prompt]))
        with BufferImporter("cpu") as importer:
            buffers = {b.name: importer.open(descriptor_from_proto(b)).numpy() for b in hello.buffers
                       if b.name.startswith(("tree_", "chain_"))}
            return _SocketSession(self, hello, answers, buffers, chained).run(prompt)


class _SocketSession:
    """The fake draft's side of one step-socket session: raw frames, as the plan says."""

    def __init__(self, fake: FakeDraft, hello: link_pb.HandshakeResponse, answers: tuple[tuple[str, int], ...],
                 buffers: dict, chained: bool):
        self.fake, self.hello, self.answers = fake, hello, iter(answers)
        self.buffers, self.chained = buffers, chained and hello.HasField("chained_steps")
        self.frames = StepFrames(FrameLimits(hello.max_trees, hello.max_feature_rows))
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.connect(str(fake.stack.tmp / "run" / hello.step_socket.name))
        self.sock.send(hello_frame(hello.step_socket.token))
        self.sock.settimeout(0.2)

    def run(self, prompt: int) -> LinkOutcome:
        requests: queue.Queue = queue.Queue()
        requests.put(link_pb.DraftMessage(open=link_pb.SessionOpen(
            session_id=self.hello.session_id, generation=self.hello.generation,
            step_transport=link_pb.STEP_TRANSPORT_UNIX_SOCKET, chained_steps=self.chained)).SerializeToString())
        responses = self.fake.channel.stream_stream(SESSION)(iter(requests.get, None), timeout=TIMEOUT_S)
        deadline = time.monotonic() + 5  # a session speculates only for requests started after it opened
        while self.fake.speculation_health() != "SERVING" and time.monotonic() < deadline:
            time.sleep(0.01)
        result = {}
        client = threading.Thread(target=lambda: result.update(output=self.fake.generate(PROMPTS[prompt])))
        client.start()
        try:
            while client.is_alive() and self._answer_one():
                pass
        finally:
            client.join(TIMEOUT_S)
            requests.put(None)  # the draft closes its link
            self.sock.close()
        try:
            list(responses)
            status = "OK"
        except grpc.RpcError as err:
            status = err.code().name
        return LinkOutcome([status], *result.get("output", (None, "no answer in time")))

    def _answer_one(self) -> bool:
        """Answer the next step (False: the verify side closed the socket)."""
        try:
            frame = self.sock.recv(self.frames.limits.call_bytes + 1)
        except TimeoutError:
            return True
        except ConnectionError:
            return False
        if not frame:
            return False
        call = self.frames.decode(memoryview(frame))
        kind, seed = next(self.answers, ("right", 0))
        try:
            for out in self._frames(kind, call, np.random.default_rng(seed)):
                self.sock.send(out)
        except ConnectionError:
            return False
        return True

    def _trees(self, call, kind: str, rng) -> bytes:
        """Trees written where ``call``'s answer says they are (sound ones, or random bytes for
        ``random_trees``), and that answer: the tree buffers' slots for a step, chain_trees for a
        chained step."""
        vocab = VOCAB_SIZE
        if isinstance(call, ChainCall):
            out, B = self.buffers["chain_trees"], len(call.seqs)
            n = min(2, call.settings.node_budget, out.shape[2])
            if kind == "random_trees":
                out[:, :B, :n] = rng.integers(-2**62, 2**62, (4, B, n))
            else:  # children of the root, distinct tokens
                out[:, :B, :n] = 0
                out[0, :B, :n], out[1, :B, :n], out[2, :B, :n] = rng.permutation(vocab)[:n], -1, 1
            return bytes(self.frames.encode_chain_reply(ChainReply(call.step_id, B, n, int(rng.integers(0, 2**63)))))
        refs = []
        for slot, p in enumerate(call.proposals):
            n = min(2, self.buffers["tree_tokens"].shape[1])
            self.buffers["tree_tokens"][slot, :n] = rng.integers(-5, vocab + 5, n) if kind == "random_trees" \
                else rng.permutation(vocab)[:n]
            self.buffers["tree_parents"][slot, :n] = -1
            self.buffers["tree_log_probs"][slot, :n] = 0
            refs.append(TreeRef(p.seq_id, slot, n))
        return bytes(self.frames.encode_reply(StepReply(call.step_id, refs, int(rng.integers(0, 2**63)))))

    def _frames(self, kind: str, call, rng) -> list[bytes]:
        right = self._trees(call, kind, rng)
        limits = self.frames.limits
        chained = isinstance(call, ChainCall)
        if kind == "garbage":
            return [rng.bytes(int(rng.integers(0, 200)))]
        if kind == "cut":
            return [right[:int(rng.integers(0, len(right)))]]
        if kind == "oversized":
            return [right + bytes(limits.reply_bytes)]
        if kind == "flood":
            return [right, right]
        if kind == "wrong_step":
            step = call.step_id + int(rng.integers(1, 9))
            return [bytes(self.frames.encode_chain_reply(ChainReply(step, len(call.seqs), 1, 0)) if chained
                          else self.frames.encode_reply(StepReply(step, [], 0)))]
        if kind in ("any_trees", "too_many_trees") and chained:  # any count and size of trees
            n = limits.max_seqs + 1 if kind == "too_many_trees" else int(rng.integers(0, 2**32))
            nodes, compute = int(rng.integers(0, 2**32)), int(rng.integers(0, 2**63))
            return [CHAIN_REPLY.pack(b"E3CR", call.step_id, n, nodes, compute)]
        if kind in ("any_trees", "too_many_trees"):  # references to any slot, sequence and size
            n = limits.max_seqs + 1 if kind == "too_many_trees" else int(rng.integers(0, limits.max_seqs + 1))
            refs = [struct.pack("<QII", int(rng.integers(0, 2**63)), int(rng.integers(0, 2**32)),
                                int(rng.integers(0, 2**32))) for _ in range(n)]
            if rng.random() < 0.5 and call.proposals:
                refs[:1] = [TREE.pack(call.proposals[0].seq_id, 0, int(rng.integers(0, 80)))] if refs else []
            return [REPLY_HEADER.pack(b"E3SR", n, call.step_id, int(rng.integers(0, 2**63)) * 2 + 1) + b"".join(refs)]
        if kind == "empty":
            return [b""]
        return [right]


class _Session:
    """The fake draft's side of one session: answers VerifyMessages as the plan says."""

    def __init__(self, fake: FakeDraft, hello: link_pb.HandshakeResponse, buffers: dict, plan: SessionPlan):
        self.fake, self.hello, self.buffers, self.plan = fake, hello, buffers, plan
        self.requests: queue.Queue = queue.Queue()
        self.full = list(PROMPTS[plan.prompt]) + fake.expected[plan.prompt]  # the greedy sequence
        self.root: dict[int, int] = {}  # seq_id -> position of its newest fed token
        self.cancelled = False

    def run(self) -> LinkOutcome:
        responses = self.fake.channel.stream_stream(SESSION)(iter(self.requests.get, None), timeout=TIMEOUT_S)
        self.requests.put(self._first())
        if self.plan.first == "end":
            self.requests.put(None)
        elif self.plan.first == "open":
            deadline = time.monotonic() + 5  # a session speculates only for requests started after it opened
            while self.fake.speculation_health() != "SERVING" and time.monotonic() < deadline:
                time.sleep(0.01)
        result = {}
        client = threading.Thread(target=self._generate, args=(responses, result))
        client.start()
        status = self._answer(responses)
        client.join(TIMEOUT_S)
        self.requests.put(None)
        statuses = [] if status == "CANCELLED" and self.cancelled else [status]
        return LinkOutcome(statuses, *result.get("output", (None, "no answer in time")))

    def _generate(self, responses, result: dict) -> None:
        result["output"] = self.fake.generate(PROMPTS[self.plan.prompt])
        self.cancelled = True
        responses.cancel()  # the fake draft leaves once the client has its answer

    def _first(self) -> bytes:
        h, first = self.hello, self.plan.first
        session_id = h.session_id + (1 if first == "wrong_id" else 0)
        generation = h.generation + (1 if first == "stale_generation" else 0)
        if first == "result":
            return link_pb.DraftMessage(result=link_pb.StepResult(step_id=1)).SerializeToString()
        if first == "empty":
            return b""
        return link_pb.DraftMessage(open=link_pb.SessionOpen(session_id=session_id,
                                                             generation=generation)).SerializeToString()

    def _answer(self, responses) -> str:
        answers = iter(self.plan.answers)
        try:
            for raw in responses:
                msg = link_pb.VerifyMessage.FromString(raw)
                for f in msg.feeds:
                    self.root[f.seq_id] = f.start_position + len(f.next_tokens)
                answer = next(answers, Answer("answer", "right", 0, 0))
                if answer.kind == "close":
                    self.requests.put(None)
                    break
                if answer.kind != "stall":
                    for out in self._reply(msg, answer):
                        self.requests.put(out.SerializeToString())
            for _ in responses:  # after a close: until the verify side ends the stream
                pass
        except grpc.RpcError as err:
            return err.code().name
        return "OK"

    def _reply(self, msg: link_pb.VerifyMessage, answer: Answer) -> list[link_pb.DraftMessage]:
        if answer.kind == "empty":
            return [link_pb.DraftMessage()]
        if answer.kind == "open":
            return [link_pb.DraftMessage(open=link_pb.SessionOpen(session_id=self.hello.session_id))]
        rng = np.random.default_rng(answer.seed)
        step = msg.step_id + (int(rng.integers(1, 5)) if answer.kind == "wrong_step" else 0)
        result = link_pb.StepResult(step_id=step, draft_compute_ns=int(rng.integers(0, 2**63)))
        for p in msg.proposals:
            result.trees.append(self._tree(p, answer, rng))
        return [link_pb.DraftMessage(result=result)] * (2 if answer.kind == "flood" else 1)

    def _tree(self, p: link_pb.ProposalRequest, answer: Answer, rng) -> link_pb.TreeRef:
        """Write one tree into the shared tree buffers and return its reference (garbage: any slot,
        any sequence, nodes past the buffer)."""
        slots, width = self.buffers["tree_tokens"].shape
        garbage = answer.trees == "garbage"
        slot = int(rng.integers(0, slots + 2)) if garbage else p.tree_slot
        n = answer.nodes or max(1, min(p.max_depth, width))
        k = min(n, width)
        if garbage:
            tokens, parents = rng.integers(-3, VOCAB_SIZE + 3, k), rng.integers(-3, k + 2, k)
            log_probs = np.where(rng.random(k) < 0.2, np.nan, rng.standard_normal(k) * 1e30).astype(np.float32)
        else:  # a chain: the greedy continuation after the root ("wrong": some tokens off by one)
            at = self.root.get(p.seq_id, 0) + 1
            tokens = np.array((self.full[at:at + k] + [0] * k)[:k])
            if answer.trees == "wrong":
                tokens = (tokens + rng.integers(0, 2, k)) % VOCAB_SIZE
            parents, log_probs = np.arange(k) - 1, np.zeros(k, np.float32)
        if slot < slots:
            self.buffers["tree_tokens"][slot, :k] = tokens
            self.buffers["tree_parents"][slot, :k] = parents
            self.buffers["tree_log_probs"][slot, :k] = log_probs
        seq_id = int(rng.integers(0, 2**63)) if garbage and rng.random() < 0.5 else p.seq_id
        return link_pb.TreeRef(seq_id=seq_id, tree_slot=slot, num_nodes=n)
