"""Round trip of the per-step draft link between two real processes, with no model work.

The verify side is the service's own ``RemoteDraft`` behind its ``DraftLinkServicer`` on a unix
socket; the draft side is the service's own ``DraftWorker`` in a second process whose drafter
answers at once (a fixed chain per proposal, written into the shared tree buffers). Each step
feeds ``--batch`` sequences 4 committed rows each and asks each for a tree, as a speculative
decode step does. Reported per transport (the Session stream and the unix step socket), in
microseconds: ``link`` (the link's round trip: the step handed to the transport until its
answer is parsed, the draft's instant answer included), ``step`` (``RemoteDraft.step`` as the
engine thread sees it: feature copy, the link, trees read back from the shared buffers) and
``overhead`` (the service's own control-plane figure, GetMetrics' control_plane_p50_us/p99_us:
the step less the draft's reported compute, from just before the send). The transports take
turns of 250 steps, so a shared machine's background load falls on both alike.

    python benchmarks/link_rtt.py --steps 5000 --batch 1 --batch 8 --out benchmarks/results/link_rtt_cpu.json
    python benchmarks/link_rtt.py --device cuda ...     # the features through CUDA IPC, as on a GPU host
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# A small geometry: the link's cost does not depend on the model, only on what a step carries.
TARGET = {"architectures": ["LlamaForCausalLM"], "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
          "rope_theta": 10000.0, "max_position_embeddings": 4096}
ROWS_PER_FEED, CHAIN = 4, 4  # committed rows per sequence per step; nodes of each answered tree
MAX_SEQS, MAX_NODES = 64, 60


class InstantDrafter:
    """Answers every proposal at once with the same chain of CHAIN nodes."""

    capture_layers = (1, 2, 1)

    def __init__(self):
        import numpy as np

        from runtime.tree import CandidateTree

        self.tree = CandidateTree.from_lists(np.arange(1, CHAIN + 1), np.arange(CHAIN) - 1,
                                             log_probs=np.zeros(CHAIN, np.float32))

    def step(self, feeds, proposals):
        return {p.seq_id: self.tree for p in proposals}

    def release(self, seq_id):
        pass

    def tree_rejected(self, seq_id, reason):
        pass


def draft_process(head_dir: str, internal: str, transport: str, device: str) -> None:
    """The draft service's worker, its drafter replaced by one that answers at once."""
    import logging

    from grpc_health.v1 import health

    from draft_service.server import DraftWorker
    from draft_service.server_config import DraftServerConfig
    from draft_service.spec_config import SpecConfig

    logging.basicConfig(level=logging.WARNING)
    cfg = DraftServerConfig(SpecConfig(head_dir, tree="chain", depth=CHAIN), verify=internal, device=device,
                            step_transport=transport)
    DraftWorker(cfg, health.HealthServicer(), make_drafter=lambda *args, **kwargs: InstantDrafter()).run()


def verify_side(model_dir: Path, internal: str, device: str):
    """The verify service's link (RemoteDraft + DraftLinkServicer on ``internal``) without a model, its
    buffers placed as the service places them (features and embedding on ``device``, trees on the host)."""
    import grpc
    import torch

    from common.config import ModelConfig
    from common.listen import NO_PORT_SHARING, bind, unix_socket_path
    from common.parsed_servicer import add_parsed_servicer
    from common.tree_settings import TreeSettings
    from link import step_socket
    from link.shared_buffers import BufferExporter
    from protos.eagle3.v1 import draft_link_pb2
    from verify_service.draft_link import RemoteDraft
    from verify_service.servicers import DraftLinkServicer

    config = ModelConfig.from_dir(str(model_dir))
    capture = config.default_capture_layers()
    exporter = BufferExporter(torch.device(device))
    embedding = torch.zeros(config.vocab_size, config.hidden_size, device=device)
    trees = (MAX_SEQS, MAX_NODES)
    buffers = {"features": exporter.allocate("features", (2048, len(capture) * config.hidden_size), torch.float32),
               "tree_tokens": exporter.allocate("tree_tokens", trees, torch.int64, host=True),
               "tree_parents": exporter.allocate("tree_parents", trees, torch.int64, host=True),
               "tree_log_probs": exporter.allocate("tree_log_probs", trees, torch.float32, host=True),
               # (the chained steps' buffers, which the draft's handshake asks for; this benchmark's steps
               # go through the host trees: a verify side sizes the feeds by its tree depth, the count first)
               "chain_feeds": exporter.allocate("chain_feeds", (MAX_SEQS, CHAIN + 2), torch.int64),
               "chain_trees": exporter.allocate("chain_trees", (4, *trees), torch.int64),
               "embedding": exporter.share("embedding", embedding)}
    remote = RemoteDraft(exporter, buffers, capture, timeout_s=10.0,
                         step_socket_folder=unix_socket_path(internal).parent if step_socket.supported() else None)
    model = SimpleNamespace(model=SimpleNamespace(embed_tokens=SimpleNamespace(weight=embedding)))
    target = SimpleNamespace(device=torch.device(device), dtype=torch.float32, max_model_len=4096, model_config=config,
                             model=model)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=[NO_PORT_SHARING])
    servicer = DraftLinkServicer(remote, target, TreeSettings("chain", depth=CHAIN), str(model_dir))
    add_parsed_servicer(servicer, draft_link_pb2.DESCRIPTOR.services_by_name["DraftLink"], server)
    bind(server, internal)
    server.start()
    return server, remote, exporter, capture


