"""gRPC handlers of the verify service: the public Generation API and the internal DraftLink."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from pathlib import Path

import grpc

from common.errors import CapacityError, InvalidRequestError, LinkProtocolError, SharedBufferError, ShuttingDownError
from common.grpc_errors import abort
from common.parsed_servicer import add_parsed_servicer
from common.tree_settings import TreeSettings
from link.convert import TREE_TO_PROTO, descriptor_to_proto
from link.shared_buffers import gpu_uuid, host_identity
from protos.eagle3.v1 import draft_link_pb2 as link_pb
from protos.eagle3.v1 import draft_link_pb2_grpc as link_grpc
from protos.eagle3.v1 import generation_pb2 as pb
from protos.eagle3.v1 import generation_pb2_grpc as pb_grpc
from protos.eagle3.v1 import speculation_pb2 as spec_pb
from verify_service import api_convert
from verify_service.draft_link import RemoteDraft
from verify_service.engine_thread import EngineFailure, EngineThread
from verify_service.stats import latest_stats

log = logging.getLogger(__name__)
VERSION = "0.1.0"
_CANCEL_POLL_S = 0.25
MAX_STREAM_INTERVAL_S = 0.25  # the message budget never makes a stream wait longer between messages


def stream_interval(base_s: float, streams: int, messages_per_s: float) -> float:
    """How long a stream lets its tokens gather after a message: ``base_s`` (--stream-interval-ms), or
    longer where the ``streams`` sending tokens would together send more than ``messages_per_s``
    messages a second (0: no bound), up to ``MAX_STREAM_INTERVAL_S``. Each message takes the GIL from
    the engine thread (the handler's and gRPC's threads wake; on an H200 host about 150 us of GIL
    time a message): at 16 streams and 10 ms, a fifth of a speculative run's wall time
    (``benchmarks/results/speculation/services_h200_c896be1/gil_profile_verify_c16.txt``)."""
    if messages_per_s <= 0 or streams <= base_s * messages_per_s:
        return base_s
    return max(base_s, min(streams / messages_per_s, MAX_STREAM_INTERVAL_S))


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, loop: EngineThread, limits: TreeSettings | None, remote: RemoteDraft | None,
                 max_tokens_default: int, model_name: str, max_open_streams: int = 256,
                 max_queued_requests: int = 256, stream_interval_s: float = 0.0, stream_messages_per_s: float = 0.0):
        """``stream_interval_s``: after a response message, a stream lets tokens gather this long
        before the next (its last tokens and its end go at once); longer with many open streams, so
        that they send about ``stream_messages_per_s`` messages a second in all (``stream_interval``)."""
        self.loop, self.limits, self.remote = loop, limits, remote
        self.stream_interval_s, self.stream_messages_per_s = stream_interval_s, stream_messages_per_s
        self.target = loop.engine.target
        self.max_tokens_default = max_tokens_default
        self.model_name = model_name
        self.max_open_streams, self.max_queued_requests = max_open_streams, max_queued_requests
        self.open_streams = 0
        self.draining = False  # set on shutdown: no new requests, the open streams finish
        self._lock = threading.Lock()

    def Generate(self, request, context):
        """Admission first (shutting down: UNAVAILABLE; too many open streams: RESOURCE_EXHAUSTED,
        both at once), then the stream."""
        if self.draining:
            abort(context, ShuttingDownError("the server is shutting down; it takes no new requests"))
        with self._lock:
            admitted = self.open_streams < self.max_open_streams
            self.open_streams += admitted
        if not admitted:
            abort(context, CapacityError(f"{self.max_open_streams} streams are open, the most this server "
                                         "takes; retry later"))
        try:
            yield from self._stream(request, context)
        finally:
            with self._lock:
                self.open_streams -= 1

    def _stream(self, request, context):
        try:
            ids = api_convert.prompt_ids(request, self.target)
            params = api_convert.sampling_params(request, self.max_tokens_default)
            speculate, tree = api_convert.speculation(request, self.limits)
            seq_id, events = self.loop.submit(ids, params, speculate, tree, self.max_queued_requests)
        except Exception as exc:  # typed request errors map to their status; anything else is INTERNAL
            abort(context, exc)
        # Client cancellation or deadline: free the sequence (and its KV) at once. The callback
        # covers the usual case; the is_active() poll covers runtimes that only report a
        # cancelled stream to a handler that is not blocked.
        context.add_callback(lambda: self.loop.cancel(seq_id))
        produced, sent_at = 0, float("-inf")
        while True:
            # Every event committed since the last message, as one message (the message, not the
            # token, is what costs: thread wake-ups that take the GIL from the engine thread).
            interval = stream_interval(self.stream_interval_s, self.streaming(), self.stream_messages_per_s)
            batch = events.take(_CANCEL_POLL_S, sent_at + interval - time.monotonic())
            if not context.is_active():
                self.loop.cancel(seq_id)
                return
            if not batch:
                continue
            failure = batch.pop() if isinstance(batch[-1], EngineFailure) else None  # always the last event
            produced += sum(len(ev.token_ids) for ev in batch)
            if any(ev.token_ids or ev.text for ev in batch):
                sent_at = time.monotonic()
                yield api_convert.delta(batch)
            if failure is not None:
                abort(context, failure.error)
            if batch[-1].finish_reason is not None:
                yield api_convert.done(batch[-1], len(ids), produced)
                return

    def streaming(self) -> int:
        """Streams that send tokens now: the open ones, at most the engine's running requests (as the
        engine thread last published them: those waiting for a batch slot send nothing)."""
        stats = self.loop.published
        return self.open_streams if stats is None else min(self.open_streams, stats.running_requests)

    def GetServerInfo(self, request, context):
        eng, lim = self.target, self.limits
        limits = None
        if lim is not None:
            limits = spec_pb.SpeculationLimits(tree=TREE_TO_PROTO[lim.tree], max_depth=lim.depth,
                                               max_top_k=lim.top_k, max_nodes=lim.max_nodes)
        return pb.ServerInfo(model_name=self.model_name, architecture=eng.model_config.architecture,
                             vocab_size=eng.model_config.vocab_size, max_model_len=eng.max_model_len,
                             dtype=str(eng.dtype).removeprefix("torch."), device=str(eng.device),
                             speculation_configured=lim is not None,
                             draft_connected=bool(self.remote and self.remote.connected), limits=limits,
                             max_tokens_default=self.max_tokens_default, version=VERSION,
                             exact_numerics=eng.exact)

    def GetMetrics(self, request, context):
        return api_convert.server_metrics(latest_stats(self.loop, self.remote))


def model_identity(target, capture_layers: tuple[int, ...], config_json: str) -> link_pb.ModelIdentity:
    weight = target.model.model.embed_tokens.weight
    digest = hashlib.sha256(config_json.encode())
    digest.update(str(tuple(weight.shape)).encode())
    cfg = target.model_config
    return link_pb.ModelIdentity(name=cfg.architecture, fingerprint=digest.hexdigest()[:16],
                                 vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                                 capture_layers=list(capture_layers), dtype=str(target.dtype).removeprefix("torch."))


class DraftLinkServicer(link_grpc.DraftLinkServicer):
    def __init__(self, remote: RemoteDraft, target, limits: TreeSettings, model_dir: str):
        self.remote, self.target, self.limits = remote, target, limits
        self.config_json = (Path(model_dir) / "config.json").read_text()
        self.identity = model_identity(target, remote.capture_layers, self.config_json)

    def Handshake(self, request, context):
        try:
            self._check_peer(request)
        except Exception as exc:
            abort(context, exc)
        if self.remote.connected:  # one draft at a time: the live one keeps the link
            abort(context, LinkProtocolError("a draft session is already connected; one draft at a time"))
        # Only the newest handshake's session may open a stream; a step socket is offered when asked for.
        session = self.remote.new_session(request.step_transport == link_pb.STEP_TRANSPORT_UNIX_SOCKET)
        b = self.remote.buffers
        offer = None if session.listener is None else link_pb.StepSocketOffer(name=session.listener.path.name,
                                                                               token=session.listener.token)
        chain = None  # chained steps travel on the step socket only
        if offer is not None:
            ready, done = self.remote.chain_event_handles()
            chain = link_pb.ChainedSteps(ready_event=ready, done_event=done)
        return link_pb.HandshakeResponse(
            session_id=session.session_id, generation=self.remote.exporter.generation, target=self.identity,
            buffers=[descriptor_to_proto(d) for d in self.remote.exporter.descriptors()],
            max_feature_rows=b["features"].shape[0], max_trees=b["tree_tokens"].shape[0],
            max_tree_nodes=b["tree_tokens"].shape[1], target_config_json=self.config_json,
            max_model_len=self.target.max_model_len, step_socket=offer, chained_steps=chain)

    def _check_peer(self, request) -> None:
        loc, want, mine = request.location, request.expected_target, self.identity
        sizes = {"draft_name": len(request.draft_name), "location.host_id": len(loc.host_id),
                 "location.gpu_uuid": len(loc.gpu_uuid), "expected_target.capture_layers": len(want.capture_layers)}
        limits = {"draft_name": 4096, "location.host_id": 256, "location.gpu_uuid": 256,
                  "expected_target.capture_layers": 256}
        for name, n in sizes.items():
            if n > limits[name]:
                raise LinkProtocolError(f"handshake: {name} has {n} entries, at most {limits[name]} allowed")
        if loc.host_id != host_identity():
            raise SharedBufferError("the draft service must run on the verify service's host (shared memory)")
        device = self.target.device
        if loc.device_type != device.type:
            raise SharedBufferError(f"the draft runs on {loc.device_type}, the target on {device.type}")
        if device.type == "cuda" and loc.gpu_uuid != gpu_uuid(device):
            raise SharedBufferError("the draft and the target must share one GPU (GPU UUIDs differ)")
        mismatch = [f"{name}: draft expects {a}, target has {b}" for name, a, b in (
            ("vocab_size", want.vocab_size, mine.vocab_size), ("hidden_size", want.hidden_size, mine.hidden_size))
            if a != b]
        if want.capture_layers and list(want.capture_layers) != list(mine.capture_layers):
            mismatch.append(f"capture_layers: draft expects {list(want.capture_layers)}, "
                            f"target captures {list(mine.capture_layers)}")
        if mismatch:
            raise InvalidRequestError("expected_target", "incompatible draft head: " + "; ".join(mismatch))

    def Session(self, request_iterator, context):
        try:
            first = next(request_iterator)
        except StopIteration:
            return
        session = self.remote.claim(first.open.session_id) if first.HasField("open") else None
        try:
            if session is None or first.open.generation != self.remote.exporter.generation:
                raise SharedBufferError("unknown session or stale buffer generation: handshake again")
            self.remote.open_step_socket(session, first.open.step_transport == link_pb.STEP_TRANSPORT_UNIX_SOCKET)
            session.chained = first.open.chained_steps and session.step_socket is not None
            if not self.remote.activate(session):
                raise LinkProtocolError("a draft session is already connected; one draft at a time")
        except (SharedBufferError, LinkProtocolError) as exc:
            if session is not None:
                self.remote.drop(session, str(exc))  # closes what the session held (its step socket)
            abort(context, exc)
        context.add_callback(lambda: self.remote.drop(session, "stream closed"))
        threading.Thread(target=self._read, args=(request_iterator, session, context), daemon=True,
                         name=f"draft-session-{session.session_id}").start()
        while True:
            msg = session.outgoing.get()
            if msg is None:
                return
            yield msg

    def _read(self, request_iterator, session, context) -> None:
        try:
            for msg in request_iterator:
                if session.step_socket is not None:  # its results come on the step socket
                    self.remote.drop(session, "the draft broke the protocol (a step on the stream, not the socket)")
                    return
                if not msg.HasField("result"):
                    self.remote.drop(session, "the draft broke the protocol (a message that is not a result)")
                    return
                if not self.remote.deliver(session, msg.result):
                    return
        except grpc.RpcError:
            self.remote.drop(session, "draft disconnected")  # the peer went away without closing
        except Exception:
            log.exception("draft session %d: bad message", session.session_id)
            self.remote.drop(session, "bad message from the draft")
        else:
            if _closed_by_peer(context):
                self.remote.drop(session, "the draft closed the link", clean=True)
            else:
                self.remote.drop(session, "draft disconnected")


def _closed_by_peer(context, wait_s: float = 0.5) -> bool:
    """After a draft's requests end: True if it closed its link (its shutdown), False if it vanished.

    A draft that closes its link keeps the RPC open until this side answers (it waits for that);
    the RPC of one that died (kill -9) ends within moments, sometimes just after its requests do.
    """
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if not context.is_active():
            return False
        time.sleep(0.02)
    return True


def add_generation_servicer(servicer: GenerationServicer, server: grpc.Server) -> None:
    """Register ``servicer`` as eagle3.v1.Generation, each method parsing its own request (gRPC's
    deserializer answers a malformed request with INTERNAL; these answer INVALID_ARGUMENT)."""
    add_parsed_servicer(servicer, pb.DESCRIPTOR.services_by_name["Generation"], server)
