"""Host time of a decode step, on the CPU: the wall time of ``Engine.step`` less its graph replays
(graphs run eagerly, ``EngineConfig.graphs_on_cpu``), for target-only decoding and for adaptive
speculation with every request started without the draft (what it runs at batch 64 and 128 on a
GPU; the policy still prices each wave of requests, as it does there). Tiny random models; the
engines alternate, rounds after the first counted; each round's median decode step, and its prompt
steps' host time summed apart::

    python benchmarks/host_step_time.py --batch 64 --rounds 4
    python benchmarks/host_step_time.py --batch 64 --rounds 6 --skip-forward

``--spread N``: request i asks for ``max_tokens - i % N`` tokens, so that requests finish over N steps
and the steps not launched ahead (where one finishes: their host work is the step's on a GPU too)
are reported apart from those launched ahead.

``--skip-forward``: the replays do nothing (the tokens are the logits buffers' stale values, their
host work the same): each step's wall time is its host work alone, without the noise of subtracting
a forward many times longer. What the host adds to a step is what a GPU step bound by its host pays (large batches, SmolLM2).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from common.sampling_params import SamplingParams  # noqa: E402
from runtime import graphs  # noqa: E402
from verify_service.adaptive import AdaptivePolicy  # noqa: E402
from verify_service.engine import Engine  # noqa: E402


class StartsWithoutDraft(AdaptivePolicy):
    def detaches(self, batch, context):
        super().detaches(batch, context)  # its host time, as a decision at a batch where trees do not pay takes it
        return True


def engines(root: Path, batch: int) -> dict[str, Engine]:
    import test_adaptive
    from tiny_eagle import make_eagle_dir
    from tiny_models import make_model_dir, target_for, tiny_config

    dirs = (make_model_dir(root / "target", "llama3", seed=5, std=0.3),
            make_eagle_dir(root / "draft", tiny_config("llama3"), draft_vocab=64, seed=1))
    kw = dict(max_num_seqs=batch, graphs_on_cpu=True, kv_cache_gib=0.05, device="cpu", dtype="float32")
    return {"target-only": Engine(target_for(dirs[0], **kw)),
            "adaptive, no draft": test_adaptive.eagle_engine(dirs, "dynamic", StartsWithoutDraft,
                                                             test_adaptive.table(1.0), **kw)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=120)
    ap.add_argument("--skip-forward", action="store_true", help="replays do nothing: the host's work alone")
    ap.add_argument("--spread", type=int, default=1, help="requests finish over this many steps")
    args = ap.parse_args(argv)
    replay_s = [0.0]
    replay = (lambda graph: None) if args.skip_forward else graphs.EagerGraph.replay

    def timed(graph):
        t0 = time.perf_counter()
        replay(graph)
        replay_s[0] += time.perf_counter() - t0

    graphs.EagerGraph.replay = timed
    prompts = [[(7 * i + j) % 90 + 1 for j in range(5)] for i in range(args.batch)]
    params = [SamplingParams(max_tokens=args.max_tokens - i % max(args.spread, 1), ignore_eos=True)
              for i in range(args.batch)]
    with tempfile.TemporaryDirectory() as tmp:
        runs = engines(Path(tmp), args.batch)
        result = {name: [] for name in runs}
        prompts_us = {name: [] for name in runs}  # each round's prompt steps, host time summed
        apart = {name: {"launched ahead": [], "not launched ahead": []} for name in runs}
        for r in range(args.rounds):
            for name, engine in runs.items():
                for p, sp in zip(prompts, params):
                    engine.add_request(p, sp)
                prompt = 0.0
                while engine.scheduler.waiting or any(s.prefilling for s in engine.scheduler.running):
                    replay_s[0] = 0.0
                    t0 = time.perf_counter()
                    engine.step()  # the prompt steps: apart
                    prompt += time.perf_counter() - t0 - replay_s[0]
                if r:
                    prompts_us[name].append(round(prompt * 1e6, 1))
                host, kinds = [], {"launched ahead": [], "not launched ahead": []}
                while engine.has_work:
                    ahead = engine._ahead_decode is not None
                    replay_s[0] = 0.0
                    t0 = time.perf_counter()
                    engine.step()
                    host.append(time.perf_counter() - t0 - replay_s[0])
                    kinds["launched ahead" if ahead else "not launched ahead"].append(host[-1])
                if r:  # the first round warms up
                    result[name].append(round(statistics.median(host) * 1e6, 1))
                    for kind, times in kinds.items():
                        apart[name][kind].append(round(statistics.median(times) * 1e6, 1) if times else None)
    out = {"batch": args.batch, "skip_forward": args.skip_forward, "spread": args.spread,
           "host_us_per_step_by_round": result, "prompt_steps_host_us_by_round": prompts_us}
    if args.spread > 1:
        out["host_us_per_step_by_kind"] = apart
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
