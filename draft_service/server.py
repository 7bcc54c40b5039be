"""The draft service process: dials the verify service, maps its buffers, answers each step.

    connect -> Handshake (compatibility, buffer handles) -> map buffers -> load the head
    -> Session stream: for every VerifyMessage: release finished sequences, extend the draft
       cache with the fed rows, grow the requested trees, write them to the tree buffers,
       answer with their slots.

Any failure (verify restarted, network, bad message) ends the session; the worker backs
off and starts again with a new handshake. Its own gRPC endpoint serves health
(SERVING while a session is live) and reflection.
"""

from __future__ import annotations

import json
import logging
import queue
import signal
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.config import ModelConfig
from draft_service.drafter import EagleDrafter
from draft_service.eagle_config import DraftConfig
from draft_service.server_config import DraftServerConfig
from link.convert import descriptor_from_proto, settings_from_proto
from link.protocol import DraftFeed, ProposeRequest
from link.shared_buffers import BufferImporter, gpu_uuid, host_identity
from protos.eagle3.v1 import draft_link_pb2 as pb
from protos.eagle3.v1 import draft_link_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE = "eagle3.draft"


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class DraftWorker:
    """One session at a time with the verify service; ``run`` reconnects until ``stop``."""

    def __init__(self, cfg: DraftServerConfig, status: health.HealthServicer, make_drafter=None):
        self.cfg = cfg
        self.device = _device(cfg.device)
        self.status = status
        self.make_drafter = make_drafter or EagleDrafter.from_checkpoint
        self.draft_cfg = DraftConfig.from_dir(cfg.spec.draft_path)  # fail fast on a bad head
        self._stop = threading.Event()
        self._responses = None  # the live session's response stream, cancelled by stop()
        self.steps = 0

    def stop(self) -> None:
        """End the current session (if any) and the reconnect loop."""
        self._stop.set()
        responses = self._responses
        if responses is not None:
            responses.cancel()

    def run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self._session()
            except grpc.RpcError as exc:
                if self._stop.is_set():
                    break
                log.warning("verify service unavailable (%s): %s", exc.code().name, exc.details())
            except Exception:
                log.exception("draft session failed")
            self._set_serving(False)
            backoff = 0.1 if time.monotonic() - started > 10 else min(backoff * 2, self.cfg.reconnect_max_s)
            self._stop.wait(backoff)

    def _set_serving(self, up: bool) -> None:
        state = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            self.status.set(name, state)

    def _handshake(self, stub) -> pb.HandshakeResponse:
        d = self.draft_cfg
        expected = pb.ModelIdentity(vocab_size=d.vocab_size, hidden_size=d.target_hidden_size,
                                    capture_layers=list(d.aux_layer_ids or ()))
        where = pb.PeerLocation(host_id=host_identity(), device_type=self.device.type,
                                gpu_uuid=gpu_uuid(self.device) if self.device.type == "cuda" else "")
        return stub.Handshake(pb.HandshakeRequest(expected_target=expected, location=where,
                                                  draft_name=self.cfg.spec.draft_path), timeout=30)

    def _session(self) -> None:
        limit = self.cfg.max_message_bytes
        with grpc.insecure_channel(self.cfg.verify, options=[("grpc.max_receive_message_length", limit),
                                                             ("grpc.max_send_message_length", limit)]) as channel:
            stub = pb_grpc.DraftLinkStub(channel)
            hello = self._handshake(stub)
            with BufferImporter(self.device) as importer:
                bufs = {b.name: importer.open(descriptor_from_proto(b)) for b in hello.buffers}
                target = ModelConfig.from_hf(json.loads(hello.target_config_json))
                drafter = self.make_drafter(self.cfg.spec, target, bufs["embedding"], hello.max_trees,
                                            hello.max_model_len)
                self._stream(stub, hello, bufs, drafter)

    def _stream(self, stub, hello, bufs, drafter) -> None:
        outgoing: queue.Queue = queue.Queue()
        outgoing.put(pb.DraftMessage(open=pb.SessionOpen(session_id=hello.session_id, generation=hello.generation)))
        responses = self._responses = stub.Session(iter(outgoing.get, None))
        if self._stop.is_set():
            responses.cancel()
        self._set_serving(True)
        log.info("draft session %d open (target %s, %d buffers)", hello.session_id, hello.target.fingerprint,
                 len(hello.buffers))
        try:
            for msg in responses:
                if self._stop.is_set():
                    break
                outgoing.put(pb.DraftMessage(result=self._answer(msg, bufs, drafter)))
                self.steps += 1
        finally:
            outgoing.put(None)
            responses.cancel()
            self._responses = None

    def _answer(self, msg: pb.VerifyMessage, bufs, drafter) -> pb.StepResult:
        start = time.perf_counter_ns()
        for rejection in msg.rejected_trees:
            drafter.tree_rejected(rejection.seq_id, rejection.reason)
        for seq_id in msg.finished_seq_ids:
            drafter.release(seq_id)
        features = bufs["features"]
        feeds = [DraftFeed(f.seq_id, f.start_position, features[f.buffer_row:f.buffer_row + len(f.next_tokens)],
                           np.asarray(f.next_tokens, dtype=np.int64)) for f in msg.feeds]
        asks = [ProposeRequest(p.seq_id, p.max_depth, settings_from_proto(p.settings)) for p in msg.proposals]
        trees = drafter.step(feeds, asks)
        result = pb.StepResult(step_id=msg.step_id)
        for p in msg.proposals:
            tree = trees.get(p.seq_id)
            if tree is None or not tree.num_nodes:
                continue
            n = min(tree.num_nodes, bufs["tree_tokens"].shape[1])  # a larger tree is refused by the verifier
            bufs["tree_tokens"][p.tree_slot, :n] = torch.from_numpy(tree.tokens[:n])
            bufs["tree_parents"][p.tree_slot, :n] = torch.from_numpy(tree.parents[:n])
            bufs["tree_log_probs"][p.tree_slot, :n] = torch.from_numpy(tree.log_probs[:n])
            result.trees.add(seq_id=p.seq_id, tree_slot=p.tree_slot, num_nodes=tree.num_nodes)
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the verify process reads the trees right after our answer
        result.draft_compute_ns = time.perf_counter_ns() - start
        return result


def create_server(cfg: DraftServerConfig, make_drafter=None) -> tuple[grpc.Server, DraftWorker, int]:
    status = health.HealthServicer()
    worker = DraftWorker(cfg, status, make_drafter)
    worker._set_serving(False)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    health_pb2_grpc.add_HealthServicer_to_server(status, server)
    reflection.enable_server_reflection((health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(cfg.listen)
    server.start()
    return server, worker, port


def serve(cfg: DraftServerConfig) -> None:
    server, worker, _ = create_server(cfg)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.stop())
    print(f"draft service dialing {cfg.verify}; health on {cfg.listen}", flush=True)
    worker.run()
    server.stop(2).wait()
