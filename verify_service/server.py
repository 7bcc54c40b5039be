"""The verify service process: target engine, engine thread, public and internal gRPC servers.

Two servers on purpose: the public one (Generation, health, reflection) listens where
clients are (loopback by default; TLS and a bearer token on request: common/auth.py); the
internal one (DraftLink, health) listens on a unix socket the draft service dials, so the
buffer handshake is never reachable from outside.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health, health_pb2

from common.auth import TokenInterceptor, exposure_warning, server_credentials
from common.gc_heap import freeze_startup_heap, unfreeze_for_exit
from common.listen import NO_PORT_SHARING, bind, unix_socket_path
from common.parsed_servicer import add_health_servicer, add_parsed_servicer
from common.reflection import enable_reflection
from common.metrics_http import metrics_host
from common.tree_settings import tree_sizes
from kernels.compile_watch import CompileWatch
from link import step_socket
from link.shared_buffers import BufferExporter
from verify_service.adaptive import policy_for
from protos.eagle3.v1 import draft_link_pb2, generation_pb2
from verify_service.draft_link import RemoteDraft
from verify_service.engine import Engine
from verify_service.engine_thread import EngineThread
from verify_service.metrics import VerifyMetrics
from verify_service.server_config import VerifyServerConfig
from verify_service.servicers import DraftLinkServicer, GenerationServicer, add_generation_servicer
from verify_service.stats import latest_stats, snapshot_fn
from verify_service.target import Target

log = logging.getLogger(__name__)
SPECULATION_HEALTH = "eagle3.speculation"  # SERVING only while a draft is connected
GENERATION = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


@dataclass
class VerifyServer:
    public: grpc.Server
    internal: grpc.Server | None
    loop: EngineThread
    health: health.HealthServicer
    public_port: int
    exporter: BufferExporter | None
    generation: GenerationServicer
    metrics: VerifyMetrics | None = None  # Prometheus /metrics (metrics.endpoint.port: the bound port)

    def drain(self, grace_s: float) -> int:
        """Shutdown, first half: NOT_SERVING at once, new requests refused (UNAVAILABLE), the open
        streams given ``grace_s`` to finish. Returns how many were still open when it ran out."""
        self.health.enter_graceful_shutdown()
        self.generation.draining = True
        deadline = time.monotonic() + grace_s
        while self.generation.open_streams and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.generation.open_streams

    def stop(self, grace_s: float = 5.0) -> None:
        if self.metrics is not None:
            self.metrics.stop()
        self.health.enter_graceful_shutdown()
        if self.generation.remote is not None:
            self.generation.remote.close()
        for server in (self.public, self.internal):
            if server is not None:
                server.stop(grace_s).wait()
        self.loop.stop()
        if self.exporter is not None:
            self.exporter.close()


def _grpc_server(cfg: VerifyServerConfig, interceptors: tuple[grpc.ServerInterceptor, ...] = ()) -> grpc.Server:
    limit = cfg.max_message_bytes
    return grpc.server(futures.ThreadPoolExecutor(max_workers=cfg.workers), interceptors=interceptors,
                       options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit),
                                NO_PORT_SHARING])


def _public_server(cfg: VerifyServerConfig) -> tuple[grpc.Server, int]:
    """The public server, bound: TLS with --tls-cert, the token checked on every call but health's
    with an API token, and a warning when it is reachable beyond loopback without both."""
    public = _grpc_server(cfg, (TokenInterceptor(cfg.api_token),) if cfg.api_token is not None else ())
    tls = server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca) if cfg.tls_cert is not None else None
    port = bind(public, cfg.listen, tls)
    warning = exposure_warning(cfg.listen, tls is not None, cfg.api_token is not None)
    if warning is not None:
        log.warning(warning)
    return public, port


def _export_buffers(target: Target, cfg: VerifyServerConfig, capture_layers) -> tuple[BufferExporter, dict]:
    """Allocate the shared buffers. The draft gets a COPY of the embedding table: the target keeps
    its own, so no write through shared memory (a faulty or hostile peer) can change the target's
    output; at worst it spoils the draft's proposals, which verification then rejects. The tree
    buffers are host memory on every device: the draft builds its trees on the host and this side
    lays them out there, so a tree crosses no PCIe copy and no device sync on either side. Chained
    steps (verify_service/draft_link.py) pass their accepted rows and their next trees on the device
    instead: ``chain_feeds`` (per sequence the count, then the tokens) and ``chain_trees``."""
    lim, e = cfg.limits, cfg.engine
    exporter = BufferExporter(target.device)
    width = len(capture_layers) * target.model_config.hidden_size
    rows, nodes = lim.feature_rows(e.max_batch_tokens, e.max_num_seqs), lim.max_tree_nodes
    buffers = {
        "features": exporter.allocate("features", (rows, width), target.dtype),
        "tree_tokens": exporter.allocate("tree_tokens", (e.max_num_seqs, nodes), torch.int64, host=True),
        "tree_parents": exporter.allocate("tree_parents", (e.max_num_seqs, nodes), torch.int64, host=True),
        "tree_log_probs": exporter.allocate("tree_log_probs", (e.max_num_seqs, nodes), torch.float32, host=True),
        "chain_feeds": exporter.allocate("chain_feeds", (e.max_num_seqs, lim.depth + 2), torch.int64),
        "chain_trees": exporter.allocate("chain_trees", (4, e.max_num_seqs, nodes), torch.int64),
    }
    buffers["embedding"] = exporter.share("embedding", target.model.model.embed_tokens.weight.data)
    return exporter, buffers


def create_server(cfg: VerifyServerConfig) -> VerifyServer:
    """Bind both servers, load the model and start them (port 0 / temp sockets work for tests).

    The addresses are claimed first, so an address in use fails at once, not after the model load.
    """
    public, port = _public_server(cfg)
    internal = _grpc_server(cfg) if cfg.limits is not None else None
    if internal is not None:
        bind(internal, cfg.internal)
    metrics = VerifyMetrics(metrics_host(cfg.listen), cfg.metrics_port) if cfg.metrics_port is not None else None
    target = Target.from_config(cfg.engine)
    status = health.HealthServicer()
    remote, exporter = _remote_draft(target, cfg, status, metrics)
    on_step = metrics.step_seconds.observe if metrics else lambda seconds: None
    policy = policy_for(target, cfg.limits, cfg.cost_table) if remote and cfg.adaptive_speculation else None
    engine = Engine(target, remote, cfg.limits, policy) if remote else Engine(target)
    loop = EngineThread(engine, on_step)
    loop.publish_with(snapshot_fn(loop, remote))  # metrics never wait for a step
    if metrics is not None:
        metrics.attach(lambda timeout_s: latest_stats(loop, remote))
    generation = GenerationServicer(loop, cfg.limits, remote, cfg.max_tokens_default, Path(cfg.engine.model_dir).name,
                                    cfg.max_open_streams, cfg.max_queued_requests, cfg.stream_interval_ms / 1e3,
                                    cfg.stream_messages_per_s)
    add_generation_servicer(generation, public)
    add_health_servicer(status, public)  # a malformed request: INVALID_ARGUMENT, not INTERNAL
    enable_reflection((GENERATION, health.SERVICE_NAME), public)
    if internal is not None:
        add_parsed_servicer(DraftLinkServicer(remote, target, cfg.limits, cfg.engine.model_dir),
                            draft_link_pb2.DESCRIPTOR.services_by_name["DraftLink"], internal)
        add_health_servicer(status, internal)
    # Before SERVING, and after the engine set its capture layers (which drops captured graphs):
    # no request ever waits for a kernel compilation.
    tree_tokens = () if internal is None or cfg.limits is None else \
        tuple(n + 1 for n in tree_sizes(cfg.limits)) if cfg.adaptive_speculation else (cfg.limits.node_budget + 1,)
    warm_s = target.runner.warm_up(cfg.engine.max_batch_tokens, tree_tokens)
    if tree_tokens:  # chained steps' acceptance graphs (with a policy: of its largest trees)
        engine.verifier.warm_up(cfg.limits.node_budget, cfg.limits.depth)
    if warm_s:
        log.info("kernels compiled and decode and verification graphs captured in %.1f s", warm_s)
        CompileWatch(log, "the verify service's warm-up").start()
    for name in ("", GENERATION):
        status.set(name, health_pb2.HealthCheckResponse.SERVING)
    status.set(SPECULATION_HEALTH, health_pb2.HealthCheckResponse.NOT_SERVING)
    loop.start()
    public.start()
    if internal is not None:
        internal.start()
    log.info("verify service: public %s (port %d, TLS %s, API token %s), internal %s, speculation %s%s, metrics %s",
             cfg.listen, port, "mutual" if cfg.tls_client_ca else "on" if cfg.tls_cert else "off",
             "required" if cfg.api_token else "off", cfg.internal if internal else "-",
             "waiting for a draft" if remote else "off", " (adaptive)" if policy else "",
             metrics.endpoint.url if metrics else "off")
    return VerifyServer(public, internal, loop, status, port, exporter, generation, metrics)


def _remote_draft(target: Target, cfg: VerifyServerConfig, status: health.HealthServicer,
                  metrics: VerifyMetrics | None) -> tuple[RemoteDraft | None, BufferExporter | None]:
    """The draft service behind the DraftProvider interface, and its shared buffers (none without speculation)."""
    if cfg.limits is None:
        return None, None
    capture = target.model_config.default_capture_layers()
    exporter, buffers = _export_buffers(target, cfg, capture)
    on_change = lambda up: status.set(SPECULATION_HEALTH, health_pb2.HealthCheckResponse.SERVING if up  # noqa: E731
                                      else health_pb2.HealthCheckResponse.NOT_SERVING)
    on_overhead = metrics.draft_overhead_seconds.observe if metrics else lambda seconds: None
    internal = unix_socket_path(cfg.internal)  # step sockets go beside it; a TCP link steps on its stream
    folder = internal.parent if internal is not None and step_socket.supported() else None
    return RemoteDraft(exporter, buffers, capture, cfg.draft_timeout_s, on_change, on_overhead, folder,
                       chain_min_seqs=cfg.chain_min_seqs, kernels=target.runner.kernels), exporter


def serve(cfg: VerifyServerConfig) -> None:
    server = create_server(cfg)
    # Warmed up: the model, graphs and tokenizer stay for good; out of every later full collection's walk.
    log.info("garbage collector: %d startup objects frozen", freeze_startup_heap())
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    print(f"verify service ready on {cfg.listen}", flush=True)
    if server.metrics is not None:
        print(f"verify service metrics on {server.metrics.endpoint.url}", flush=True)
    # Python runs signal handlers on the main thread, and a process signal may land on any thread:
    # a main thread blocked for good in wait() would only see SIGTERM when something woke it.
    while not done.wait(0.2):
        pass
    log.info("shutting down (pid %d): NOT_SERVING, no new requests, %d streams open get %g s",
             os.getpid(), server.generation.open_streams, cfg.shutdown_grace_s)
    left = server.drain(cfg.shutdown_grace_s)
    if left:
        log.warning("%d streams still open after %g s: cancelled", left, cfg.shutdown_grace_s)
    server.stop(grace_s=1.0)
    unfreeze_for_exit()
    print("verify service stopped", flush=True)
