"""The verify service's own overhead: plain decoding (no draft) of N concurrent streaming Generate
requests through the service, against the same engine in process decoding N sequences together,
on a tiny random-weight Llama (the model costs little, so what the service adds shows).

    .venv/bin/python benchmarks/services_overhead.py --concurrency 1 --concurrency 16 --rounds 5 \\
        --max-tokens 128 --stream-interval-ms 0 --stream-interval-ms 10 --out overhead.json

One service process per ``--stream-interval-ms`` (default: 0 and the service's default) and
``--stream-messages-per-s`` (default: the service's; rows keyed "interval/budget"). Rounds
alternate in-process and service runs, so a noisy host slows both alike; rows report the medians
of: tokens/s, engine steps/s (the service's from GetMetrics), tokens per response message, and
CPU seconds per second of the service process and of this (client) process. Both sides run torch
with ``--torch-threads`` (default 1): on a small host, intra-op threads would take the cores the
service's gRPC threads and the client need, and measure the host rather than the service.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cli.up import spawn, wait_healthy  # noqa: E402
from client.eagle3_client import Eagle3Client  # noqa: E402
from common.config import ModelConfig  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402
from tools.evaluate import run  # noqa: E402
from tools.inprocess import build_engine  # noqa: E402
from verify_service.config import EngineConfig  # noqa: E402
from verify_service.loader import random_tensors  # noqa: E402
from verify_service.server_config import DEFAULT_STREAM_INTERVAL_MS, DEFAULT_STREAM_MESSAGES_PER_S  # noqa: E402

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 1024, "eos_token_id": 96, "bos_token_id": 95,
}
PROMPT_TOKENS = 16


def write_tiny_model(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(TINY_LLAMA))
    tensors = random_tensors(ModelConfig.from_hf(TINY_LLAMA), seed=0, std=0.1)
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    return root


def prompts(n: int) -> list[list[int]]:
    return [[(7 * i + j) % 90 + 1 for j in range(PROMPT_TOKENS)] for i in range(n)]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class InProcess:
    """The engine in this process, every ``Engine.step`` counted."""

    def __init__(self, model: Path, batch: int):
        self.engine = build_engine(EngineConfig(str(model), device="cpu", dtype="float32", max_num_seqs=batch))
        self.steps = 0
        step = self.engine.step

        def counted():
            self.steps += 1
            return step()
        self.engine.step = counted
        run(self.engine, prompts(2), SamplingParams(max_tokens=8, ignore_eos=True), 2)  # warm-up

    def round(self, c: int, max_tokens: int) -> dict:
        self.steps = 0
        cpu = time.process_time()
        outputs, secs, _ = run(self.engine, prompts(c), SamplingParams(max_tokens=max_tokens, ignore_eos=True), c)
        return {"tokens_per_s": sum(map(len, outputs)) / secs, "steps_per_s": self.steps / secs,
                "process_cpu_per_s": (time.process_time() - cpu) / secs}


def service_round(client: Eagle3Client, pid: int, c: int, max_tokens: int) -> dict:
    """``c`` streams at once, each on its own thread, all started together."""
    tokens, messages = [0] * c, [0] * c
    barrier = threading.Barrier(c + 1)

    def stream(i: int) -> None:
        barrier.wait()
        for event in client.generate(prompts(c)[i], max_tokens=max_tokens, ignore_eos=True):
            tokens[i] += len(event.token_ids)
            messages[i] += bool(event.token_ids)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(c)]
    for t in threads:
        t.start()
    before = client.metrics()["plain_steps"]
    server_cpu, client_cpu = cpu_seconds(pid), time.process_time()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    secs = time.perf_counter() - start
    assert tokens == [max_tokens] * c, tokens
    return {"tokens_per_s": sum(tokens) / secs, "steps_per_s": (client.metrics()["plain_steps"] - before) / secs,
            "tokens_per_message": sum(tokens) / sum(messages),
            "server_cpu_per_s": (cpu_seconds(pid) - server_cpu) / secs,
            "client_cpu_per_s": (time.process_time() - client_cpu) / secs}


def medians(rows: list[dict]) -> dict:
    return {k: round(statistics.median(r[k] for r in rows), 2) for k in rows[0]}


def start_services(model: Path, tmp: Path, settings: list[tuple[float, float]], batch: int) -> dict:
    """'interval ms/messages a second' -> (process, client) for each (interval, message budget), every
    service healthy and warmed up."""
    services = {}
    for ms, budget in settings:
        key = f"{ms:g}/{budget:g}"
        public = f"unix:{tmp}/public-{ms:g}-{budget:g}.sock"
        proc = spawn(["serve-verify", "--model", str(model), "--listen", public, "--no-speculation", "--device",
                      "cpu", "--dtype", "float32", "--max-num-seqs", str(batch), "--stream-interval-ms", f"{ms:g}",
                      "--stream-messages-per-s", f"{budget:g}"], tmp / f"verify-{ms:g}-{budget:g}.log")
        services[key] = proc, Eagle3Client(public, timeout_s=600)
        wait_healthy(services[key][1], "", proc, "verify service")
        services[key][1].complete(prompts(1)[0], max_tokens=8, ignore_eos=True)  # warm-up
    return services


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, action="append", help="requests in flight (default: 1 and 16)")
    ap.add_argument("--stream-interval-ms", type=float, action="append",
                    help=f"a service per value (default: 0 and {DEFAULT_STREAM_INTERVAL_MS:g}, the service's default)")
    ap.add_argument("--stream-messages-per-s", type=float, action="append",
                    help=f"a service per value and interval (default: {DEFAULT_STREAM_MESSAGES_PER_S:g}, the "
                         "service's default; 0: no bound)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    levels = sorted(set(args.concurrency or [1, 16]))
    intervals = sorted(set(args.stream_interval_ms or [0.0, DEFAULT_STREAM_INTERVAL_MS]))
    budgets = sorted(set(args.stream_messages_per_s or [DEFAULT_STREAM_MESSAGES_PER_S]))
    settings = [(ms, b) for ms in intervals for b in budgets]
    torch.set_num_threads(args.torch_threads)
    os.environ["OMP_NUM_THREADS"] = str(args.torch_threads)  # the services inherit it
    tmp = Path(tempfile.mkdtemp(prefix="eagle3-overhead-"))
    model = write_tiny_model(tmp / "model")
    local = InProcess(model, max(levels))
    services = start_services(model, tmp, settings, max(levels))
    report = {"max_tokens": args.max_tokens, "rounds": args.rounds, "torch_threads": args.torch_threads, "runs": []}
    try:
        for c in levels:
            rows = {"in_process": []} | {key: [] for key in services}
            for _ in range(args.rounds):
                rows["in_process"].append(local.round(c, args.max_tokens))
                for key, (proc, client) in services.items():
                    rows[key].append(service_round(client, proc.pid, c, args.max_tokens))
            row = {"concurrency": c, "in_process": medians(rows["in_process"]),
                   "service_by_interval_ms_and_messages_per_s": {key: medians(rows[key]) for key in services}}
            row["service_vs_in_process"] = {key: round(r["tokens_per_s"] / row["in_process"]["tokens_per_s"], 3)
                                            for key, r in row["service_by_interval_ms_and_messages_per_s"].items()}
            report["runs"].append(row)
            print(json.dumps(row), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2))
    finally:
        for proc, client in services.values():
            client.close()
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
