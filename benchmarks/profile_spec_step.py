"""Where a speculative step's time goes: the draft (extend + tree levels) against verification.

The target is a random-weight geometry (``smollm2``, ``llama3-8b``) or a model directory; the
draft head is a checkpoint of matching geometry (default: the shipped SmolLM2 head). With
random target weights almost nothing is accepted, but every step still drafts the whole tree
and verifies all its nodes, so the timing is a real speculative step's. Prints the median step,
the host time of the draft's and the target's top-level calls (cProfile, cumulative), and the
top device kernels (torch.profiler)::

    python benchmarks/profile_spec_step.py smollm2 --config dynamic:7:10:59 --batch 1 --context 512

``--mode plain`` keeps the draft attached but decodes plainly every step (what adaptive
speculation does when trees do not pay: features captured and buffered, the draft called only
when its buffer fills); ``--mode target`` is the same engine without a draft. Side by side they
show what a plain step costs because a draft is attached. ``--mode backlog`` times the draft
extending what ``--steps`` plain steps left waiting (what a tree after a plain stretch pays first).
``--mode ab`` loads three plain engines (target-only; draft attached; a draft that every request
starts without, as adaptive speculation runs large batches) in one process and alternates them,
10 steps at a time for ``--steps`` rounds: their median step times side by side.
``--mode chain-ab`` alternates one speculative engine between the draft chained behind acceptance
and the draft called after the step's sync, the same way.
``--timeline``: the host phases of ``--steps`` steps against the device's busy and idle time
(``step_timeline.py``): what the device waits for.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.decode_baseline import GEOMETRIES, make_engine  # noqa: E402
from benchmarks.step_timeline import host_phases, timeline  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402
from draft_service.drafter import EagleDrafter  # noqa: E402
from draft_service.eagle_init import write_random_head  # noqa: E402
from tools.evaluate import parse_config  # noqa: E402
from verify_service.adaptive import PolicyConfig  # noqa: E402
from verify_service.engine import Engine  # noqa: E402

SHIPPED_HEAD = str(Path(__file__).resolve().parent.parent / "hub" / "heads" / "smollm2-135m-instruct")


class _AlwaysPlain:
    """A policy that always picks plain decoding (the engine's policy interface, nothing learned),
    as adaptive speculation holding a plain decision does."""

    last_held = True
    choice = 0
    backlog_rows = 0  # set by the draft coordinator
    chainable = False  # likewise
    cfg = PolicyConfig()  # the defaults the coordinator reads (``feed_prompt_rows``)

    def detaches(self, batch, context) -> bool:
        return False  # the draft stays attached: its cost on plain steps is what --mode plain/ab measure

    def choose_held(self, quick_key) -> bool:
        return True

    def choose(self, batch, context, seq_ids, budgets, quick_key=None) -> int:
        return 0

    def observe_step(self, *args) -> None:
        pass

    def observe_draft(self, *args) -> None:
        pass

    def observe_tree(self, *args) -> None:
        pass

    def observe_realized(self, *args) -> None:
        pass

    def release(self, seq_id) -> None:
        pass


class _Detached(_AlwaysPlain):
    """Every request starts without the draft: what adaptive speculation runs at large batches."""

    def detaches(self, batch, context) -> bool:
        return True

    def trees_pay(self, batch, context) -> bool:
        return False  # (asked as the batch changes: none takes the draft up again)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="smollm2, llama3-8b (random weights) or a model directory")
    ap.add_argument("--head", default=SHIPPED_HEAD, help="head directory, or 'random' (a random head of the "
                    "target's geometry with --draft-vocab entries)")
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--config", default="dynamic:7:10:59", help="TREE:DEPTH[:TOP_K[:NODES]]")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--mode", choices=("spec", "plain", "target", "backlog", "ab", "chain-ab"), default="spec",
                    help="spec: a tree every step; plain: draft attached, plain decoding; target: no draft; "
                         "backlog: the draft's extend after --steps plain steps")
    ap.add_argument("--out", default=None)
    ap.add_argument("--exact", action="store_true",
                    help="the target on the batch-invariant kernels (--exact of the server); the draft keeps its own")
    ap.add_argument("--requests", type=int, default=0,
                    help="instead of steps: this many whole requests one after another (a --context-token "
                         "prompt, --steps new tokens each; the first a warm-up): their time against their steps' "
                         "(what a request costs outside its steps), and cProfile by own time")
    ap.add_argument("--unchained", action="store_true",
                    help="call the draft after the step's sync, not chained behind acceptance on the device")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="the target's cache capacity in positions, as a server sizes it (a graphed step's "
                         "attention grid follows it; default: what the run needs)")
    ap.add_argument("--kernel-rows", type=int, default=15, help="rows of the device-kernel table")
    ap.add_argument("--stats-rows", type=int, default=40, help="rows of each cProfile table")
    ap.add_argument("--trace", default=None,
                    help="also write the profiled steps' Chrome trace here (every kernel, in order, graphs included)")
    ap.add_argument("--timeline", action="store_true",
                    help="instead of the profiles: the host phases against the device's busy and idle time "
                         "(benchmarks/step_timeline.py)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # a CPU: a smoke run
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    head = args.head
    if head == "random":
        raw = GEOMETRIES[args.model] if args.model in GEOMETRIES else \
            json.loads((Path(args.model) / "config.json").read_text())
        head = str(write_random_head(tempfile.mkdtemp(prefix="eagle3-profile-head-"), raw,
                                     min(args.draft_vocab, raw["vocab_size"])))
    spec = parse_config(args.config, head)
    # New tokens a sequence may take (chain-ab: 20 steps a round, up to 8 tokens a step) + tree room.
    # spec: 5 + 3 x --steps timed and profiled steps + 5 profiled ones, up to 8 tokens each.
    args.max_tokens = 8 * (20 * args.steps + 5) if args.mode == "chain-ab" else 8 * (3 * args.steps + 10)
    target = make_engine(args.model, args.batch, args.context, args.max_tokens + 128, device, exact=args.exact,
                         max_model_len=args.max_model_len)
    if args.mode == "ab":
        more = [make_engine(args.model, args.batch, args.context, 16 * args.steps + 128, device, exact=args.exact,
                            max_model_len=args.max_model_len)
                for _ in range(2)]
        return profile_ab(args, spec, target, *more, sync)
    if args.mode == "target":
        engine = Engine(target)
    else:
        drafter = EagleDrafter.from_checkpoint(spec, target.model_config, target.model.model.embed_tokens.weight,
                                               args.batch, target.max_model_len, "auto")
        engine = Engine(target, drafter, spec.settings, _AlwaysPlain() if args.mode in ("plain", "backlog") else None)
        engine.speculation.chain = not args.unchained
    if args.requests:
        return profile_requests(engine, args, sync)
    prefilled(engine, args)
    if args.mode == "backlog":
        return profile_backlog(engine, args, sync)
    if args.mode == "chain-ab":
        return profile_chain_ab(engine, args, sync)
    for _ in range(5):
        engine.step()
    header = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "model": args.model,
              "mode": args.mode, "exact": args.exact, "chained": not args.unchained, "config": args.config, "batch": args.batch, "context": args.context}
    if args.timeline:
        result = {**header, "host_ms_by_phase_unprofiled": host_phases(engine, args.steps, sync),
                  **timeline(engine, args.steps, sync)}
        print(json.dumps(result, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        return
    times = []
    for _ in range(args.steps):
        sync()
        t = time.perf_counter()
        engine.step()
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    sync()  # steps back to back, as serving runs them (a chained step's draft overlaps the next step's host work)
    t = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    sync()
    pipelined = (time.perf_counter() - t) * 1e3 / args.steps
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        engine.step()
    sync()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(args.stats_rows)
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(args.stats_rows)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])) as tprof:
        for _ in range(5):
            engine.step()
        sync()
    kernels = tprof.key_averages().table(sort_by="self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total",
                                         row_limit=args.kernel_rows)
    launches = sum(e.count for e in tprof.key_averages() if e.device_type.name == "CUDA") / 5
    if args.trace:
        tprof.export_chrome_trace(args.trace)
    result = {**header, "step_ms_median": round(statistics.median(times), 3), "step_ms_pipelined": round(pipelined, 3),
              "step_ms": [round(x, 3) for x in times], "device_kernels_per_step": launches}
    print(json.dumps({k: v for k, v in result.items() if k != "step_ms"}))
    print(text.getvalue())
    print(kernels)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n" + text.getvalue() + "\n" + kernels)


def prefilled(engine: Engine, args) -> None:
    """``--batch`` random prompts of ``--context`` tokens (the same for every engine), prefilled."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(args.batch):
        prompt = torch.randint(1, engine.target.model_config.vocab_size, (args.context,), generator=gen).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=getattr(args, "max_tokens", 16 * args.steps),
                                                  ignore_eos=True))
    while any(s.prefilling for s in engine.sequences.values()):
        engine.step()


