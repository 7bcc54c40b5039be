"""The draft service process: dials the verify service, maps its buffers, answers each step.

    connect -> Handshake (compatibility, buffer handles) -> map buffers -> load the head
    -> Session stream (+ the unix step socket, when offered): for every step: release finished
       sequences, extend the draft cache with the fed rows, grow the requested trees, write them
       to the tree buffers, answer with their slots.

Steps come on the unix step socket (link/step_socket.py) when the verify service offers one,
which it does when its internal address is a unix socket; else on the Session stream. Any
failure (verify restarted, network, bad message) ends the session; the worker backs off and
starts again with a new handshake. Its own gRPC endpoint serves health (SERVING while a
session is live) and reflection.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
import traceback
from concurrent import futures
from dataclasses import dataclass

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.gc_heap import freeze_startup_heap, unfreeze_for_exit
from common.listen import NO_PORT_SHARING, bind, unix_socket_path
from common.reflection import enable_reflection
from common.metrics_http import metrics_host
from common.tree_settings import tree_sizes
from draft_service.drafter import EagleDrafter
from draft_service.eagle_config import DraftConfig
from draft_service.metrics import DraftMetrics
from draft_service.server_config import DraftServerConfig
from draft_service.step_answer import StepAnswerer
from draft_service.handshake_checks import checked_handshake
from kernels.compile_watch import CompileWatch
from link import step_socket
from link.convert import step_call_from_proto, step_reply_to_proto
from link.protocol import ChainCall, ChainReply, StepReply
from link.shared_buffers import BufferImporter, gpu_uuid, host_identity
from link.step_frames import TOKEN_BYTES, FrameLimits, StepFrames
from link.step_socket import StepSocket
from protos.eagle3.v1 import draft_link_pb2 as pb
from protos.eagle3.v1 import draft_link_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
STOP_TIMEOUT_S = 20.0  # on SIGTERM, the session's close waited for at most this long (it takes a few seconds)
SERVICE = "eagle3.draft"
IPC_EVENT_BYTES = 64  # sizeof(cudaIpcEventHandle_t)


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class DraftWorker:
    """One session at a time with the verify service; ``run`` reconnects until ``stop``."""

    def __init__(self, cfg: DraftServerConfig, status: health.HealthServicer, make_drafter=None,
                 on_step=lambda compute_s: None):
        """``on_step(compute_s)``: called after every answered step with its draft compute time (metrics).
        ``make_drafter(spec, target, embedding, max_seqs, max_len, cuda_graphs=...)``: builds each
        session's drafter (default ``EagleDrafter.from_checkpoint``)."""
        self.cfg = cfg
        self.device = _device(cfg.device)
        self.status = status
        self.make_drafter = make_drafter or EagleDrafter.from_checkpoint
        self.draft_cfg = DraftConfig.from_dir(cfg.spec.draft_path)  # fail fast on a bad head
        self._stop = threading.Event()
        self._watching = False  # warning on kernel compilations after the first warm-up
        self._responses = None  # the live session's response stream, cancelled by stop()
        self._outgoing: queue.Queue | None = None  # the live session's request stream
        self._step_socket: StepSocket | None = None  # the live session's step socket (None: steps on the stream)
        self._was_connected = False
        self._on_step = on_step
        self.connected = False  # a session is live
        self.sessions_opened = 0
        self.steps = 0  # steps answered
        self.trees_proposed = 0

    def stop(self, grace_s: float = 2.0) -> None:
        """End the current session (if any) and the reconnect loop.

        The link is closed from this side first (the request stream ends), so the verify service
        sees a normal shutdown rather than a lost draft; it is cut after ``grace_s`` regardless.
        """
        self._stop.set()
        outgoing, responses, sock = self._outgoing, self._responses, self._step_socket
        if outgoing is not None:
            outgoing.put(None)
        if responses is not None:
            _later(grace_s, responses.cancel)
        if sock is not None:
            _later(grace_s, sock.shutdown)

    def run(self) -> None:
        backoff = 0.1
        print(f"draft service: waiting for the verify service at {self.cfg.verify}", flush=True)
        while not self._stop.is_set():
            started = time.monotonic()
            self._run_session()
            self._set_serving(False)
            backoff = 0.1 if time.monotonic() - started > 10 else min(backoff * 2, self.cfg.reconnect_max_s)
            self._stop.wait(backoff)

    def _run_session(self) -> None:
        """One session; its failure is logged, and all it held is released before the next handshake.

        A failure's traceback keeps the session's frames, whose locals are the drafter (its KV cache)
        and the tensors mapping the verify service's buffers. A gRPC error is the response stream
        itself, which those frames also hold: a cycle that only the cyclic GC frees, rarely, so every
        verify restart left one more session alive. Clearing the frames frees them by refcount, now.
        """
        try:
            self._session()
        except Exception as exc:
            if not isinstance(exc, grpc.RpcError):
                log.exception("draft session failed")
            elif not self._stop.is_set():
                self._unavailable(exc)
            traceback.clear_frames(exc.__traceback__)

    def _unavailable(self, exc: grpc.RpcError) -> None:
        """Not reachable (or not answering: its socket is bound before its model loads) while it starts
        is expected (INFO); losing it after a session is a warning."""
        waiting = exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        if waiting and not self._was_connected:
            log.info("verify service at %s not reachable yet: %s", self.cfg.verify, exc.details())
        elif exc.code() == grpc.StatusCode.UNAVAILABLE:
            log.warning("lost the verify service at %s; reconnecting", self.cfg.verify)
            self._was_connected = False
        else:
            log.warning("verify service at %s refused the draft (%s): %s", self.cfg.verify, exc.code().name,
                        exc.details())

    def _set_serving(self, up: bool) -> None:
        self.connected = up
        state = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            self.status.set(name, state)

    def _handshake(self, stub) -> pb.HandshakeResponse:
        d = self.draft_cfg
        expected = pb.ModelIdentity(vocab_size=d.vocab_size, hidden_size=d.target_hidden_size,
                                    capture_layers=list(d.aux_layer_ids or ()))
        where = pb.PeerLocation(host_id=host_identity(), device_type=self.device.type,
                                gpu_uuid=gpu_uuid(self.device) if self.device.type == "cuda" else "")
        unix = unix_socket_path(self.cfg.verify) is not None
        socket_ok = self.cfg.step_transport == "socket" and unix and step_socket.supported()
        transport = pb.STEP_TRANSPORT_UNIX_SOCKET if socket_ok else pb.STEP_TRANSPORT_SESSION_STREAM
        return stub.Handshake(pb.HandshakeRequest(expected_target=expected, location=where, step_transport=transport,
                                                  draft_name=self.cfg.spec.draft_path), timeout=30)

    def _connect_step_socket(self, hello: pb.HandshakeResponse) -> StepSocket | None:
        """The offered step socket, connected and told the session's token; None: steps on the stream."""
        if not hello.HasField("step_socket"):
            return None
        offer, limits = hello.step_socket, FrameLimits(hello.max_trees, hello.max_feature_rows)
        name, verify_socket = offer.name, unix_socket_path(self.cfg.verify)
        if verify_socket is None or not limits.fit_socket or len(offer.token) != TOKEN_BYTES or not name \
                or len(name) > 100 or "/" in name or "\0" in name or name in (".", ".."):
            log.warning("the verify service offered an unusable step socket; steps go on the session stream")
            return None
        path = verify_socket.parent / name  # this process's path to the folder of the internal socket
        try:
            return StepSocket.connect(path, offer.token, limits.call_bytes, limits.reply_bytes)
        except OSError as exc:
            log.warning("cannot connect to the step socket %s (%s); steps go on the session stream", path, exc)
            return None

    def _session(self) -> None:
        limit = self.cfg.max_message_bytes
        with grpc.insecure_channel(self.cfg.verify, options=[("grpc.max_receive_message_length", limit),
                                                             ("grpc.max_send_message_length", limit)]) as channel:
            stub = pb_grpc.DraftLinkStub(channel)
            hello = self._handshake(stub)
            target, descs = checked_handshake(hello, self.draft_cfg)  # before mapping or allocating
            with BufferImporter(self.device) as importer:
                # The embedding is the target's table: mapped read-only where the backend can.
                bufs = {name: importer.open(d, read_only=name == "embedding") for name, d in descs.items()}
                drafter = self.make_drafter(self.cfg.spec, target, bufs["embedding"], hello.max_trees,
                                            hello.max_model_len, cuda_graphs=not self.cfg.enforce_eager)
                # Before the session opens (the verify side decodes plainly meanwhile):
                warm_up = getattr(drafter, "warm_up", None)
                # Every size adaptive speculation may ask for (the verify side's choice, not known here):
                # a shape's first proposal would otherwise capture its graphs in the middle of serving.
                shapes = [self.cfg.spec.settings.capped(n) for n in tree_sizes(self.cfg.spec.settings)]
                chained = hello.HasField("chained_steps")  # the extend fed from the device, too
                if warm_up is not None and warm_up(shapes, prompt_rows=hello.max_feature_rows, chained=chained) \
                        and not self._watching:
                    self._watching = CompileWatch(log, "the draft service's warm-up").start()
                self._stream(stub, hello, bufs, drafter)

    def _chain_events(self, hello: pb.HandshakeResponse, sock: StepSocket | None, drafter) -> tuple | None:
        """The chained steps' events, opened, when the verify side offers chained steps and this session
        can take them (a step socket, a drafter that steps on the device): () off CUDA; None: no chained
        steps (every step comes with its rows on the host)."""
        if not self.cfg.chained_steps or sock is None or not hello.HasField("chained_steps") \
                or not hasattr(drafter, "step_on_device"):
            return None
        if self.device.type != "cuda":
            return ()
        handles = (hello.chained_steps.ready_event, hello.chained_steps.done_event)
        try:
            if any(len(h) != IPC_EVENT_BYTES for h in handles):
                raise ValueError(f"event handles of {[len(h) for h in handles]} bytes")
            device = self.device if self.device.index is not None else torch.device("cuda", torch.cuda.current_device())
            return tuple(torch.cuda.Event.from_ipc_handle(device, h) for h in handles)  # an index: record checks it
        except (RuntimeError, ValueError) as exc:
            log.warning("cannot open the chained steps' events (%s); steps are not chained", exc)
            return None

    def _stream(self, stub, hello, bufs, drafter) -> None:
        sock = self._connect_step_socket(hello)  # before the stream opens: the verify side accepts it then
        transport = pb.STEP_TRANSPORT_SESSION_STREAM if sock is None else pb.STEP_TRANSPORT_UNIX_SOCKET
        events = self._chain_events(hello, sock, drafter)
        outgoing: queue.Queue = queue.Queue()
        outgoing.put(pb.DraftMessage(open=pb.SessionOpen(session_id=hello.session_id, generation=hello.generation,
                                                         step_transport=transport, chained_steps=events is not None)))
        self._outgoing, self._step_socket = outgoing, sock
        responses = self._responses = stub.Session(iter(outgoing.get, None))
        if self._stop.is_set():  # stop() came before this session's stream was there to close
            responses.cancel()
            if sock is not None:
                sock.shutdown()
        self._set_serving(True)
        self.sessions_opened += 1
        self._was_connected = True
        print(f"draft service: connected to the verify service at {self.cfg.verify} (session {hello.session_id})",
              flush=True)
        log.info("draft session %d open (target %s, %d buffers, steps on the %s%s)", hello.session_id,
                 hello.target.fingerprint, len(hello.buffers), "stream" if sock is None else "step socket",
                 "" if events is None else ", chained")
        answerer = StepAnswerer(bufs, drafter, events)
        try:
            if sock is None:
                self._serve_stream(responses, outgoing, answerer)
            else:
                self._serve_socket(sock, responses, FrameLimits(hello.max_trees, hello.max_feature_rows), answerer)
        finally:
            outgoing.put(None)
            responses.cancel()
            if sock is not None:
                sock.close()
            self._responses = self._outgoing = self._step_socket = None

    def _serve_stream(self, responses, outgoing: queue.Queue, answerer: StepAnswerer) -> None:
        for msg in responses:
            if self._stop.is_set():
                break
            reply = answerer.answer(step_call_from_proto(msg))
            self._count(reply)  # before the answer: once the verify side has it, the counters show it
            outgoing.put(pb.DraftMessage(result=step_reply_to_proto(reply)))

    def _serve_socket(self, sock: StepSocket, responses, limits: FrameLimits, answerer: StepAnswerer) -> None:
        """Answer steps until the verify side closes the socket (it does when the session ends, after
        this side's stop() too: a step arriving meanwhile is still answered). Then the stream's end
        says why: an error status (a refused step socket, a lost verify service) is raised."""
        frames = StepFrames(limits)  # its buffers, reused every step
        while True:
            try:
                frame = sock.recv()
            except ConnectionError:
                break
            call = frames.decode(frame)
            chained = isinstance(call, ChainCall)
            reply = answerer.chain(call) if chained else answerer.answer(call)
            self._count(reply)
            try:
                sock.send(frames.encode_chain_reply(reply) if chained else frames.encode_reply(reply))
            except ConnectionError:  # the verify side ended the session meanwhile
                break
        _later(5.0, responses.cancel)  # the verify side ends the stream with the socket; never wait for ever
        for _ in responses:  # nothing comes on this stream
            pass

    def _count(self, reply: StepReply | ChainReply) -> None:
        self.steps += 1
        self.trees_proposed += reply.num_trees if isinstance(reply, ChainReply) else len(reply.trees)
        self._on_step(reply.draft_compute_ns / 1e9)


