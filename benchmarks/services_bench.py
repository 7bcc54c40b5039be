"""Both services as processes on one device: output agreement with the in-process target-only
engine, end-to-end tokens/s with speculation and without it (the same server, per-request
``speculate=False``), the in-process speculative engine's tokens/s with the same tree (the link's
whole cost: services / in process), all side by side in one run at each ``--concurrency``, and the
per-step control-plane overhead of the draft link.

The in-process engine runs each level twice: as the generator (``Engine.generate`` on groups of
``--concurrency`` prompts, each group to its end) and with the services' client's arrivals
(``concurrency`` requests in flight, the next prompt added as one finishes:
``inprocess_continuous_tokens_per_s``). The second is the same workload as through the services,
so ``services_vs_inprocess_continuous`` is the services' own cost alone.

    python benchmarks/services_bench.py --prompts mt_bench.jsonl --limit 16 --max-tokens 128 \\
        --head default --tree dynamic:7 --concurrency 1 --concurrency 16 --out services.json

The control-plane overhead is, per draft round trip, the time not spent computing: gRPC
messages, thread hand-offs, shared-buffer synchronisation (reported by the verify service; for
chained steps, the verify side's wait for the draft's answer). Each row also gives tau (tokens per
verification step over the speculated requests, from their own speculation metrics) and the
efficiency, speed-up over plain decoding divided by tau.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import phased_serve  # noqa: E402
from benchmarks.step_timeline import patched  # noqa: E402
from cli.up import spawn, wait_healthy  # noqa: E402
from client.eagle3_client import Eagle3Client  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402
from common.tree_settings import TreeSettings, default_tree  # noqa: E402
from draft_service.spec_config import SpecConfig  # noqa: E402
from draft_service.eagle_init import write_random_head  # noqa: E402
from hub.default_model import ensure_default_model  # noqa: E402
from tools.evaluate import run, run_continuous  # noqa: E402
from tools.inprocess import build_engine  # noqa: E402
from tools.train.data import load_prompts  # noqa: E402
from verify_service.config import EngineConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--head", default="random")
    ap.add_argument("--tree", default="chain:3", help="TREE:DEPTH[:TOP_K[:NODES]] (the services' tree; unset parts: "
                                                      "the device's defaults)")
    ap.add_argument("--concurrency", type=int, action="append",
                    help="requests in flight at once (default 1); each value is a run, in the order given (a value "
                         "given twice runs twice on the same server: its first and a later run), the in-process "
                         "engine decoding as many sequences together")
    ap.add_argument("--adaptive-speculation", default="off", choices=["on", "off"],
                    help="the verify service picks each step's tree size (or plain decoding)")
    ap.add_argument("--exact", action=argparse.BooleanOptionalAction, default=None,
                    help="batch-invariant numerics on the verify service and the in-process engine, or not "
                         "(default: the engine's default, on on CUDA)")
    ap.add_argument("--stream-interval-ms", type=float, default=None,
                    help="the verify service's --stream-interval-ms (default: its own default)")
    ap.add_argument("--stream-messages-per-s", type=float, default=None,
                    help="the verify service's --stream-messages-per-s (default: its own default; 0: no bound)")
    ap.add_argument("--chained-steps", default="on", choices=["on", "off"],
                    help="the draft service's --chained-steps (off: every step's rows and trees through the host)")
    ap.add_argument("--chain-min-seqs", type=int, default=None,
                    help="the verify service's --chain-min-seqs (default: its own default)")
    ap.add_argument("--py-spy", type=int, default=0, metavar="SECONDS",
                    help="sample both services and this client with py-spy (installed) for this long at the start of "
                         "each speculative run; raw stacks beside --out")
    ap.add_argument("--py-spy-gil", action="store_true",
                    help="with --py-spy: sample only the thread holding the GIL (py-spy --gil), not every thread: "
                         "which threads take it, and where")
    ap.add_argument("--phases", action="store_true",
                    help="time the verify engine's host phases, wall and CPU, per step (benchmarks/phased_serve.py), "
                         "and the in-process engine's in one more continuous run per level: where the services' steps "
                         "lose their time (the instrumentation costs both sides alike)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    levels = args.concurrency or [1]
    model = str(ensure_default_model(progress=False))
    tmp = Path(tempfile.mkdtemp(prefix="eagle3-bench-"))
    head = args.head
    if head == "random":
        head = str(tmp / "head")
        write_random_head(head, json.loads((Path(model) / "config.json").read_text()), 8192)
    tree = tree_settings(args.tree, args.device)
    texts = load_prompts(args.prompts, args.limit)
    cfg = EngineConfig(model, device=args.device, dtype=args.dtype, max_model_len=4096, max_num_seqs=max(levels),
                       exact=args.exact)
    params = SamplingParams(max_tokens=args.max_tokens)

    # In process, same device and dtype: target-only (the outputs to agree with), then speculative.
    engine = build_engine(cfg)
    prompts = [engine.target.encode(messages=[{"role": "user", "content": t}]) for t in texts]
    reference = run(engine, prompts, params, 1)[0]  # one at a time, as the services' outputs are compared at 1
    del engine
    spec = SpecConfig(head, tree.tree, tree.depth, tree.top_k, tree.max_nodes)
    engine = build_engine(cfg, spec, adaptive=args.adaptive_speculation == "on")
    run(engine, prompts[:2], SamplingParams(max_tokens=8), 1)  # warm-up
    inprocess = {c: run(engine, prompts, params, c) for c in levels}
    continuous = {c: run_continuous(engine, prompts, params, c) for c in levels}
    inprocess_phases = {c: phased_continuous(engine, prompts, params, c) for c in levels} if args.phases else {}
    del engine
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()

    public, internal = f"unix:{tmp}/public.sock", f"unix:{tmp}/draft.sock"
    flags = ["--tree", tree.tree, "--tree-depth", str(tree.depth), "--tree-top-k", str(tree.top_k),
             "--tree-nodes", str(tree.max_nodes), "--device", args.device]
    verify = spawn(["serve-verify", "--model", model, "--listen", public, "--internal", internal, "--dtype",
                    args.dtype, "--max-model-len", "4096", "--max-num-seqs", str(max(8, max(levels))),
                    "--adaptive-speculation", args.adaptive_speculation, *flags,
                    *([] if args.exact is None else ["--exact" if args.exact else "--no-exact"]),
                    *([] if args.stream_interval_ms is None else
                      ["--stream-interval-ms", str(args.stream_interval_ms)]),
                    *([] if args.stream_messages_per_s is None else
                      ["--stream-messages-per-s", str(args.stream_messages_per_s)]),
                    *([] if args.chain_min_seqs is None else ["--chain-min-seqs", str(args.chain_min_seqs)])],
                   tmp / "verify.log", **({"module": "benchmarks.phased_serve",
                                           "env": {phased_serve.ENV_OUT: str(tmp / "phases.json"),
                                                   phased_serve.ENV_SWITCH: os.environ.get(phased_serve.ENV_SWITCH, "")}}
                                          if args.phases else {}))
    draft = None
    try:
        client = Eagle3Client(public, timeout_s=600)
        wait_healthy(client, "", verify, "verify service")
        draft = spawn(["serve-draft", "--draft", head, "--verify", internal, "--listen", f"unix:{tmp}/dh.sock",
                       "--chained-steps", args.chained_steps, *flags], tmp / "draft.log",
                      **({"module": "benchmarks.phased_serve",
                          "env": {phased_serve.ENV_OUT: str(tmp / "draft_phases.json")}} if args.phases else {}))
        wait_healthy(client, "eagle3.speculation", draft, "draft service")
        client.complete(prompts[0], max_tokens=8)  # warm-up
        report = {"device": args.device, "dtype": args.dtype, "tree": tree.describe(),
                  "exact": client.server_info()["exact_numerics"],
                  "adaptive_speculation": args.adaptive_speculation, "stream_interval_ms": args.stream_interval_ms,
                  "stream_messages_per_s": args.stream_messages_per_s,
                  "chained_steps": args.chained_steps, "chain_min_seqs": args.chain_min_seqs,
                  "prompts": len(prompts),
                  "max_tokens": args.max_tokens, "runs": []}
        for c in levels:
            phases_before = idle_phases(tmp / "phases.json") if args.phases else None
            draft_before = phased_serve.read(tmp / "draft_phases.json") if args.phases else None
            before = client.metrics()
            spies = py_spy([verify, draft, None], args.py_spy, args.out, c, args.py_spy_gil)
            timings = []
            rows, secs = through_services(client, prompts, args.max_tokens, c, True, timings)
            for spy in spies:
                spy.wait(60)
            steps = {k: client.metrics()[k] - before[k]
                     for k in ("speculative_steps", "plain_steps", "chained_steps", "decode_steps_ahead")}
            phases = None if phases_before is None else {
                "services": phased_serve.per_step(phases_before, idle_phases(tmp / "phases.json"),
                                                  max(1, steps["speculative_steps"] + steps["plain_steps"])),
                "inprocess": inprocess_phases[c], "draft": draft_per_answer(draft_before, tmp / "draft_phases.json")}
            plain_before = client.metrics()
            plain, plain_secs = through_services(client, prompts, args.max_tokens, c, False)
            plain_after = client.metrics()
            # The plain run's steps launched ahead (target-only decoding's pipelining), of its plain steps.
            plain_steps = {k: plain_after[k] - plain_before[k] for k in ("plain_steps", "decode_steps_ahead")}
            outputs, in_secs, _ = inprocess[c]
            tokens = sum(len(t) for t, _ in rows)
            row = {"concurrency": c, "identical_outputs": sum(t == r for (t, _), r in zip(rows, reference)),
                   "tokens": tokens, "tokens_per_s": round(tokens / secs, 1),
                   "plain_tokens_per_s": round(sum(len(t) for t, _ in plain) / plain_secs, 1),
                   "inprocess_tokens_per_s": round(sum(len(o) for o in outputs) / in_secs, 1),
                   "inprocess_continuous_tokens_per_s": round(continuous[c][0] / continuous[c][1], 1),
                   "plain_identical_outputs": sum(t == r for (t, _), r in zip(plain, reference)),
                   "plain_run_steps": plain_steps,
                   "speculated_requests": sum(bool(s and s.get("speculated")) for _, s in rows),
                   "steps": steps,
                   "step_ms": round(secs * 1e3 / max(1, steps["speculative_steps"] + steps["plain_steps"]), 3),
                   "inprocess_continuous_step_ms": round(continuous[c][1] * 1e3 / max(1, continuous[c][2]), 3),
                   **request_timings(timings), **({"phases_ms_per_step": phases} if phases else {})}
            row["speedup_vs_plain"] = round(row["tokens_per_s"] / row["plain_tokens_per_s"], 3)
            spec = [s for _, s in rows if s and s.get("speculated")]
            verified = sum(s["steps"] for s in spec)  # tau: tokens per verification step, the bonus included
            row["tau"] = round(sum(s["accepted_tokens"] + s["steps"] for s in spec) / verified, 3) if verified else 0.0
            row["efficiency"] = round(row["speedup_vs_plain"] / row["tau"], 3) if row["tau"] else 0.0
            row["services_vs_inprocess"] = round(row["tokens_per_s"] / row["inprocess_tokens_per_s"], 3)
            row["services_vs_inprocess_continuous"] = round(
                row["tokens_per_s"] / row["inprocess_continuous_tokens_per_s"], 3)
            report["runs"].append(row)
            print(json.dumps(row), flush=True)
        metrics = client.metrics()
        report.update({k: metrics[k] for k in ("control_plane_p50_us", "control_plane_p99_us", "draft_compute_p50_us",
                                               "draft_compute_p99_us", "speculative_steps", "draft_errors")})
        print(json.dumps({k: v for k, v in report.items() if k != "runs"}), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2))
    finally:
        for p in (draft, verify):
            if p is not None:
                p.terminate()
                p.wait(30)
        if args.out:  # the services' logs beside the report
            for name in ("verify", "draft"):
                log = tmp / f"{name}.log"
                if log.exists():
                    Path(args.out).with_suffix(f".{name}.log").write_text(log.read_text()[-200_000:])


def py_spy(procs, seconds: int, out: str | None, concurrency: int, gil: bool = False) -> list[subprocess.Popen]:
    """py-spy recorders of ``procs`` (None: this process; every thread, idle samples too, 500 a second; ``gil``:
    only the thread holding the GIL) for ``seconds``; none when ``seconds`` is 0 or there is no ``out`` to put
    their files beside."""
    if seconds <= 0 or not out:
        return []
    which = "--gil" if gil else "--idle"
    return [subprocess.Popen(["py-spy", "record", "--pid", str(p.pid if p is not None else os.getpid()), "--duration",
                              str(seconds), "--rate", "500", which, "--threads", "--nonblocking", "--format", "raw",
                              "-o", str(Path(out).with_suffix(f".{name}_c{concurrency}.pyspy.txt"))],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name, p in zip(("verify", "draft", "client"), procs)]


def phased_continuous(engine, prompts, params: SamplingParams, concurrency: int) -> dict:
    """``run_continuous`` once more with the engine's host phases timed, wall and CPU
    (``phased_serve.per_step``'s form, milliseconds a step)."""
    wall: dict[str, float] = defaultdict(float)
    cpu: dict[str, float] = defaultdict(float)
    with patched(engine, wall, cpu):
        _, _, steps = run_continuous(engine, prompts, params, concurrency)
    return phased_serve.per_step({"wall_s": {}, "cpu_s": {}}, {"wall_s": wall, "cpu_s": cpu}, max(1, steps))


def draft_per_answer(before: dict, path: Path) -> dict:
    """The draft service's phases (``phased_serve.instrument_draft``) over the run, milliseconds per
    answered step; ``socket_recv``'s wall time is the draft's wait for the next frame."""
    after = phased_serve.read(path)  # (read after the verify side's: idle by then)
    calls = after.get("calls", {})
    answers = sum(calls.get(k, 0) - before.get("calls", {}).get(k, 0) for k in ("answer_chained", "answer_step"))
    return phased_serve.per_step(before, after, max(1, answers))


def idle_phases(path: Path) -> dict:
    """The verify service's cumulative phase times, read once the engine has been idle for longer than
    the file's refresh (so it holds every step run before)."""
    time.sleep(2.5 * phased_serve.EVERY_S)
    return phased_serve.read(path)


def tree_settings(text: str, device: str) -> TreeSettings:
    """``TREE:DEPTH[:TOP_K[:NODES]]``, the parts left out from the device's default tree."""
    parts = text.split(":")
    base = default_tree(device.partition(":")[0])
    top_k = int(parts[2]) if len(parts) > 2 else base.top_k
    nodes = int(parts[3]) if len(parts) > 3 else base.max_nodes
    return TreeSettings(parts[0], int(parts[1]), top_k, nodes)


def through_services(client: Eagle3Client, prompts, max_tokens: int, concurrency: int, speculate: bool,
                     timings: list | None = None):
    """Every prompt through the public API, ``concurrency`` requests in flight: [(tokens, speculation)], seconds.
    ``timings`` gets each request's (start, first token, end) on the ``time.perf_counter`` clock."""
    def one(p):
        ids, speculation, start, first = [], None, time.perf_counter(), None
        with closing(client.generate(p, max_tokens=max_tokens, speculate=speculate)) as stream:
            for event in stream:
                if event.token_ids and first is None:
                    first = time.perf_counter()
                ids += event.token_ids
                speculation = event.speculation or speculation
        if timings is not None and first is not None:
            timings.append((start, first, time.perf_counter()))
        return ids, speculation

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        rows = list(pool.map(one, prompts))
    return rows, time.perf_counter() - start


def request_timings(timings: list) -> dict:
    """The requests' time to first token, time from it to the last, and (one request in flight) the
    client's gap between a request's end and the next one's start: means in milliseconds."""
    if not timings:
        return {}
    timings = sorted(timings)
    ms = lambda xs: round(statistics.fmean(xs) * 1e3, 3) if xs else None  # noqa: E731
    gaps = [b[0] - a[2] for a, b in zip(timings, timings[1:]) if b[0] >= a[2]]
    return {"ttft_ms": ms([f - s for s, f, _ in timings]), "after_first_ms": ms([e - f for _, f, e in timings]),
            "client_gap_ms": ms(gaps)}


if __name__ == "__main__":
    main()