def profile_ab(args, spec, target_a, target_b, target_c, sync) -> None:
    """Target-only, draft-attached plain decoding and a draft no request uses, same prompts,
    alternated in one process."""
    def drafter(target):
        return EagleDrafter.from_checkpoint(spec, target.model_config, target.model.model.embed_tokens.weight,
                                            args.batch, target.max_model_len, "auto")
    engines = {"target": Engine(target_a), "plain": Engine(target_b, drafter(target_b), spec.settings, _AlwaysPlain()),
               "detached": Engine(target_c, drafter(target_c), spec.settings, _Detached())}
    for engine in engines.values():
        prefilled(engine, args)
        for _ in range(5):
            engine.step()
    times = {name: [] for name in engines}
    for r in range(args.steps):
        for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            sync()
            t = time.perf_counter()
            for _ in range(10):
                engines[name].step()
            sync()
            times[name].append((time.perf_counter() - t) * 100)  # ms a step
    med = {name: round(statistics.median(v), 4) for name, v in times.items()}
    result = {"mode": "ab", "model": args.model, "batch": args.batch, "context": args.context,
              "step_ms_median": med, "plain_over_target": round(med["plain"] / med["target"], 4),
              "detached_over_target": round(med["detached"] / med["target"], 4),
              "step_ms": {name: [round(x, 4) for x in v] for name, v in times.items()}}
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


