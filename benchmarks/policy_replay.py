"""Adaptive speculation's choices at batch 1, replayed offline from a recorded acceptance trace.

    python benchmarks/policy_replay.py record --prompts 24 --out trace.json     # fp32 on the CPU, ~7 min
    python benchmarks/policy_replay.py replay trace.json --chained-ms 2.1 --warm 1
    python benchmarks/policy_replay.py depths benchmarks/results/acceptance_smollm2_mtbench80_h200.json

record: greedy decoding of MT-bench first turns with the shipped head and the default dynamic tree
(59 nodes), one request at a time; for every verified tree, what each size the policy may pick
would have accepted (``accepted_within``: exact under greedy verification).

depths: the nodes a step each size would accept if its tree were cut to fewer levels (the draft
runs one level a level of depth, and a size's tree grows ``min(depth, size)`` levels,
``TreeSettings.capped``): the size's accepted count cut at d, as the accepted path holds one node
a level. A lower bound: a tree cut to d levels keeps its best nodes of depth d or less, which can
rank within the size where they did not in the deeper tree.

replay: every sequence's steps through ``AdaptivePolicy`` at batch 1 (a trace of this script's, the
policy picking from its sizes, or ``record_acceptance.py``'s, whose dynamic tree's path ranks give
what any size accepted: the policy's own sizes, ``EAGLE3_TREE_SIZES``), its choices costed with step
times given on the command line (defaults: one H100 at fb60145, SmolLM2 bf16: a plain step launched
ahead 1.02 ms, the first plain one after trees 1.5 ms, a chained step of the largest trees 2.1 ms,
an unchained tree step 1.71 ms plus its draft call 0.30 ms + 0.085 ms a level). A tree chosen at a
position inside a recorded step accepts what that step's tree accepted there, less the tokens
already passed (an approximation, pessimistic for trees chosen after plain steps: the recording
decoded with a tree at every step), or with ``--inside whole`` all of it. ``--warm N``
replays the trace N times first (the policy keeps what it learned, as a serving engine does) and
times the last pass. Prints tokens per ms against target-only decoding, for the fixed tree and the
policy with its defaults and the variants given by ``--variant field=value``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.tree_settings import TreeSettings, tree_sizes  # noqa: E402
from verify_service.adaptive import AdaptivePolicy, PolicyConfig, policy_variant  # noqa: E402
from verify_service.cost_table import CostTable  # noqa: E402

DEFAULT_PROMPTS = Path(__file__).parent / "data" / "mt_bench.jsonl"
LIMITS = TreeSettings("dynamic", 7, 10, 59)  # the tree the traces were recorded with


@dataclass(frozen=True)
class ReplayCosts:
    plain: float = 1.02
    plain_after_tree: float = 1.5
    chained: float = 2.1
    tree_verify: float = 1.71
    draft_fixed: float = 0.30
    draft_level: float = 0.085


def record(args) -> None:
    import torch

    from common.sampling_params import SamplingParams
    from draft_service.drafter import EagleDrafter
    from hub.default_model import ensure_default_model
    from tools.evaluate import parse_config, run
    from tools.train.data import load_prompts
    from verify_service.config import EngineConfig
    from verify_service.engine import Engine
    from verify_service.target import Target

    class Recorder(AdaptivePolicy):
        """The largest tree at every step; what every size would have accepted, per sequence."""
        steps: list = []

        def best(self, batch, context, seq_ids, budgets):
            return self.sizes[-1]

        def observe_accepted(self, seq_id, acc, nodes):
            self.steps.append((seq_id, acc.tolist()))

    torch.manual_seed(0)
    spec = parse_config("dynamic:7:10:59", "default")
    cfg = EngineConfig(str(ensure_default_model(progress=False)), device=args.device, dtype="float32",
                       max_model_len=4096, max_num_seqs=1)
    target = Target.from_config(cfg)
    drafter = EagleDrafter.from_checkpoint(spec, target.model_config, target.model.model.embed_tokens.weight,
                                           1, target.max_model_len, cfg.kernels)
    policy = Recorder(flat_table(), spec.settings, PolicyConfig(probe_every=0))
    engine = Engine(target, drafter, spec.settings, policy)
    prompts = [target.encode(messages=[{"role": "user", "content": t}])
               for t in load_prompts(str(args.prompts_file), args.prompts)]
    run(engine, prompts, SamplingParams(max_tokens=args.max_tokens), 1)
    Path(args.out).write_text(json.dumps({"sizes": list(policy.sizes), "tree": "dynamic:7:10:59",
                                          "steps": policy.steps}))
    print(f"{len(policy.steps)} trees of {len(prompts)} prompts -> {args.out}")


def load_trace(path: str) -> dict:
    """{"sizes", "steps": [[sequence, [accepted by each size]], ...]}: a trace of ``record`` as it is, or
    ``record_acceptance.py``'s (its dynamic:7:10:59 tree's path ranks, counted for the policy's sizes)."""
    from benchmarks.record_acceptance import counts_of  # (it imports this module's flat_table)

    data = json.loads(Path(path).read_text())
    if "configs" not in data:
        return data
    name = f"dynamic:{LIMITS.depth}:{LIMITS.top_k}:{LIMITS.max_nodes}"
    ranks = data["configs"].get(name, {}).get("path_ranks")
    if ranks is None:
        raise SystemExit(f"{path}: no path ranks of {name} (record_acceptance.py --config {name} records them)")
    sizes = list(tree_sizes(LIMITS))
    return {"sizes": sizes, "steps": [[i, counts] for i, seq in enumerate(counts_of(ranks, sizes)) for counts in seq]}


