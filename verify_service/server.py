"""The verify service process: target engine, engine thread, public and internal gRPC servers.

Two servers on purpose: the public one (Generation, health, reflection) listens where
clients are (loopback by default); the internal one (DraftLink, health) listens on a unix
socket the draft service dials, so the buffer handshake is never reachable from outside.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from link.shared_buffers import BufferExporter
from protos.eagle3.v1 import draft_link_pb2_grpc, generation_pb2, generation_pb2_grpc
from verify_service.draft_link import RemoteDraft
from verify_service.engine import Engine
from verify_service.engine_thread import EngineThread
from verify_service.server_config import VerifyServerConfig
from verify_service.servicers import DraftLinkServicer, GenerationServicer
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

    def stop(self, grace_s: float = 5.0) -> None:
        self.health.enter_graceful_shutdown()
        for server in (self.public, self.internal):
            if server is not None:
                server.stop(grace_s).wait()
        self.loop.stop()
        if self.exporter is not None:
            self.exporter.close()


def _grpc_server(cfg: VerifyServerConfig) -> grpc.Server:
    limit = cfg.max_message_bytes
    return grpc.server(futures.ThreadPoolExecutor(max_workers=cfg.workers),
                       options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)])


def _export_buffers(target: Target, cfg: VerifyServerConfig, capture_layers) -> tuple[BufferExporter, dict]:
    """Allocate the shared buffers; the model's embedding moves into shared memory (one copy)."""
    lim, e = cfg.limits, cfg.engine
    exporter = BufferExporter(target.device)
    width = len(capture_layers) * target.model_config.hidden_size
    rows, nodes = lim.feature_rows(e.max_batch_tokens, e.max_num_seqs), lim.max_tree_nodes
    buffers = {
        "features": exporter.allocate("features", (rows, width), target.dtype),
        "tree_tokens": exporter.allocate("tree_tokens", (e.max_num_seqs, nodes), torch.int64),
        "tree_parents": exporter.allocate("tree_parents", (e.max_num_seqs, nodes), torch.int64),
        "tree_log_probs": exporter.allocate("tree_log_probs", (e.max_num_seqs, nodes), torch.float32),
    }
    embed = target.model.model.embed_tokens
    buffers["embedding"] = exporter.share("embedding", embed.weight.data)
    embed.weight = torch.nn.Parameter(buffers["embedding"], requires_grad=False)
    return exporter, buffers


def create_server(cfg: VerifyServerConfig) -> VerifyServer:
    """Load the model, bind both servers and start them (port 0 / temp sockets work for tests)."""
    target = Target.from_config(cfg.engine)
    status = health.HealthServicer()
    remote, exporter = None, None
    if cfg.limits is not None:
        capture = target.model_config.default_capture_layers()
        exporter, buffers = _export_buffers(target, cfg, capture)
        on_change = lambda up: status.set(SPECULATION_HEALTH, health_pb2.HealthCheckResponse.SERVING if up  # noqa: E731
                                          else health_pb2.HealthCheckResponse.NOT_SERVING)
        remote = RemoteDraft(exporter, buffers, capture, cfg.draft_timeout_s, on_change)
    loop = EngineThread(Engine(target, remote, cfg.limits) if remote else Engine(target))
    public = _grpc_server(cfg)
    generation_pb2_grpc.add_GenerationServicer_to_server(
        GenerationServicer(loop, cfg.limits, remote, cfg.max_tokens_default, Path(cfg.engine.model_dir).name), public)
    health_pb2_grpc.add_HealthServicer_to_server(status, public)
    reflection.enable_server_reflection((GENERATION, health.SERVICE_NAME, reflection.SERVICE_NAME), public)
    port = public.add_insecure_port(cfg.listen)
    internal = None
    if remote is not None:
        internal = _grpc_server(cfg)
        draft_link_pb2_grpc.add_DraftLinkServicer_to_server(
            DraftLinkServicer(remote, target, cfg.limits, cfg.engine.model_dir), internal)
        health_pb2_grpc.add_HealthServicer_to_server(status, internal)
        _prepare_unix_socket(cfg.internal)
        internal.add_insecure_port(cfg.internal)
    for name in ("", GENERATION):
        status.set(name, health_pb2.HealthCheckResponse.SERVING)
    status.set(SPECULATION_HEALTH, health_pb2.HealthCheckResponse.NOT_SERVING)
    loop.start()
    public.start()
    if internal is not None:
        internal.start()
    log.info("verify service: public %s (port %d), internal %s, speculation %s", cfg.listen, port,
             cfg.internal if internal else "-", "waiting for a draft" if remote else "off")
    return VerifyServer(public, internal, loop, status, port, exporter)


def _prepare_unix_socket(address: str) -> None:
    """Create the socket's folder (owner-only) and remove a stale socket file."""
    if not address.startswith("unix:"):
        return
    path = Path(address.removeprefix("unix:").removeprefix("//"))
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.exists():
        path.unlink()


def serve(cfg: VerifyServerConfig) -> None:
    server = create_server(cfg)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    print(f"verify service ready on {cfg.listen}", flush=True)
    done.wait()
    log.info("shutting down (pid %d)", os.getpid())
    server.stop()
