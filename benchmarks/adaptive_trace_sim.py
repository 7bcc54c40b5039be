"""A model, not a measurement: plain decoding against the fixed tree at batch 1, decided per step from
a sequence's running acceptance estimate, replayed over a recorded acceptance trace
(``record_acceptance.py``: per sequence, the nodes each verified tree accepted). It isolates one
question of adaptive speculation: how much a noisy per-sequence estimate sends sequences to plain
decoding where the tree would have paid, for an EWMA weight and a prior weight (the global
estimate's share, as trees' worth of EWMA mass). Step costs are arguments (default: the H200's
measured batch-1 costs of the shipped head's 59-node tree, verify + draft, and of a plain step).

    python benchmarks/adaptive_trace_sim.py --trace benchmarks/results/acceptance_smollm2_mtbench_cpu.json
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def simulate(traces, weight: float, prior_mass: float, prior: float, tree_ms: float, plain_ms: float,
             probe_every: int, reps: int, max_tokens: int, seed: int = 0) -> tuple[float, float]:
    """(tokens per ms, share of steps decoded plainly). A plain step commits one token; a tree step
    takes the sequence's next recorded acceptance a and commits a + 1; every ``probe_every`` plain
    decisions one tree is tried anyway (the policy's probe). Repeats after the first shuffle each
    sequence's trace (the same acceptance, another order)."""
    rng = np.random.default_rng(seed)
    tokens = ms = 0.0
    plain = trees = 0
    for rep in range(reps):
        for trace in traces:
            order = trace if rep == 0 else rng.permutation(trace)
            s, m, i, since, done = prior * prior_mass, prior_mass, 0, 0, 0
            while done < max_tokens and i < len(order):
                estimate = s / m if m > 0 else prior
                tree = estimate + 1 > tree_ms / plain_ms
                since += 1
                if not tree and since >= probe_every:
                    tree, since = True, 0
                if tree:
                    a = int(order[i])
                    i += 1
                    s, m = s + weight * (a - s), m + weight * (1 - m)
                    tokens, ms, done, trees = tokens + a + 1, ms + tree_ms, done + a + 1, trees + 1
                else:
                    tokens, ms, done, plain = tokens + 1, ms + plain_ms, done + 1, plain + 1
    return tokens / ms, plain / (plain + trees)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--config", default="dynamic:7:10:59")
    ap.add_argument("--tree-ms", type=float, default=2.93)
    ap.add_argument("--plain-ms", type=float, default=1.23)
    ap.add_argument("--prior", type=float, default=2.0, help="the global estimate a sequence starts from")
    ap.add_argument("--probe-every", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    data = json.load(open(args.trace))
    traces = [np.asarray(t) for t in data["configs"][args.config]["traces"]]
    always = sum(t.sum() + len(t) for t in traces) / (sum(len(t) for t in traces) * args.tree_ms)
    print(json.dumps({"tree_every_step_speedup": round(always * args.plain_ms, 3)}))
    for weight in (0.2, 0.1, 0.05):
        for prior_mass in (0.0, 0.5, 0.8):
            rate, share = simulate(traces, weight, prior_mass, args.prior, args.tree_ms, args.plain_ms,
                                   args.probe_every, args.reps, data.get("max_tokens", 128))
            print(json.dumps({"weight": weight, "prior_mass": prior_mass, "speedup": round(rate * args.plain_ms, 3),
                              "plain_share": round(share, 2)}))


if __name__ == "__main__":
    main()
