"""A/B of the kernels' environment switches (read once at import, so one process per variant):
``decode_baseline.py`` (or, with ``--script replay``, ``replay_gates.py``; with ``--script spec``,
``profile_spec_step.py --timeline``) runs once per variant, the variants taking turns over ``--rounds``,
and the per-case step times come back side by side in one JSON.

    python benchmarks/switch_ab.py --variant base= --variant all=EAGLE3_PDL_ALL=1 \\
        --variant early=EAGLE3_PDL_EARLY=1,EAGLE3_L2_PREFETCH=2,EAGLE3_ROW_LINEAR_STAGES=3 \\
        --rounds 2 --out ab.json -- --case smollm2:1:512 --case llama3-8b:1:4096 --steps 48
    python benchmarks/switch_ab.py --script replay --variant base= --variant off=EAGLE3_PDL=0 --rounds 3 -- \\
        --geometry smollm2 --case 512:1 --config dynamic:7:10:59 --steps 480 --exact

    python benchmarks/switch_ab.py --script spec --variant off=EAGLE3_PDL_SMALL=0 --variant on= --rounds 3 -- \
        smollm2 --exact --context 512 --steps 60

Everything after ``--`` goes to the script. A variant is ``NAME=`` (the defaults) or
``NAME=VAR=VALUE[,VAR=VALUE...]``. A decode case's time is its ms per step; a replayed case's
(``CONTEXT:BATCH CONFIG``, target-only and each tree) its median step; a speculative step's
(``spec``) its host time unprofiled and the device's busy time a step, which does not follow the
host's pace (the replay's steps do, as its acceptance reads the trees on the host: its processes can
settle some 20% apart, SmolLM2 at batch 1).
Where one variant's processes differ by more than ``SPREAD`` the table says so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BASELINE = Path(__file__).resolve().parent / "decode_baseline.py"
REPLAY = Path(__file__).resolve().parent / "replay_gates.py"
SPEC = Path(__file__).resolve().parent / "profile_spec_step.py"
SCRIPTS = {"decode": "BASELINE", "replay": "REPLAY", "spec": "SPEC"}  # (module attributes: tests stand in)
SPREAD = 0.05  # a variant's slowest process against its fastest, above which the table flags the case


def step_times(script: str, result: dict) -> dict[str, float]:
    """A run's ms a step by case: ``decode_baseline.py``'s per (case, kernels), ``replay_gates.py``'s
    median per (context:batch, config)."""
    if script == "decode":
        return {f"{c['case']} {c['kernels']}": c["ms_per_step"] for c in result["cases"]}
    if script == "spec":
        case = f"{result['model']} {result['context']}:{result['batch']} {result['config']}"
        return {f"{case} step": result["host_ms_by_phase_unprofiled"]["step"],
                f"{case} device busy": result["device_busy_ms"]}
    return {f"{c['context']}:{c['batch']} {c['config']}": c["step_ms_median"] for c in result["cases"]}


def spreads(table: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    """Each case's variants whose processes differ by more than ``SPREAD``: slowest / fastest - 1."""
    out = {}
    for case, by_variant in table.items():
        wide = {v: round(max(ms) / min(ms) - 1, 4) for v, ms in by_variant.items() if min(ms) > 0 and
                max(ms) / min(ms) - 1 > SPREAD}
        if wide:
            out[case] = wide
    return out


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, settings = text.partition("=")
    if not name:
        raise argparse.ArgumentTypeError(f"{text!r}: NAME= or NAME=VAR=VALUE[,VAR=VALUE...]")
    env = {}
    for item in filter(None, settings.split(",")):
        var, eq, value = item.partition("=")
        if not eq or not var.startswith("EAGLE3_"):
            raise argparse.ArgumentTypeError(f"{item!r}: EAGLE3_VAR=VALUE")
        env[var] = value
    return name, env


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    ours, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", type=parse_variant, action="append", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--script", choices=tuple(SCRIPTS), default="decode",
                    help="decode_baseline.py (default), replay_gates.py or profile_spec_step.py --timeline, once "
                         "per variant and round")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(ours)
    names = [name for name, _ in args.variant]
    if len(set(names)) != len(names):
        ap.error("variant names must differ")
    if args.script == "spec" and "--timeline" not in rest:
        rest = [*rest, "--timeline"]
    script = globals()[SCRIPTS[args.script]]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, env in args.variant:
                out = Path(tmp) / f"{name}_{r}.json"
                print(f"round {r + 1}, {name}: {env or 'defaults'}", flush=True)
                t0 = time.perf_counter()
                subprocess.run([sys.executable, str(script), *rest, "--out", str(out)], check=True,
                               env={**os.environ, **env})
                result = json.loads(out.read_text())
                runs.append({"variant": name, "env": env, "round": r,
                             "wall_s": round(time.perf_counter() - t0, 1),
                             "ms_per_step": step_times(args.script, result), "cases": result.get("cases", [result])})
                print(f"  {runs[-1]['wall_s']} s: " + "  ".join(f"{k} {v:.3f} ms" for k, v in runs[-1]["ms_per_step"].items()),
                      flush=True)
                if args.out:  # kept after every run: a run cut short by a time limit keeps what it measured
                    Path(args.out).write_text(json.dumps({"script": args.script, "script_args": rest, "runs": runs},
                                                         indent=2))
    table = {}
    for run in runs:
        for case, ms in run["ms_per_step"].items():
            table.setdefault(case, {}).setdefault(run["variant"], []).append(ms)
    for case, by_variant in table.items():
        print(f"{case}: " + "  ".join(f"{v} {'/'.join(f'{x:.3f}' for x in ms)} ms" for v, ms in by_variant.items()))
    spread = spreads(table)
    for case, wide in spread.items():
        print(f"  {case}: " + ", ".join(f"{v}'s processes {x:.1%} apart" for v, x in wide.items()) +
              " (more than the switch may move it: compare like with like, or add rounds)")
    result = {"script": args.script, "script_args": rest, "rounds": args.rounds, "ms_per_step": table,
              "spread": spread, "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
