"""Soak: concurrent streaming clients against both services for a bounded time, with faults.

Clients send greedy requests (each must equal its sequential reference, token for token),
seeded sampled requests (each must come back whole: exactly ``--max-tokens`` tokens, since
end-of-sequence is ignored), requests they cancel mid-stream and requests with a short
deadline. Meanwhile the draft service is killed (SIGKILL) at random moments and restarted,
and the verify service is restarted once (SIGTERM; clients reconnect). At the end the
system must be idle with no KV block in use; the resident memory of every process is sampled
and its slope reported (MB per hour, by least squares over each process's life); on CUDA each
process's GPU memory too (``nvidia-smi``), with its slope. ``--trace-heap``: the first verify
service runs under ``tracemalloc`` (``benchmarks/traced_serve.py``) and the report gives its Python
heap at the first snapshot past the first quarter of the run and at the last, and the source lines
whose allocations grew most in between: what a growing resident size is, or is not, made of.

    python benchmarks/soak.py --clients 64 --minutes 30 --device cuda --out soak.json
    python benchmarks/soak.py --model DIR --draft DIR --clients 6 --seconds 40 --device cpu

Without ``--model`` the services run the embedded SmolLM2 and its shipped head.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import closing
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from client.eagle3_client import ClientError, Eagle3Client  # noqa: E402

TEXT_PROMPTS = ["Name three colours.", "What is two plus two?", "Write a haiku about rain.",
                "List the days of the week.", "Why is the sky blue?", "Say hello in French.",
                "What is the capital of Italy?", "Count from one to ten."]
TOKEN_PROMPTS = [[5 + i, 9, 13 + 2 * i, 7] * (1 + i % 3) for i in range(8)]  # for a model without a tokenizer


class Service:
    """A service process started from the command line; its resident memory sampled over time."""

    def __init__(self, name: str, args: list[str], log_dir: Path, heap: tuple[Path, float] | None = None):
        """``heap``: run under tracemalloc, a snapshot to the folder every so many seconds."""
        self.name = name
        self.log = open(log_dir / f"{name}-{time.monotonic_ns()}.log", "w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if heap is not None:
            env.update(SOAK_HEAP_DIR=str(heap[0]), SOAK_HEAP_EVERY_S=str(heap[1]))
        module = "benchmarks.traced_serve" if heap is not None else "cli.main"
        self.proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, stdout=self.log,
                                     stderr=subprocess.STDOUT, env=env)
        self.rss: list[tuple[float, float]] = []  # (seconds since start, MB)
        self.gpu: list[tuple[float, float]] = []  # (seconds since start, MB of GPU memory), on CUDA
        self.started = time.monotonic()

    def sample(self, gpu_mb: dict[int, float] | None = None) -> None:
        """Resident memory now, and GPU memory from one ``gpu_memory_by_pid`` reading when given."""
        now = time.monotonic() - self.started
        if gpu_mb is not None and self.proc.pid in gpu_mb:
            self.gpu.append((now, gpu_mb[self.proc.pid]))
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
            self.rss.append((now, kb / 1024))
        except (OSError, StopIteration):
            pass

    def stop(self, kill: bool = False) -> None:
        if self.proc.poll() is None:
            self.proc.kill() if kill else self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()

    def slope_mb_per_hour(self, samples: list[tuple[float, float]] | None = None) -> float | None:
        """Least-squares slope of ``samples`` (default: resident memory) after the first quarter of the
        process's life (warm-up)."""
        return slope_mb_per_hour(self.rss if samples is None else samples)