def _later(delay_s: float, action) -> None:
    timer = threading.Timer(delay_s, action)
    timer.daemon = True
    timer.start()


@dataclass
class DraftServer:
    server: grpc.Server  # health and reflection
    worker: DraftWorker
    port: int
    metrics: DraftMetrics | None = None  # Prometheus /metrics (metrics.endpoint.port: the bound port)

    def stop(self, grace_s: float = 2.0) -> None:
        self.worker.stop()
        if self.metrics is not None:
            self.metrics.stop()
        self.server.stop(grace_s).wait()


def create_server(cfg: DraftServerConfig, make_drafter=None) -> DraftServer:
    """Bind the health endpoint (and /metrics) and return; ``worker.run()`` then dials the verify service."""
    metrics = DraftMetrics(metrics_host(cfg.listen), cfg.metrics_port) if cfg.metrics_port is not None else None
    status = health.HealthServicer()
    worker = DraftWorker(cfg, status, make_drafter, metrics.compute_seconds.observe if metrics else lambda s: None)
    worker._set_serving(False)
    if metrics is not None:
        metrics.attach(worker)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=[NO_PORT_SHARING])
    health_pb2_grpc.add_HealthServicer_to_server(status, server)
    enable_reflection((health.SERVICE_NAME,), server)
    port = bind(server, cfg.listen)
    server.start()
    return DraftServer(server, worker, port, metrics)