def depth_table(trace: dict) -> dict[int, dict[int, float]]:
    """size -> {levels d: mean accepted nodes a step of the size's tree cut to d levels}, for d from 1
    to the levels the size's tree grows uncut, min(depth, size) (``depths``; whatever ``EAGLE3_TREE_LEVELS`` says)."""
    counts = np.array([accepted for _, accepted in trace["steps"]], dtype=np.int64).reshape(-1, len(trace["sizes"]))
    return {size: {d: round(float(np.minimum(counts[:, j], d).mean()), 3)
                   for d in range(1, min(LIMITS.depth, size) + 1)}
            for j, size in enumerate(trace["sizes"])}


def flat_table() -> CostTable:
    """A flat forward cost (about SmolLM2's on an H100): the replay's step costs are its own."""
    toks = (1, 2, 3, 5, 9, 17, 33, 60, 64)
    return CostTable((1, 2), toks, (1024,), np.array([[[0.95 + 0.001 * (q - 1) for q in toks]] * 2]))


def replay(trace: dict, cfg: PolicyConfig, mode: str, costs: ReplayCosts, warm: int,
           inside: str = "passed") -> tuple[float, Counter]:
    """Tokens per ms over the trace's sequences (``mode``: target, fixed or policy), and the steps by kind.
    ``inside``: what a tree chosen at a position inside a recorded step accepts: that step's tree's
    acceptance less the tokens already passed ("passed": a lower bound, as a tree grown there would
    likely do better) or the whole of it ("whole": as if its tree were grown there)."""
    policy = AdaptivePolicy(flat_table(), LIMITS, cfg, sizes=tuple(trace["sizes"]))  # what the trace counted
    policy.chainable = True
    sizes = list(policy.sizes)
    levels = dict(zip(sizes, policy._levels))
    by_seq: dict[int, list] = {}
    for seq_id, acc in trace["steps"]:
        by_seq.setdefault(seq_id, []).append(np.asarray(acc))
    for rnd in range(warm + 1):
        ms = tokens = 0.0
        kinds: Counter = Counter()
        for seq_id, steps in by_seq.items():
            sid = seq_id + rnd * 1_000_000
            starts = np.cumsum([0] + [1 + int(a[-1]) for a in steps[:-1]])
            length, pos, prev = int(starts[-1] + 1 + steps[-1][-1]), 0, "plain"
            while pos < length:
                i = int(np.searchsorted(starts, pos, side="right") - 1)
                acc = steps[i] if inside == "whole" else np.maximum(steps[i] - (pos - starts[i]), 0)
                n = {"target": 0, "fixed": sizes[-1]}.get(mode)
                if n is None:
                    n = policy.choose(1, 300 + pos, [sid], [sizes[-1]])
                if n:
                    chained = prev == "largest" and n == sizes[-1]
                    draft = costs.draft_fixed + costs.draft_level * (1 + levels[n])
                    step = costs.chained if chained else costs.tree_verify + draft
                    got = int(acc[sizes.index(n)])
                    if mode == "policy":
                        policy.observe_accepted(sid, acc[:sizes.index(n) + 1].astype(float), n)
                        policy.observe_step(1, n, 300 + pos, step if chained else costs.tree_verify, chained=chained)
                        if not chained:
                            policy.observe_draft(1, levels[n], draft)
                    advance, prev = 1 + got, "largest" if n == sizes[-1] else "tree"
                    kinds["chained" if chained else f"tree {n}"] += 1
                else:
                    step = costs.plain if prev == "plain" else costs.plain_after_tree
                    if mode == "policy" and prev == "plain":
                        policy.observe_step(1, 0, 300 + pos, step)
                    advance, prev = 1, "plain"
                    kinds["plain"] += 1
                ms, tokens, pos = ms + step, tokens + min(advance, length - pos), pos + advance
            if mode == "policy":
                policy.release(sid)
    return tokens / ms, kinds


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="record a trace (greedy, fp32)")
    rec.add_argument("--prompts", type=int, default=24)
    rec.add_argument("--prompts-file", default=str(DEFAULT_PROMPTS))
    rec.add_argument("--max-tokens", type=int, default=128)
    rec.add_argument("--device", default="cpu")
    rec.add_argument("--out", required=True)
    dep = sub.add_parser("depths", help="what each size accepts with its tree cut to fewer levels")
    dep.add_argument("trace")
    rep = sub.add_parser("replay", help="replay a trace through the policy")
    rep.add_argument("trace")
    rep.add_argument("--warm", type=int, default=1, help="passes before the timed one")
    rep.add_argument("--variant", action="append", default=[], help="PolicyConfig field=value[,field=value], e.g. probe_every=16")
    rep.add_argument("--inside", choices=("passed", "whole"), default="passed",
                     help="a tree chosen inside a recorded step accepts its acceptance less the tokens passed, or whole")
    for field, value in ReplayCosts().__dict__.items():
        rep.add_argument(f"--{field.replace('_', '-')}-ms", type=float, default=value, dest=field)
    args = ap.parse_args(argv)
    if args.cmd == "record":
        return record(args)
    trace = load_trace(args.trace)
    if args.cmd == "depths":
        table = depth_table(trace)
        print(f"{len(trace['steps'])} steps; mean accepted nodes a step by tree size and levels:")
        for size, by_levels in table.items():
            print(f"  {size:>3} nodes: " + "  ".join(f"{d} levels {v:.3f}" for d, v in by_levels.items()))
        return table
    costs = ReplayCosts(**{f: getattr(args, f) for f in ReplayCosts().__dict__})
    base, _ = replay(trace, PolicyConfig(), "target", costs, 0, args.inside)
    fixed, _ = replay(trace, PolicyConfig(), "fixed", costs, 0, args.inside)
    print(f"fixed tree: {fixed / base:.3f}x target-only")
    variants = [("defaults", PolicyConfig())] + [(v, policy_variant(v)) for v in args.variant]
    for name, cfg in variants:
        rate, kinds = replay(trace, cfg, "policy", costs, args.warm, args.inside)
        print(f"policy, {name}: {rate / base:.3f}x target-only ({rate / fixed:.3f} of the fixed tree)  {dict(kinds)}")


if __name__ == "__main__":
    main()
