"""Record an acceptance trace: per sequence, per verification step, how many draft nodes the target
accepted, with a real target and head (default: SmolLM2 and the shipped head, fp32, greedy).

    python benchmarks/record_acceptance.py --prompts benchmarks/data/mt_bench.jsonl --limit 16 \\
        --max-tokens 128 --config chain:3 --config dynamic:7:10:59 --out benchmarks/results/acceptance.json

``benchmarks/replay_gates.py`` replays such a trace on models whose trained weights are not at hand
(``verify_service/replay.py``). A config is ``TREE:DEPTH[:TOP_K[:NODES]]``; each records its own
trace. Accepted node k of a step sits at depth k (a path), so the counts give acceptance per depth.

A dynamic tree's entry also holds, per step, the accepted path's nodes' ranks in the tree
(``path_ranks``, as ``acceptance_estimate.path_ranks`` gives them: a running maximum along the
path), from which what a tree of any n nodes would have accepted follows: the tree's best n
nodes (``TreeSettings.capped``) hold the path up to its first node ranked n or lower; exact
under greedy verification. A request's last trees, cut short by its token budget and not shown
to a policy, are recorded as ranks 0, 1, ... (min(count, n)). ``per_size`` has the counts of the
sizes the policy picks from. The replay of a smaller tree takes its own count from the same
step, where the full tree's count would credit it with nodes it does not have.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.policy_replay import flat_table  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402
from hub.default_model import ensure_default_model  # noqa: E402
from tools.evaluate import parse_config  # noqa: E402
from tools.inprocess import build_engine  # noqa: E402
from tools.train.data import load_prompts  # noqa: E402
from verify_service.acceptance_estimate import path_ranks  # noqa: E402
from verify_service.adaptive import AdaptivePolicy, PolicyConfig  # noqa: E402
from verify_service.config import EngineConfig  # noqa: E402


class SizeRecorder(AdaptivePolicy):
    """A policy that picks the full tree for every request at every step and keeps, per sequence per
    verified tree, the accepted path's ranks in the tree (``observe_tree``): what a tree of any size
    would have accepted."""

    def __init__(self, limits):
        super().__init__(flat_table(), limits, PolicyConfig(probe_every=0, veto_span=0, leave_from=0))
        self.ranks: dict[int, list[list[int]]] = {}
        self.cut_short_trees = 0

    def choose(self, batch, context, seq_ids, budgets, quick_key=None) -> int:
        self.choice = self.sizes[-1] if seq_ids else 0
        self.decisions[self.choice] += 1
        self.decided += 1
        self.last_held = False
        return self.choice

    def choose_held(self, quick_key) -> bool:
        return False

    def detaches(self, batch, context) -> bool:
        return False

    def trees_pay(self, batch, context) -> bool:
        return True

    def observe_tree(self, seq_id, tree, accepted, asked) -> None:
        self.ranks.setdefault(seq_id, []).append(path_ranks(tree, accepted).tolist() if accepted else [])

    def cut_short(self, seq_id, accepted: int) -> None:
        """A tree cut short by the request's end (the engine does not show it to a policy): a tree of n
        nodes is at most n deep, so n of it at most."""
        self.ranks.setdefault(seq_id, []).append(list(range(accepted)))
        self.cut_short_trees += 1


def counts_of(ranks: list[list[list[int]]], sizes) -> list[list[list[int]]]:
    """Per sequence per step, what each of ``sizes`` accepted, from the steps' path ranks."""
    return [[[sum(r < n for r in step) for n in sizes] for step in seq] for seq in ranks]


def record(engine, prompts: list[list[int]], max_tokens: int, batch: int,
           ranks: list | None = None) -> list[list[int]]:
    """Generate ``prompts`` (greedy, ``batch`` at a time); returns each one's accepted count per step.
    With a ``SizeRecorder`` as the engine's policy, ``ranks`` (a list) gets each one's accepted path
    ranks per step."""
    traces = []
    params = SamplingParams(max_tokens=max_tokens)
    for i in range(0, len(prompts), batch):
        seqs = [engine.sequences[engine.add_request(p, params)] for p in prompts[i:i + batch]]
        group = [[] for _ in seqs]
        recorder = engine.policy if ranks is not None else None
        while engine.has_work:
            before = [(s.speculation.steps, s.speculation.accepted_tokens) for s in seqs]
            seen = [len(recorder.ranks.get(s.seq_id, ())) for s in seqs] if recorder else None
            engine.step()
            for j, (trace, s, (steps, accepted)) in enumerate(zip(group, seqs, before)):
                if s.speculation.steps > steps:  # one tree per sequence per step
                    trace.append(s.speculation.accepted_tokens - accepted)
                    if recorder and len(recorder.ranks.get(s.seq_id, ())) == seen[j]:
                        recorder.cut_short(s.seq_id, trace[-1])
        traces += group
        if ranks is not None:
            ranks += [engine.policy.ranks.pop(s.seq_id, []) for s in seqs]
    return traces


def check_ranks(traces: list[list[int]], ranks: list[list[list[int]]]) -> None:
    """The path ranks match the trees' own counts: a step each, a rank for each accepted node."""
    for trace, steps in zip(traces, ranks, strict=True):
        if [len(r) for r in steps] != trace:
            raise RuntimeError(f"the accepted paths' ranks disagree with the recorded counts: {trace[:8]} against "
                               f"{[len(r) for r in steps][:8]}")


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
        recorder = SizeRecorder(spec.settings) if spec.settings.tree == "dynamic" else None
        engine = build_engine(cfg, spec, policy=recorder)
        prompts = [engine.target.encode(messages=[{"role": "user", "content": q}])
                   for q in load_prompts(args.prompts, args.limit)]
        start = time.perf_counter()
        ranks = [] if recorder else None
        traces = record(engine, prompts, args.max_tokens, args.batch, ranks)
        s = spec.settings
        entry = {"tree": {"tree": s.tree, "depth": s.depth, "top_k": s.top_k, "max_nodes": s.max_nodes},
                 **summary(traces, s.depth), "seconds": round(time.perf_counter() - start, 1), "traces": traces}
        if recorder:
            check_ranks(traces, ranks)
            per_size = counts_of(ranks, recorder.sizes)
            entry["path_ranks"] = ranks
            entry["per_size"] = {"sizes": list(recorder.sizes), "traces": per_size,
                                 "cut_short_trees": recorder.cut_short_trees,
                                 "tau": [round(1 + sum(c[i] for t in per_size for c in t) / entry["steps"], 4)
                                         for i in range(len(recorder.sizes))]}
        report["configs"][text] = entry
        print(f"{text}: tau {entry['tau']}, {entry['steps']} steps, per depth {entry['acceptance_per_depth']} "
              f"({entry['seconds']} s)", flush=True)
        if recorder:
            print(f"  per size {dict(zip(entry['per_size']['sizes'], entry['per_size']['tau']))} (tau)", flush=True)
        Path(args.out).write_text(json.dumps(report, separators=(",", ":")))  # after each config: kept if stopped
        del engine


if __name__ == "__main__":
    main()