def serve(cfg: DraftServerConfig) -> None:
    srv = create_server(cfg)
    # Loaded: the head, its kernels and the config stay for good; out of every later full collection's walk.
    log.info("garbage collector: %d startup objects frozen", freeze_startup_heap())
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    print(f"draft service dialing {cfg.verify}; health on {cfg.listen}", flush=True)
    if srv.metrics is not None:
        print(f"draft service metrics on {srv.metrics.endpoint.url}", flush=True)
    # Python runs signal handlers on the main thread, and a process signal may land on any thread: a
    # main thread that ran the sessions itself sat in the step socket's read while no step came, and a
    # SIGTERM taken by another thread was never seen (the service did not stop). The sessions run on a
    # thread of their own; the main thread only polls (as the verify service's does).
    failed: list[BaseException] = []

    def sessions() -> None:
        try:
            srv.worker.run()
        except BaseException as exc:  # raised again on the main thread: the service fails as before
            failed.append(exc)

    worker = threading.Thread(target=sessions, name="draft-sessions", daemon=True)
    worker.start()
    while worker.is_alive() and not stopping.wait(0.2):
        pass
    srv.worker.stop()
    worker.join(STOP_TIMEOUT_S)  # the session closes its link, cut after stop()'s grace
    if worker.is_alive():
        log.warning("the draft session did not end within %g s of the stop; exiting anyway", STOP_TIMEOUT_S)
    srv.stop()
    unfreeze_for_exit()
    if failed:
        raise failed[0]