def profile_chain_ab(engine: Engine, args, sync) -> None:
    """One speculative engine, the draft chained behind acceptance and called after the sync in turn,
    10 steps at a time for ``--steps`` rounds (the same sequences: both give the same steps): their
    median step times side by side, free of the drift between runs and machines."""
    for _ in range(5):
        engine.step()
    times = {"chained": [], "unchained": []}
    for r in range(args.steps):
        for name in (("chained", "unchained") if r % 2 == 0 else ("unchained", "chained")):
            engine.speculation.chain = name == "chained"
            sync()
            t = time.perf_counter()
            for _ in range(10):
                engine.step()
            sync()
            times[name].append((time.perf_counter() - t) * 100)  # ms a step
    assert engine.has_work and len(engine.sequences) == args.batch, "a sequence finished inside the timing"
    med = {name: round(statistics.median(v), 4) for name, v in times.items()}
    result = {"mode": "chain-ab", "model": args.model, "config": args.config, "batch": args.batch,
              "context": args.context, "step_ms_median": med, "chained_over_unchained":
              round(med["chained"] / med["unchained"], 4), "chained_steps": engine.speculation.chained_steps,
              "step_ms": {name: [round(x, 4) for x in v] for name, v in times.items()}}
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


def profile_requests(engine: Engine, args, sync) -> None:
    """Whole requests at batch 1: wall time, time to the first token, steps, and the mean step time.
    The engine is warmed up first as the services warm theirs (kernels, decode, prompt and tree graphs)."""
    engine.target.runner.warm_up(engine.target.cfg.max_batch_tokens,
                                 (engine.limits.node_budget + 1,) if engine.limits else ())
    gen = torch.Generator().manual_seed(0)
    vocab = engine.target.model_config.vocab_size
    rows, prof = [], cProfile.Profile()
    for r in range(args.requests + 1):
        prompt = torch.randint(1, vocab, (args.context,), generator=gen).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=args.steps, ignore_eos=True))
        steps, first, step_s = 0, None, 0.0
        if r == args.requests:
            prof.enable()
        sync()
        t0 = time.perf_counter()
        while engine.has_work:
            t = time.perf_counter()
            if r == args.requests and steps == 0:  # the last request's first step: its kernels too
                with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available()
                                                                  else [])) as first_prof:
                    events = engine.step()
                    sync()
            else:
                events = engine.step()
            sync()
            step_s += time.perf_counter() - t
            steps += 1
            if first is None and any(e.token_ids for e in events):
                first = time.perf_counter() - t0
        total = time.perf_counter() - t0
        prof.disable()
        if r:
            rows.append({"ms": round(total * 1e3, 3), "first_token_ms": round(first * 1e3, 3), "steps": steps,
                         "outside_steps_ms": round((total - step_s) * 1e3, 3),
                         "step_ms_mean": round(step_s / steps * 1e3, 4)})
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(args.stats_rows)
    text.write(first_prof.key_averages().table(sort_by="self_cuda_time_total" if torch.cuda.is_available()
                                               else "self_cpu_time_total", row_limit=20))
    result = {"mode": args.mode, "requests": rows, "model": args.model, "context": args.context,
              "new_tokens": args.steps, "config": args.config}
    print(json.dumps(result))
    print(text.getvalue())
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n" + text.getvalue())


def profile_backlog(engine: Engine, args, sync) -> None:
    """Three rounds of ``--steps`` plain steps, each followed by the draft's extend of their rows
    (timed; the first compiles); cProfile and the device kernels of the last."""
    times, rows = [], 0
    engine.drafter.step(engine.feed_buffer.take(), [])  # the prompts' rows
    for r in range(3):
        for _ in range(args.steps):
            engine.step()
        feeds = engine.feed_buffer.take()
        rows = sum(len(f.next_tokens) for f in feeds)
        sync()
        t = time.perf_counter()
        if r < 2:
            engine.drafter.step(feeds, [])
        else:
            prof = cProfile.Profile()
            with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])) as tprof:
                prof.enable()
                engine.drafter.step(feeds, [])
                sync()
                prof.disable()
        sync()
        times.append(round((time.perf_counter() - t) * 1e3, 3))
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(30)
    kernels = tprof.key_averages().table(sort_by="self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total", row_limit=15)
    result = {"mode": "backlog", "model": args.model, "batch": args.batch, "rows": rows, "extend_ms": times}
    print(json.dumps(result))
    print(text.getvalue())
    print(kernels)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n" + text.getvalue() + "\n" + kernels)


if __name__ == "__main__":
    main()
