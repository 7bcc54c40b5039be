"""Health checks and GetMetrics latency while N streams hold the verify service busy.

Starts a verify service, opens ``--streams`` long greedy streams (more than its batch slots, so
some run and the rest wait), then times ``--probes`` health checks and GetMetrics calls::

    python benchmarks/health_under_load.py --streams 256 --probes 200 --out health.json
    (--model DIR: another target; default: the embedded SmolLM2)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from client.eagle3_client import ClientError, Eagle3Client  # noqa: E402


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--probes", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="eagle3-health-") as tmp:
        public = f"unix:{tmp}/public.sock"
        cmd = [sys.executable, "-m", "cli.main", "serve-verify", "--no-speculation", "--listen", public,
               "--device", args.device, "--max-num-seqs", str(args.max_num_seqs),
               "--max-open-streams", str(args.streams), "--max-queued-requests", str(args.streams)]
        cmd += ["--model", args.model] if args.model else []
        log = open(Path(tmp) / "verify.log", "w")
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        client = Eagle3Client(public, timeout_s=600)
        try:
            client.wait_until_healthy(600)

            def stream(i: int) -> None:
                try:
                    client.complete(f"Tell me a long story about the number {i}.", max_tokens=100_000, ignore_eos=True)
                except ClientError:
                    pass

            for i in range(args.streams):
                threading.Thread(target=stream, args=(i,), daemon=True).start()
            deadline = time.monotonic() + 300
            while True:
                m = client.metrics(timeout_s=30)
                if int(m.get("running_requests", 0)) + int(m.get("waiting_requests", 0)) >= args.streams:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"only {m} after 300 s")
                time.sleep(0.2)
            health, metrics = [], []
            for _ in range(args.probes):
                t0 = time.perf_counter()
                assert client.health(timeout_s=30) == "SERVING"
                health.append((time.perf_counter() - t0) * 1e3)
                t0 = time.perf_counter()
                m = client.metrics(timeout_s=30)
                metrics.append((time.perf_counter() - t0) * 1e3)
                time.sleep(0.02)
            result = {"streams": args.streams, "running": int(m["running_requests"]),
                      "waiting": int(m["waiting_requests"]), "probes": args.probes,
                      "health_p50_ms": round(percentile(health, 0.5), 2), "health_p99_ms": round(percentile(health, 0.99), 2),
                      "metrics_p50_ms": round(percentile(metrics, 0.5), 2),
                      "metrics_p99_ms": round(percentile(metrics, 0.99), 2)}
        finally:
            proc.terminate()
            proc.wait(60)
            client.close()
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