def percentiles(values_ns: list[int]) -> dict:
    ordered = sorted(values_ns)
    pick = lambda q: round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e3, 1)  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": round(ordered[-1] / 1e3, 1)}


class Sampler:
    """Steps of ``batch`` sequences through one link, timed: the link itself (whichever transport
    carries the step), the whole ``RemoteDraft.step``, and the service's overhead figure."""

    def __init__(self, remote, capture, batch: int, device: str):
        import numpy as np
        import torch

        from link.protocol import ProposeRequest

        self.remote, self.batch, self.position = remote, batch, 0
        self.features = torch.randn(ROWS_PER_FEED, len(capture) * TARGET["hidden_size"], device=device)
        self.tokens = np.arange(ROWS_PER_FEED, dtype=np.int64)
        self.asks = [ProposeRequest(seq_id, max_depth=CHAIN) for seq_id in range(1, batch + 1)]
        self.links, self.steps, self.overhead = [], [], []
        for name in ("_exchange_stream", "_exchange_socket"):  # time the link, whichever carries the step
            setattr(remote, name, timed(getattr(type(remote), name).__get__(remote), self.links))

    def run(self, steps: int, keep: bool = True) -> None:
        from link.protocol import DraftFeed

        links_before = len(self.links)
        for _ in range(steps):
            feeds = [DraftFeed(seq_id, self.position, self.features, self.tokens)
                     for seq_id in range(1, self.batch + 1)]
            t0 = time.perf_counter_ns()
            trees = self.remote.step(feeds, self.asks)
            elapsed = time.perf_counter_ns() - t0
            assert len(trees) == self.batch and all(t.num_nodes == CHAIN for t in trees.values()), "no answer"
            self.steps.append(elapsed)
            self.position = self.position + ROWS_PER_FEED if self.position < 4000 else 0  # inside the context
        self.overhead += list(self.remote.overhead_ns)[-steps:]
        if not keep:  # a warm-up
            del self.links[links_before:], self.steps[-steps:], self.overhead[-steps:]

    def release(self) -> None:
        for seq_id in range(1, self.batch + 1):
            self.remote.release(seq_id)

    def report(self) -> dict:
        return {"batch": self.batch, "steps": len(self.steps), "link_us": percentiles(self.links),
                "step_us": percentiles(self.steps), "overhead_us": percentiles(self.overhead)}


def timed(exchange, into: list[int]):
    def run(*args):
        t0 = time.perf_counter_ns()
        reply = exchange(*args)
        into.append(time.perf_counter_ns() - t0)
        return reply
    return run


class Link:
    """One verify side and its draft process, on a socket folder of its own."""

    def __init__(self, transport: str, tmp: Path, model_dir: Path, head_dir: Path, device: str):
        internal = f"unix:{tmp}/{transport}/draft.sock"
        self.device = device
        self.server, self.remote, self.exporter, self.capture = verify_side(model_dir, internal, device)
        self.child = mp.get_context("spawn").Process(target=draft_process, daemon=True,
                                                     args=(str(head_dir), internal, transport, device))
        self.child.start()
        deadline = time.monotonic() + 120
        while not self.remote.connected:
            assert self.child.is_alive() and time.monotonic() < deadline, "the draft never connected"
            time.sleep(0.05)
        self.transport = "socket" if self.remote._session.step_socket is not None else "stream"

    def close(self) -> None:
        self.child.kill()
        self.child.join(10)
        self.remote.close()
        self.server.stop(0).wait()
        self.exporter.close()


def compare(links: list[Link], batch: int, steps: int, warmup: int, chunk: int = 250) -> list[dict]:
    """``steps`` per link, in turns of ``chunk``: a shared machine's load falls on each link alike."""
    samplers = [Sampler(link.remote, link.capture, batch, link.device) for link in links]
    for sampler in samplers:
        sampler.run(warmup, keep=False)
    for start in range(0, steps, chunk):
        for sampler in samplers:
            sampler.run(min(chunk, steps - start))  # (--steps not a multiple of the chunk: the last turn shorter)
    rows = []
    for link, sampler in zip(links, samplers):
        sampler.release()
        rows.append({"transport": link.transport, **sampler.report()})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--transport", action="append", choices=["stream", "socket"],
                    help="the draft's step transport, repeatable (default: both)")
    ap.add_argument("--batch", type=int, action="append", help="sequences per step, repeatable (default: 1)")
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--device", default="cpu", help="cpu (shared host memory) or cuda (CUDA IPC features)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.transport, args.batch = args.transport or ["stream", "socket"], args.batch or [1]

    import torch

    from draft_service.eagle_init import write_random_head

    tmp = Path(tempfile.mkdtemp(prefix="eagle3-rtt-"))
    model_dir = tmp / "target"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(TARGET))
    head_dir = write_random_head(tmp / "head", TARGET, draft_vocab=256)
    load_before = os.getloadavg()  # on a shared machine the tails move with the neighbours' load
    links = []
    try:
        links = [Link(transport, tmp, model_dir, head_dir, args.device) for transport in args.transport]
        rows = [row for batch in args.batch for row in compare(links, batch, args.steps, args.warmup)]
    finally:
        for link in links:
            link.close()
    report = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
              "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "load_average_1m": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
              "steps": args.steps, "rows_per_feed": ROWS_PER_FEED, "tree_nodes": CHAIN, "results": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
