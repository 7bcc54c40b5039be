"""Where a speed-report row's time goes, step by step: the engines of ``speed_report.py`` (target-only,
adaptive speculation, optionally the fixed tree) on the same prompts, each engine's rounds split by
kind of step.

    python benchmarks/row_breakdown.py --batch 64 --batch 128 --rounds 5 --out breakdown.json

Each ``Engine.step`` is timed on the host clock (a step's wall time: what the caller waits for it)
and filed under its kind, known before it runs:

- ``prefill``: the step holds a prompt chunk (or a request waits to start);
- ``plain ahead``: a plain decode step launched by the step before it (plain decoding's steady state);
- ``plain``: a plain decode step scheduled now (after prefill, a tree, or a finish);
- ``tree``: the step verifies trees laid out on the host; ``chained``: trees the draft grew on the
  device behind the last step's acceptance.

Beside the steps: the draft's calls (``drafter.step``: extends of waiting rows and tree requests) and
what a round spends outside ``step`` (requests' admission, results). Rows are the median round of
each engine; the engines run in turn, their order rotated each round, as the speed report runs them.
An adaptive row carries the policy's diagnostics (its decisions, and the steps it measured against
its model). ``--profile``: one more round of each engine under cProfile (OUT.profile.txt: host
functions by own and cumulative time, and each round's raw statistics, OUT.ENGINE.bB.pstats, for
``profile_diff.py``); ``--phases``: one more with the host phases timed by the clock alone;
``--timeline``: one more under torch.profiler, the engine's host phases
marked (``step_timeline.py``): the device's busy time against the wall, and what it waited for.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.speed_report import DEFAULT_PROMPTS, _tree_text, batch_prompts, profile_run, prompt_ids  # noqa: E402
from benchmarks.step_timeline import STEP, analyse, patched  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402
from common.tree_settings import default_tree  # noqa: E402
from hub.default_model import ensure_default_model  # noqa: E402
from tools.evaluate import parse_config, run  # noqa: E402
from tools.inprocess import build_engine  # noqa: E402
from verify_service.config import EngineConfig  # noqa: E402

KINDS = ("prefill", "plain ahead", "plain", "tree", "chained")


def step_kind(engine) -> str:
    """What the engine's next step is, read before it runs."""
    if engine._ahead_decode is not None:
        return "plain ahead"
    if engine._chained is not None:
        return "chained"
    sched = engine.scheduler
    if sched.waiting or any(s.prefilling for s in sched.running):
        return "prefill"
    return "tree" if any(s.tree is not None for s in sched.running) else "plain"


class StepClock:
    """``engine.step`` (and its drafter's ``step``) timed per call, for the ``with`` block."""

    def __init__(self, engine):
        self.engine = engine
        self.steps: dict[str, list[float]] = defaultdict(list)
        self.draft_calls: list[tuple[int, float]] = []  # (rows fed, seconds)

    def __enter__(self):
        engine, steps, calls = self.engine, self.steps, self.draft_calls
        step = engine.step

        def timed_step():
            kind = step_kind(engine)
            t = time.perf_counter()
            try:
                return step()
            finally:
                steps[kind].append(time.perf_counter() - t)

        engine.step = timed_step
        drafter = engine.drafter
        if drafter is not None:
            draft_step = drafter.step

            def timed_draft(feeds, requests):
                t = time.perf_counter()
                try:
                    return draft_step(feeds, requests)
                finally:
                    calls.append((sum(len(f.next_tokens) for f in feeds), time.perf_counter() - t))

            drafter.step = timed_draft
        return self

    def __exit__(self, *exc):
        del self.engine.step
        if self.engine.drafter is not None:
            del self.engine.drafter.step


def round_breakdown(engine, prompts, params, batch: int) -> dict:
    """One round (``run`` as the speed report runs it), split by kind of step."""
    with StepClock(engine) as clock:
        outputs, seconds, _ = run(engine, prompts, params, batch)
    row = {"seconds": seconds, "tokens": sum(len(o) for o in outputs),
           "outside_steps_ms": (seconds - sum(sum(v) for v in clock.steps.values())) * 1e3}
    for kind in KINDS:
        times = clock.steps.get(kind, [])
        row[kind] = {"steps": len(times), "ms": sum(times) * 1e3,
                     "median_ms": statistics.median(times) * 1e3 if times else None}
    row["draft_calls"] = {"calls": len(clock.draft_calls), "rows": sum(r for r, _ in clock.draft_calls),
                          "ms": sum(s for _, s in clock.draft_calls) * 1e3}
    return row


def phased_round(engine, prompts, params, batch: int) -> dict:
    """One round with the engine's host phases timed by the clock (``step_timeline.patched``): host
    milliseconds a step in each (a phase's time includes what it waits for on the device)."""
    clock: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    with patched(engine, clock):
        step = engine.step
        engine.step = lambda: calls.__setitem__(STEP, calls[STEP] + 1) or step()
        try:
            run(engine, prompts, params, batch)
        finally:
            engine.step = step
    steps = max(calls[STEP], 1)
    return {k: round(v / steps * 1e3, 4) for k, v in sorted(clock.items(), key=lambda kv: -kv[1])}