def slope_mb_per_hour(samples: list[tuple[float, float]]) -> float | None:
    """MB per hour, by least squares over (seconds, MB) samples past the first quarter; None when
    there are too few or they span under 10 s."""
    pts = samples[len(samples) // 4:]
    if len(pts) < 4 or pts[-1][0] - pts[0][0] < 10:
        return None
    n = len(pts)
    mt, mm = sum(t for t, _ in pts) / n, sum(m for _, m in pts) / n
    var = sum((t - mt) ** 2 for t, _ in pts)
    return sum((t - mt) * (m - mm) for t, m in pts) / var * 3600 if var else None


def gpu_memory_by_pid(text: str) -> dict[int, float]:
    """``nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits`` -> {pid: MB}."""
    out = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            try:
                out[int(parts[0])] = out.get(int(parts[0]), 0.0) + float(parts[1])
            except ValueError:  # "[N/A]" where the driver does not report it
                continue
    return out


def read_gpu_memory() -> dict[int, float] | None:
    """GPU memory per process now, or None where nvidia-smi is missing or fails."""
    try:
        text = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return gpu_memory_by_pid(text)


class Soak:
    def __init__(self, args: argparse.Namespace, tmp: Path):
        self.args, self.tmp = args, tmp
        self.public, self.internal = f"unix:{tmp}/public.sock", f"unix:{tmp}/run/draft.sock"
        self.client = Eagle3Client(self.public, timeout_s=args.request_timeout_s)
        self.services: list[Service] = []
        self.verify = self.draft = None
        self.lock = threading.Lock()
        self.counts = {k: 0 for k in ("greedy_completed", "sampled_completed", "cancelled", "deadline_exceeded",
                                      "interrupted", "mismatched", "wrong_length", "errors")}
        self.error_samples: list[str] = []
        self.reference: dict[int, list[int]] = {}
        has_tokenizer = args.model is None or (Path(args.model) / "tokenizer.json").is_file()
        self.prompts = TEXT_PROMPTS if has_tokenizer else TOKEN_PROMPTS
        self.stop_at = 0.0

    # --- processes ---------------------------------------------------------------------------

    def start_verify(self) -> None:
        a = self.args
        flags = ["serve-verify", "--listen", self.public, "--internal", self.internal, "--device", a.device,
                 "--max-num-seqs", str(a.max_num_seqs)]
        flags += ["--model", a.model] if a.model else []
        flags += ["--dtype", a.dtype] if a.dtype else []
        traced = a.trace_heap and not self.services  # the first verify service only
        self.verify = Service("verify", flags + a.verify_arg, self.tmp,
                              (self.tmp / "heap", a.heap_every_s) if traced else None)
        self.services.append(self.verify)
        self.client.wait_until_healthy(300)

    def start_draft(self) -> None:
        flags = ["serve-draft", "--verify", self.internal, "--listen", f"unix:{self.tmp}/draft-health.sock",
                 "--device", self.args.device, "--reconnect-max-s", "0.5"]
        flags += ["--draft", self.args.draft] if self.args.draft else []
        self.draft = Service("draft", flags, self.tmp)
        self.services.append(self.draft)

    def faults(self) -> None:
        """Kill the draft at random moments (then restart it); restart the verify service once."""
        a = self.args
        rng = random.Random(a.seed + 1)
        restart_verify_at = time.monotonic() + a.duration_s * 0.5
        verify_restarted = a.verify_restarts == 0
        while time.monotonic() < self.stop_at - a.kill_every_s:
            time.sleep(rng.uniform(0.5, 1.5) * a.kill_every_s)
            if not verify_restarted and time.monotonic() >= restart_verify_at:
                self.verify.stop()  # SIGTERM; clients see UNAVAILABLE and come back
                self.start_verify()
                self.verify_restarts += 1
                verify_restarted = True
                continue
            self.draft.stop(kill=True)
            self.draft_kills += 1
            time.sleep(rng.uniform(0.2, 2.0))
            self.start_draft()

    def sampler(self) -> None:
        while time.monotonic() < self.stop_at:
            gpu = read_gpu_memory() if self.args.device.startswith("cuda") else None
            for s in list(self.services):
                if s.proc.poll() is None:
                    s.sample(gpu)
            time.sleep(self.args.sample_every_s)

    # --- clients -----------------------------------------------------------------------------

    def count(self, key: str, sample: str | None = None) -> None:
        with self.lock:
            self.counts[key] += 1
            if sample and len(self.error_samples) < 20:
                self.error_samples.append(sample)

    def run_client(self, index: int) -> None:
        a = self.args
        rng = random.Random(a.seed * 1000 + index)
        while time.monotonic() < self.stop_at:
            p = rng.randrange(len(self.prompts))
            kind = rng.choices(["greedy", "sampled", "cancel", "deadline"], weights=[60, 25, 10, 5])[0]
            try:
                if kind == "cancel":
                    with closing(self.client.generate(self.prompts[p], max_tokens=a.max_tokens, ignore_eos=True)) as stream:
                        for i, _ in enumerate(stream):
                            if i >= rng.randrange(1, 4):
                                break
                    self.count("cancelled")
                    continue
                if kind == "deadline":
                    try:
                        list(self.client.generate(self.prompts[p], max_tokens=a.max_tokens, ignore_eos=True,
                                                  timeout_s=rng.uniform(0.05, 0.5)))
                    except ClientError as err:
                        if err.code != "DEADLINE_EXCEEDED":
                            raise
                        self.count("deadline_exceeded")
                    continue
                sampled = kind == "sampled"
                out = self.client.complete(self.prompts[p], max_tokens=a.max_tokens, ignore_eos=True,
                                           temperature=0.8 if sampled else None,
                                           seed=rng.randrange(2**32) if sampled else None)
                if len(out.token_ids) != a.max_tokens:
                    self.count("wrong_length", f"{kind} prompt {p}: {len(out.token_ids)} tokens")
                elif sampled:
                    self.count("sampled_completed")
                elif out.token_ids != self.reference[p]:
                    self.count("mismatched", f"prompt {p}: {out.token_ids} != {self.reference[p]}")
                else:
                    self.count("greedy_completed")
            except ClientError as err:
                if err.code in ("UNAVAILABLE", "CANCELLED"):  # the verify service restarting
                    self.count("interrupted")
                    time.sleep(0.2)
                else:
                    self.count("errors", f"{kind}: {err}")

    def run(self) -> dict:
        a = self.args
        self.draft_kills = self.verify_restarts = 0
        self.start_verify()
        self.start_draft()
        self.client.wait_until_healthy(300, "eagle3.speculation")
        for p, prompt in enumerate(self.prompts):  # the sequential references, one request at a time
            self.reference[p] = self.client.complete(prompt, max_tokens=a.max_tokens, ignore_eos=True).token_ids
        started = time.monotonic()
        self.stop_at = started + a.duration_s
        threads = [threading.Thread(target=self.run_client, args=(i,), daemon=True) for i in range(a.clients)]
        threads += [threading.Thread(target=self.faults, daemon=True), threading.Thread(target=self.sampler, daemon=True)]
        for t in threads:
            t.start()
        for t in threads:  # the clients, then the faults (no fault after the run), then the sampler
            t.join()
        elapsed = time.monotonic() - started
        self.client.wait_until_healthy(300)  # a verify restart may still be loading
        kv_used = None
        for _ in range(100):  # idle: every request finished or cancelled
            m = self.client.metrics()
            kv_used = int(m.get("kv_blocks_used", 0))
            if kv_used == 0 and int(m.get("running_requests", 0)) == 0:
                break
            time.sleep(0.1)
        slopes = {f"{s.name}_{i}": s.slope_mb_per_hour() for i, s in enumerate(self.services)}
        long_lived = [v for s, v in zip(self.services, slopes.values()) if v is not None
                      and s.rss and s.rss[-1][0] >= 0.3 * elapsed]
        return {"minutes": round(elapsed / 60, 2), "clients": a.clients, **self.counts,
                "completed_requests": self.counts["greedy_completed"] + self.counts["sampled_completed"],
                "draft_kills": self.draft_kills, "verify_restarts": self.verify_restarts,
                "kv_blocks_used_idle": kv_used, "rss_slope_mb_per_hour": slopes,
                "max_rss_slope_mb_per_hour": max(long_lived) if long_lived else None,
                "rss_mb_last": {f"{s.name}_{i}": s.rss[-1][1] if s.rss else None for i, s in enumerate(self.services)},
                "gpu_slope_mb_per_hour": {f"{s.name}_{i}": s.slope_mb_per_hour(s.gpu)
                                          for i, s in enumerate(self.services) if s.gpu},
                "gpu_mb_last": {f"{s.name}_{i}": s.gpu[-1][1] for i, s in enumerate(self.services) if s.gpu},
                **({"heap": heap_growth(self.tmp / "heap")} if a.trace_heap else {}),
                "error_samples": self.error_samples}

    def close(self) -> None:
        for s in self.services:
            s.stop()
        self.client.close()


def heap_growth(folder: Path, top: int = 10) -> dict:
    """The traced service's Python heap: MB at the first snapshot past the first quarter of its
    snapshots (warm-up) and at the last, and the ``top`` source lines whose live allocations grew
    most in between (KB, blocks)."""
    import tracemalloc
    paths = sorted(folder.glob("heap_*.pickle"))
    if len(paths) < 2:
        return {"snapshots": len(paths)}
    skip = [tracemalloc.Filter(False, tracemalloc.__file__)]
    first = tracemalloc.Snapshot.load(str(paths[len(paths) // 4])).filter_traces(skip)
    last = tracemalloc.Snapshot.load(str(paths[-1])).filter_traces(skip)
    mb = [round(sum(t.size for t in s.traces) / 2**20, 3) for s in (first, last)]
    grew = [d for d in last.compare_to(first, "lineno") if d.size_diff > 0][:top]
    return {"snapshots": len(paths), "first_mb": mb[0], "last_mb": mb[1], "growth_kb": round((mb[1] - mb[0]) * 1024, 1),
            "top_growth": [{"line": str(d.traceback), "kb": round(d.size_diff / 1024, 1), "blocks": d.count_diff}
                           for d in grew]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="target directory (default: the embedded SmolLM2)")
    ap.add_argument("--draft", default=None, help="EAGLE-3 head directory (default: the shipped SmolLM2 head)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--clients", type=int, default=8)
    length = ap.add_mutually_exclusive_group()
    length.add_argument("--minutes", type=float, default=None)
    length.add_argument("--seconds", type=float, default=None)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--kill-every-s", type=float, default=20.0, help="mean time between draft kills")
    ap.add_argument("--verify-restarts", type=int, default=1, choices=[0, 1])
    ap.add_argument("--request-timeout-s", type=float, default=300.0)
    ap.add_argument("--sample-every-s", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verify-arg", action="append", default=[], help="extra serve-verify flag (repeatable)")
    ap.add_argument("--trace-heap", action="store_true", help="the first verify service under tracemalloc")
    ap.add_argument("--heap-every-s", type=float, default=60.0, help="seconds between heap snapshots")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.duration_s = 60 * args.minutes if args.minutes is not None else (args.seconds or 60.0)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="eagle3-soak-") as tmp:
        (Path(tmp) / "run").mkdir(mode=0o700)
        soak = Soak(args, Path(tmp))
        try:
            result = soak.run()
        finally:
            soak.close()
    print(json.dumps({k: v for k, v in result.items() if k != "error_samples"}, indent=1))
    for line in result["error_samples"]:
        print("  ", line[:300])
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
