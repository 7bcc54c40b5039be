"""The adaptive policy's host time per step: what a speculative step of the adaptive engine pays on the
host beside the fixed tree's (a step's decision and what it learns), measured alone.

    python benchmarks/policy_host_cost.py --batch 1 --batch 4 --steps 4000
    python benchmarks/policy_host_cost.py --wave --batch 16 --batch 64 --steps 2000

Each step at batch B, as the engine calls the policy on a chained step of trees: ``choose`` (the
next step's size), ``observe_tree`` per sequence (a 59-node dynamic tree, 7 levels, its accepted
path 0 to 6 nodes long in turn), ``observe_step`` and ``observe_realized``. The costs are a
synthetic table (a forward of 0.7 ms plus 2 us a token and sequence): what is timed is the
policy's Python, not the table's values. Prints and writes (``--out``) microseconds per step,
and the decisions taken, per batch size. ``--wave``: microseconds per call of the policy's looks at
a wave of prompts (``detaches``) and at a batch running without the draft (``trees_pay``) instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.tree_settings import TreeSettings  # noqa: E402
from runtime.tree import CandidateTree  # noqa: E402
from verify_service.adaptive import AdaptivePolicy, PolicyConfig, policy_variant  # noqa: E402
from verify_service.cost_table import CostTable  # noqa: E402

TOKENS = (1, 2, 3, 5, 9, 17, 33, 60)
BATCHES = (1, 4, 16, 64)


def synthetic_table() -> CostTable:
    ms = np.array([[[0.7 + 0.002 * (q - 1) * b for q in TOKENS] for b in BATCHES]])
    return CostTable(BATCHES, TOKENS, (512,), ms)


def dynamic_tree(rng: np.random.Generator, nodes: int = 59, depth: int = 7) -> CandidateTree:
    """A tree shaped as the default dynamic tree's: ``nodes`` nodes over ``depth`` levels, each node's
    parent one of the level above, cumulative log-probabilities falling with the depth."""
    per = np.full(depth, nodes // depth)
    per[: nodes - per.sum()] += 1
    parents, depths, log_probs = [], [], []
    start = 0
    for level, count in enumerate(per, start=1):
        above = np.arange(start - per[level - 2], start) if level > 1 else None
        for _ in range(count):
            parents.append(-1 if above is None else int(rng.choice(above)))
            depths.append(level)
            log_probs.append(-level - float(rng.random()))
        start += count
    return CandidateTree.from_lists(rng.integers(0, 1000, nodes), parents, depths, log_probs)


def accepted_path(tree: CandidateTree, length: int) -> list[int]:
    """The first ``length`` nodes of the path to the tree's last (deepest) node."""
    path, node = [], tree.num_nodes - 1
    while node >= 0:
        path.append(node)
        node = int(tree.parents[node])
    return path[::-1][:length]


def host_cost(batch: int, steps: int, config: PolicyConfig, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    policy = AdaptivePolicy(synthetic_table(), TreeSettings("dynamic", 7, 10, 59), config)
    trees = [dynamic_tree(rng) for _ in range(16)]
    paths = [[accepted_path(t, k) for k in range(7)] for t in trees]
    ids, budgets = list(range(batch)), [59] * batch

    def step(i: int) -> None:
        nodes = policy.choose(batch, 300.0 + i % 200, ids, budgets)
        for s in ids if nodes else ():  # (a plain step verifies no tree)
            t = (i + s) % len(trees)
            policy.observe_tree(s, trees[t], paths[t][(i * 3 + s) % 7], nodes)
        policy.observe_step(batch, nodes, 300.0, 1.45 if nodes else 0.7, chained=bool(nodes))
        policy.observe_realized(batch, 4 * batch if nodes else batch, 1.45 if nodes else 0.7, 0.0, bool(nodes))

    for i in range(200):  # warm: estimates and learned costs past their first values
        step(i)
    start = time.perf_counter()
    for i in range(steps):
        step(i)
    us = (time.perf_counter() - start) / steps * 1e6
    return {"batch": batch, "steps": steps, "us_per_step": round(us, 2),
            "decisions": {str(k): v for k, v in sorted(policy.decisions.items())}}


def wave_cost(batch: int, calls: int, config: PolicyConfig) -> dict:
    """``AdaptivePolicy.detaches`` and ``trees_pay`` alone (a wave of prompts' look, and a detached
    batch's), on a policy that learned draft calls, tree and plain steps at batches 1, 4, 16 and 64."""
    policy = AdaptivePolicy(synthetic_table(), TreeSettings("dynamic", 7, 10, 59), config)
    for b in (1, 4, 16, 64):
        for i in range(40):
            policy.observe_draft(b, 3 + i % 5, 0.3 + 0.05 * (3 + i % 5))
            policy.observe_step(b, 59, 300.0, 1.2 + 0.01 * b)
            policy.observe_step(b, 0, 300.0, 0.7 + 0.005 * b)
    row = {"batch": batch, "calls": calls}
    for name in ("detaches", "trees_pay"):
        call = getattr(policy, name)
        call(batch, 150.0)
        start = time.perf_counter()
        for i in range(calls):
            call(batch, 150.0 + i)
        row[f"{name}_us"] = round((time.perf_counter() - start) / calls * 1e6, 2)
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, action="append", help="batch sizes (default 1 and 4)")
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--variant", default=None, metavar="FIELD=VALUE[,...]", help="PolicyConfig fields changed")
    ap.add_argument("--out", default=None)
    ap.add_argument("--wave", action="store_true", help="time the looks at a wave of prompts instead "
                    "(detaches, trees_pay), --steps calls each")
    args = ap.parse_args(argv)
    config = policy_variant(args.variant) if args.variant else PolicyConfig()
    cost = wave_cost if args.wave else host_cost
    rows = [cost(b, args.steps, config) for b in args.batch or [1, 4]]
    for row in rows:
        print(json.dumps(row))
    if args.out:
        Path(args.out).write_text(json.dumps({"variant": args.variant, "rows": rows}, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