def timed_round(engine, prompts, params, batch: int) -> dict:
    """One round under torch.profiler with the engine's phases marked: ``step_timeline.analyse``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with patched(engine), profile(activities=activities) as prof:
        run(engine, prompts, params, batch)
    path = Path(tempfile.mkdtemp(prefix="eagle3-trace-")) / "trace.json"
    prof.export_chrome_trace(str(path))
    return analyse(json.loads(path.read_text()))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="target model directory (default: embedded SmolLM2)")
    ap.add_argument("--head", default="default", help="EAGLE-3 head directory, or 'default' (the shipped one)")
    ap.add_argument("--tree", default=None, help="TREE:DEPTH[:TOP_K[:NODES]] (default: the device's default tree)")
    ap.add_argument("--batch", type=int, action="append", help="batch sizes (default 64, 128)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--min-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--fixed", action="store_true", help="the fixed-tree engine too")
    ap.add_argument("--only", choices=("target-only", "fixed tree", "adaptive"), default=None,
                    help="load and run this engine alone (for a sampling profiler: one engine's stacks)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--profile", action="store_true", help="one more round per engine under cProfile")
    ap.add_argument("--timeline", action="store_true", help="one more round per engine under torch.profiler")
    ap.add_argument("--phases", action="store_true", help="one more round per engine, its host phases timed by "
                    "the clock alone (no profiler): milliseconds a step in each")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    batches = sorted(set(args.batch or [64, 128]))
    model = args.model or str(ensure_default_model(progress=False))
    spec = parse_config(args.tree or _tree_text(default_tree(args.device.partition(":")[0])), args.head)
    cfg = EngineConfig(model, device=args.device, dtype=args.dtype, max_model_len=4096, max_num_seqs=max(batches))
    wanted = [args.only] if args.only else ["target-only", *(["fixed tree"] if args.fixed else []), "adaptive"]
    builders = {"target-only": lambda: build_engine(cfg), "fixed tree": lambda: build_engine(cfg, spec),
                "adaptive": lambda: build_engine(cfg, spec, adaptive=True)}
    engines = [(name, builders[name]()) for name in wanted]
    texts, _ = batch_prompts(str(DEFAULT_PROMPTS), max(max(batches), args.min_prompts))
    prompts = prompt_ids(engines[0][1], texts)
    params = SamplingParams(max_tokens=args.max_tokens)
    for _, engine in engines:
        run(engine, prompts[:2], params, 1)  # warm-up, as the speed report's
    report = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "rounds": args.rounds, "rows": []}
    profiles: list[str] = []
    for b in batches:
        ps = prompts[:max(b, args.min_prompts)]
        rounds = {name: [] for name, _ in engines}
        for r in range(args.rounds):
            for name, engine in engines[r % len(engines):] + engines[:r % len(engines)]:
                rounds[name].append(round_breakdown(engine, ps, params, b))
        for name, _ in engines:
            median = sorted(rounds[name], key=lambda x: x["seconds"])[len(rounds[name]) // 2]
            row = {"batch": b, "engine": name, "median_round": median,
                   "seconds_per_round": [round(x["seconds"], 4) for x in rounds[name]]}
            report["rows"].append(row)
            print(_line(row), flush=True)
        for name, engine in engines:
            row = next(r for r in report["rows"] if r["batch"] == b and r["engine"] == name)
            if engine.policy is not None:
                row["policy"] = engine.policy.diagnostics()
            if args.phases:
                row["host_ms_per_step"] = phased_round(engine, ps, params, b)
                print(f"b{b} {name} host ms a step: {json.dumps(row['host_ms_per_step'])}", flush=True)
            if args.timeline:
                row["timeline"] = timed_round(engine, ps, params, b)
                print(f"b{b} {name} timeline: {json.dumps(row['timeline'])}", flush=True)
            if args.profile:
                dump = f"{args.out}.{name.replace(' ', '_')}.b{b}.pstats" if args.out else None
                profiles.append(profile_run(name, engine, ps, params, b, dump))
    if profiles and args.out:
        Path(args.out + ".profile.txt").write_text("".join(profiles))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return report


def _line(row: dict) -> str:
    m = row["median_round"]
    parts = [f"b{row['batch']} {row['engine']}: {m['seconds'] * 1e3:.1f} ms, {m['tokens']} tokens;"]
    for kind in KINDS:
        k = m[kind]
        if k["steps"]:
            parts.append(f"{kind} {k['steps']}x{k['median_ms']:.3f}={k['ms']:.1f}")
    d = m["draft_calls"]
    parts.append(f"| outside {m['outside_steps_ms']:.1f} | draft calls {d['calls']} ({d['rows']} rows) {d['ms']:.1f} ms")
    return " ".join(parts)


if __name__ == "__main__":
    main()
