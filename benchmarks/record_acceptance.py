"""Record an acceptance trace: per sequence, per verification step, how many draft nodes the target
accepted, with a real target and head (default: SmolLM2 and the shipped head, fp32, greedy).

    python benchmarks/record_acceptance.py --prompts benchmarks/data/mt_bench.jsonl --limit 16 \\
        --max-tokens 128 --config chain:3 --config dynamic:7:10:59 --out benchmarks/results/acceptance.json

``benchmarks/replay_gates.py`` replays such a trace on models whose trained weights are not at hand
(``verify_service/replay.py``). A config is ``TREE:DEPTH[:TOP_K[:NODES]]``; each records its own
trace. Accepted node k of a step sits at depth k (a path), so the counts give acceptance per depth.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.sampling_params import SamplingParams  # noqa: E402
from hub.default_model import ensure_default_model  # noqa: E402
from tools.evaluate import parse_config  # noqa: E402
from tools.inprocess import build_engine  # noqa: E402
from tools.train.data import load_prompts  # noqa: E402
from verify_service.config import EngineConfig  # noqa: E402


def record(engine, prompts: list[list[int]], max_tokens: int, batch: int) -> list[list[int]]:
    """Generate ``prompts`` (greedy, ``batch`` at a time); returns each one's accepted count per step."""
    traces = []
    params = SamplingParams(max_tokens=max_tokens)
    for i in range(0, len(prompts), batch):
        seqs = [engine.sequences[engine.add_request(p, params)] for p in prompts[i:i + batch]]
        group = [[] for _ in seqs]
        while engine.has_work:
            before = [(s.speculation.steps, s.speculation.accepted_tokens) for s in seqs]
            engine.step()
            for trace, s, (steps, accepted) in zip(group, seqs, before):
                if s.speculation.steps > steps:  # one tree per sequence per step
                    trace.append(s.speculation.accepted_tokens - accepted)
        traces += group
    return traces


def summary(traces: list[list[int]], depth: int) -> dict:
    steps = sum(len(t) for t in traces)
    accepted = sum(sum(t) for t in traces)
    per_depth = [sum(k >= d for t in traces for k in t) / steps for d in range(1, depth + 1)]
    return {"steps": steps, "tau": round(1 + accepted / steps, 4), "acceptance_per_depth": [round(p, 4) for p in per_depth]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="target model directory (default: embedded SmolLM2)")
    ap.add_argument("--head", default="default", help="EAGLE-3 head directory, or 'default' (the shipped one)")
    ap.add_argument("--prompts", default=str(Path(__file__).parent / "data" / "mt_bench.jsonl"))
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--config", action="append", help="TREE:DEPTH[:TOP_K[:NODES]] (default: chain:3, dynamic:7:10:59)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model = args.model or str(ensure_default_model(progress=False))
    configs = args.config or ["chain:3", "dynamic:7:10:59"]
    cfg = EngineConfig(model, device=args.device, dtype=args.dtype, max_model_len=4096, max_num_seqs=args.batch)
    report = {"kind": "acceptance_trace", "model": Path(model).name, "head": args.head,
              "prompts": f"{Path(args.prompts).name}, first turns, first {args.limit}, chat template",
              "max_tokens": args.max_tokens, "greedy": True, "device": args.device, "dtype": args.dtype,
              "configs": {}}
    for text in configs:
        spec = parse_config(text, args.head)
        engine = build_engine(cfg, spec)
        prompts = [engine.target.encode(messages=[{"role": "user", "content": q}])
                   for q in load_prompts(args.prompts, args.limit)]
        start = time.perf_counter()
        traces = record(engine, prompts, args.max_tokens, args.batch)
        s = spec.settings
        entry = {"tree": {"tree": s.tree, "depth": s.depth, "top_k": s.top_k, "max_nodes": s.max_nodes},
                 **summary(traces, s.depth), "seconds": round(time.perf_counter() - start, 1), "traces": traces}
        report["configs"][text] = entry
        print(f"{text}: tau {entry['tau']}, {entry['steps']} steps, per depth {entry['acceptance_per_depth']} "
              f"({entry['seconds']} s)", flush=True)
        Path(args.out).write_text(json.dumps(report, separators=(",", ":")))  # after each config: kept if stopped
        del engine


if __name__ == "__main__":
    main()
