"""Where a whole round's time goes, step by step: target-only against adaptive speculation (and the
fixed tree with ``--tree-engine``), each step synchronised and timed, summed by kind (a step with
a prompt in it, a plain decode step launched ahead by the one before it or not, a tree step).
``--sync off`` times the steps as they run (no synchronisation: a step's wall time is its host work
plus its wait for the device; a round's steps sum to its time, and pipelining stays as it is). Rounds of ``--batch`` MT-bench first turns
(embedded SmolLM2, the shipped head), the engines in turn.

    python benchmarks/round_steps.py --batch 16 --rounds 3
    python benchmarks/round_steps.py --batch 1 --batch 4 --batch 64 --rounds 3 --sync off
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.speed_report import batch_prompts  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402
from hub.default_model import ensure_default_model  # noqa: E402
from tools.evaluate import parse_config  # noqa: E402
from tools.inprocess import build_engine  # noqa: E402
from verify_service.config import EngineConfig  # noqa: E402
from verify_service.engine import Engine  # noqa: E402

PROMPTS = Path(__file__).parent / "data" / "mt_bench.jsonl"


def timed_steps(log: list, sync) -> None:
    """Engine.step, timed: (kind, seconds) per step into ``log``. Kinds: a step with a prompt in it,
    a tree step, a plain step launched ahead by the step before it (its tokens queued on the device
    before the last ones were read) and one that was not."""
    step = Engine.step

    def run(self):
        sync()
        t = time.perf_counter()
        prompt = bool(self.scheduler.waiting) or any(s.prefilling for s in self.scheduler.running)
        ahead = self._ahead_decode is not None
        events = step(self)
        sync()
        kind = "prompt" if prompt else "tree" if self.last_step_verified_trees else \
            "plain, launched ahead" if ahead else "plain, not launched ahead"
        log.append((kind, time.perf_counter() - t))
        return events
    Engine.step = run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, action="append", help="batch sizes, in this order (default 16)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--tree", default="dynamic:7:10:59")
    ap.add_argument("--tree-engine", action="store_true", help="the fixed tree's engine too")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sync", choices=("on", "off"), default="on",
                    help="synchronise the device around each step (off: the steps as they run, pipelined)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = args.batch or [16]
    cuda = args.device.startswith("cuda")
    cfg = EngineConfig(str(ensure_default_model(progress=False)), device=args.device,
                       dtype="bfloat16" if cuda else "float32", max_model_len=4096, max_num_seqs=max(*batches, 8))
    spec = parse_config(args.tree, "default")
    engines = {"target-only": build_engine(cfg), "adaptive": build_engine(cfg, spec, adaptive=True)}
    if args.tree_engine:
        engines["tree"] = build_engine(cfg, spec)
    texts, _ = batch_prompts(str(PROMPTS), max(*batches, 16))
    prompts = [engines["target-only"].target.encode(messages=[{"role": "user", "content": t}]) for t in texts]
    log: list = []
    timed_steps(log, torch.cuda.synchronize if cuda and args.sync == "on" else (lambda: None))
    for engine in engines.values():  # warm-up
        engine.generate(prompts[:2], SamplingParams(max_tokens=8))
    rows = []
    for b, r in ((b, r) for b in batches for r in range(args.rounds)):
        for name, engine in engines.items():
            log.clear()
            policy = getattr(engine, "policy", None)
            before = collections.Counter(policy.decisions) if policy else None
            switched = collections.Counter(policy.switches) if policy else None
            t = time.perf_counter()
            for i in range(0, max(b, 16), b):
                engine.generate(prompts[i:i + b], SamplingParams(max_tokens=args.max_tokens))
            kinds = collections.defaultdict(lambda: [0, 0.0])
            for kind, seconds in log:
                k = kinds[kind]
                k[0] += 1
                k[1] += seconds * 1e3
            rows.append({"batch": b, "round": r, "engine": name, "wall_ms": round((time.perf_counter() - t) * 1e3, 1),
                         **{kind: {"steps": n, "ms": round(ms, 1), "ms_per_step": round(ms / n, 3)}
                            for kind, (n, ms) in sorted(kinds.items())},
                         "steps_ms": round(sum(ms for _, ms in kinds.values()), 1)})
            if policy:  # the round's choices (0: plain decoding), and its requests started without the draft
                rows[-1]["decisions"] = {str(k): v for k, v in sorted((policy.decisions - before).items())}
                rows[-1]["switches"] = dict(sorted((policy.switches - switched).items()))
                detacher = engine.speculation.detacher  # (since start)
                rows[-1]["requests"] = {"without_draft": detacher.detached_requests, "left_draft": detacher.left_requests,
                                        "took_it_up_again": detacher.reattached_requests}
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name() if cuda else "cpu",
                                              "sync": args.sync, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
