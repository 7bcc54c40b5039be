"""Where exact mode's end-to-end cost goes: target-only generation with and without ``--exact``, each
step timed and put in one of two phases, prompt steps (a request waiting or prefilling when the
step began) and decode steps.

``eagle3 eval-draft --exact`` measures the mode's cost end to end (tok/s over a prompt set, the
prefill included); this splits the same run, in one process, the two engines alternated round by
round::

    python benchmarks/exact_cost_split.py --prompts benchmarks/data/mt_bench.jsonl --limit 80 \\
        --batch 1 --batch 64 --max-tokens 256 --rounds 2

Each step is followed by a device sync (a target-only step ends on one anyway, its tokens' copy),
so the phases' sums are the run's wall time. ``--profile prompt`` (or ``decode``) also prints each
mode's top device kernels and host ops over that phase's steps of one group (torch.profiler). Greedy; the outputs of the two
modes are compared and the count of identical ones reported (target-only, so they may differ in
bf16: exact numerics make speculation exact, not equal to the fast kernels).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.sampling_params import SamplingParams  # noqa: E402
from tools.inprocess import build_engine  # noqa: E402
from tools.train.data import load_prompts  # noqa: E402
from verify_service.config import EngineConfig  # noqa: E402

MODES = ("fast", "exact")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prompt_step(engine) -> bool:
    """True when the next step has a request waiting or prefilling."""
    s = engine.scheduler
    return bool(s.waiting) or any(q.prefilling for q in s.running)


def timed_run(engine, prompts: list[list[int]], params: SamplingParams, batch: int) -> dict:
    """The prompts in groups of ``batch`` (as eval-draft runs them), each step timed and split."""
    phases = {"prompt": [0.0, 0], "decode": [0.0, 0]}
    prompt_each: list[float] = []
    outputs: dict[int, list[int]] = {}
    order: list[int] = []
    for i in range(0, len(prompts), batch):
        ids = [engine.add_request(p, params) for p in prompts[i:i + batch]]
        order += ids
        outputs.update({k: [] for k in ids})
        while engine.has_work:
            phase = "prompt" if prompt_step(engine) else "decode"
            _sync()
            t0 = time.perf_counter()
            events = engine.step()
            _sync()
            dt = time.perf_counter() - t0
            phases[phase][0] += dt
            if phase == "prompt":
                prompt_each.append(round(dt * 1e3, 3))
            phases[phase][1] += 1
            for ev in events:
                outputs[ev.seq_id] += ev.token_ids
    tokens = sum(len(v) for v in outputs.values())
    total = phases["prompt"][0] + phases["decode"][0]
    return {"tokens": tokens, "seconds": total, "tokens_per_s": tokens / total,
            "prompt_steps": phases["prompt"][1], "prompt_ms": phases["prompt"][0] * 1e3,
            "decode_steps": phases["decode"][1], "decode_ms": phases["decode"][0] * 1e3, "prompt_steps_ms": prompt_each,
            "outputs": [outputs[k] for k in order]}


def profiled_steps(engine, prompts: list[list[int]], params: SamplingParams, batch: int, rows: int,
                   phase: str = "prompt") -> str:
    """The top ops of the first group's steps of one ``phase`` (``prompt`` or ``decode``;
    torch.profiler: by device time, then by host time); its other steps run unprofiled."""
    for p in prompts[:batch]:
        engine.add_request(p, params)
    while phase == "decode" and prompt_step(engine):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        steps = 0
        while engine.has_work and (prompt_step(engine) == (phase == "prompt")):
            engine.step()
            _sync()
            steps += 1
    while engine.has_work:
        engine.step()
    table = prof.key_averages()
    return (f"{steps} {phase} steps\n" + table.table(sort_by="self_cuda_time_total", row_limit=rows) + "\n"
            + table.table(sort_by="self_cpu_time_total", row_limit=rows))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="target model directory (default: the embedded SmolLM2)")
    ap.add_argument("--prompts", default="benchmarks/data/mt_bench.jsonl")
    ap.add_argument("--limit", type=int, default=80)
    ap.add_argument("--batch", type=int, action="append", help="prompts generated together (repeatable; default 1, 64)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2, help="runs of each mode, alternated")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--profile", nargs="?", const="prompt", choices=("prompt", "decode"), default=None,
                    help="also the top device kernels and host ops of each mode's first group's steps of this "
                         "phase (default prompt)")
    ap.add_argument("--kernel-rows", type=int, default=14)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("exact_cost_split.py needs CUDA (exact mode runs on the GPU)")
    from hub.default_model import ensure_default_model  # the embedded SmolLM2, converted on first use
    model = args.model or str(ensure_default_model(progress=False))
    batches = args.batch or [1, 64]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    report = {"device": torch.cuda.get_device_name(), "model": model, "prompts": args.prompts,
              "limit": args.limit, "max_tokens": args.max_tokens, "rounds": args.rounds, "batches": {}}
    for batch in batches:
        engines = {m: build_engine(EngineConfig(model, device="cuda", dtype=args.dtype, max_model_len=4096,
                                                max_num_seqs=batch, exact=(m == "exact")))
                   for m in MODES}
        prompts = [engines["fast"].target.encode(messages=[{"role": "user", "content": q}])
                   for q in load_prompts(args.prompts, args.limit)]
        for m in MODES:  # as eval-draft's warm-up: two prompts
            timed_run(engines[m], prompts[:2], params, batch)
        runs = {m: [] for m in MODES}
        for _ in range(args.rounds):
            for m in MODES:
                runs[m].append(timed_run(engines[m], prompts, params, batch))
        row = {}
        for m in MODES:
            best = min(runs[m], key=lambda r: r["seconds"])
            row[m] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in best.items() if k != "outputs"}
            row[m]["seconds_each"] = [round(r["seconds"], 4) for r in runs[m]]
        row["identical_outputs"] = sum(a == b for a, b in zip(runs["fast"][0]["outputs"], runs["exact"][0]["outputs"]))
        row["cost"] = round(1 - row["exact"]["tokens_per_s"] / row["fast"]["tokens_per_s"], 4)
        row["extra_prompt_ms"] = round(row["exact"]["prompt_ms"] - row["fast"]["prompt_ms"], 2)
        row["extra_decode_ms"] = round(row["exact"]["decode_ms"] - row["fast"]["decode_ms"], 2)
        report["batches"][str(batch)] = row
        f, e = row["fast"], row["exact"]
        print(f"batch {batch}: fast {f['tokens_per_s']:.1f} tok/s (prompt steps {f['prompt_steps']}: "
              f"{f['prompt_ms']:.1f} ms; decode steps {f['decode_steps']}: {f['decode_ms']:.1f} ms) | exact "
              f"{e['tokens_per_s']:.1f} tok/s (prompt {e['prompt_steps']}: {e['prompt_ms']:.1f} ms; decode "
              f"{e['decode_steps']}: {e['decode_ms']:.1f} ms) | cost {row['cost']:.1%}; identical "
              f"{row['identical_outputs']}/{len(prompts)}", flush=True)
        if args.profile:
            for m in MODES:
                print(f"\n[batch {batch}, {m}: the first group's {args.profile} steps]")
                print(profiled_steps(engines[m], prompts, params, batch, args.kernel_rows, args.profile), flush=True)
        del engines
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
