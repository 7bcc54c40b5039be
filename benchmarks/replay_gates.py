"""REPLAY benchmark of the seed gates at Llama-3-8B scale: target-only against EAGLE-3 speculation
through the real engine, random weights, acceptance REPLAYED from a recorded trace.

No trained 8B target and head are at hand, and random weights accept nothing, so the acceptance
comes from a trace recorded with SmolLM2 and its shipped head on MT-bench
(``benchmarks/record_acceptance.py``): per sequence per step the verifier accepts as many nodes as
the trace says (``verify_service/replay.py``). Everything timed is real: the draft head (the 8B
geometry, random weights) grows its trees, the target verifies every node, the KV of the accepted
nodes is compacted, the draft extends over them. The OUTPUT IS MEANINGLESS; the JSON says REPLAY.

    python benchmarks/replay_gates.py --device cuda --dtype bfloat16 --out replay_gates.json
    python benchmarks/replay_gates.py --geometry tiny --device cpu --dtype float32 --case 64:1 --steps 8

A case is CONTEXT:BATCH (default: the gates 32768:1 and 16384:4, then 4096:1 and 4096:16). Each
case runs target-only once, then every ``--config`` of the trace (default chain:3, the gates' three
speculative tokens, and dynamic:7:10:59), and with ``--adaptive`` the adaptive policy on top.
Reported per row: tok/s, speed-up over target-only, tau (tokens per verification step, replayed),
efficiency = speed-up / tau. The policy's smaller trees accept what that size accepted at the same
recorded step (a dynamic config's path ranks or per-size counts, which ``--adaptive`` requires of the trace).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.decode_baseline import GEOMETRIES  # noqa: E402
from common.config import ModelConfig  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402
from draft_service.drafter import EagleDrafter  # noqa: E402
from draft_service.eagle_init import write_random_head  # noqa: E402
from runtime.block_manager import blocks_for  # noqa: E402
from tools.evaluate import parse_config  # noqa: E402
from common.tree_settings import TREE_SIZES, TreeSettings, tree_sizes  # noqa: E402
from verify_service.adaptive import AdaptivePolicy, policy_variant  # noqa: E402
from verify_service.config import EngineConfig  # noqa: E402
from verify_service.cost_table import CostGrid, calibrate  # noqa: E402
from verify_service.engine import Engine  # noqa: E402
from verify_service.loader import build_model, random_tensors  # noqa: E402
from verify_service.replay import AcceptanceReplay  # noqa: E402
from verify_service.target import Target  # noqa: E402

TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "eos_token_id": 255}
DEFAULT_TRACE = Path(__file__).parent / "results" / "acceptance_smollm2_mtbench80_h200.json"
DEFAULT_CASES = ("32768:1", "16384:4", "4096:1", "4096:16")
# The seed documents' gates (../shared/REFERENCE.md): speed-up over target-only and tau at least these.
GATES = {(32768, 1): {"speedup": 2.0, "tau": 3.0}, (16384, 4): {"speedup": 1.0, "tau": 2.2}}
WARMUP_TOKENS = 8  # per sequence, untimed: CUDA graphs are captured, kernels compiled


def build_target(raw: dict, context: int, batch: int, new_tokens: int, device: str, dtype: str, kernels: str,
                 tree_slots: int, exact: bool | None = None) -> Target:
    """A target with random weights, its KV cache sized for ``batch`` sequences of the case."""
    max_len = context + WARMUP_TOKENS + new_tokens + 16
    mcfg = ModelConfig.from_hf(raw)
    torch_dtype = getattr(torch, dtype)
    cfg = EngineConfig("<random>", device=device, dtype=dtype, max_model_len=max_len, max_num_seqs=batch,
                       max_batch_tokens=8192, kernels=kernels, exact=exact,
                       num_kv_blocks=batch * blocks_for(max_len + tree_slots, 16) + 4)
    tensors = random_tensors(mcfg, seed=0, device=device, dtype=torch_dtype)
    model = build_model(mcfg, tensors.items(), torch_dtype, torch.device(device), max_len)
    del tensors
    return Target(cfg, model, tokenizer=None)


def timed_run(engine: Engine, prompts: list[list[int]], new_tokens: int, profile_slowest: bool = False) -> dict:
    """Prefill, WARMUP_TOKENS untimed, then time until every sequence has ``new_tokens`` more.
    ``profile_slowest``: every timed step under cProfile (slower), the slowest step's printed."""
    params = SamplingParams(max_tokens=WARMUP_TOKENS + new_tokens, ignore_eos=True)
    seqs = [engine.sequences[engine.add_request(p, params)] for p in prompts]
    while any(len(s.output_ids) < WARMUP_TOKENS for s in seqs):
        engine.step()
    before = sum(len(s.output_ids) for s in seqs)
    spec_before = engine.speculation_totals()
    steps, step_ms = 0, []
    sync(engine)
    start = time.perf_counter()
    slowest = (0.0, None)
    while engine.has_work:
        prof = cProfile.Profile() if profile_slowest else None
        t = time.perf_counter()
        if prof is not None:
            prof.enable()
        engine.step()  # ends in the step's device-to-host copy
        if prof is not None:
            prof.disable()
        step_ms.append((time.perf_counter() - t) * 1e3)
        if step_ms[-1] > slowest[0]:
            slowest = (step_ms[-1], prof)
        steps += 1
    if slowest[1] is not None:
        print(f"the slowest step ({slowest[0]:.2f} ms, step {int(np.argmax(step_ms))}), by cumulative time:")
        pstats.Stats(slowest[1]).sort_stats("cumulative").print_stats(25)
    seconds = time.perf_counter() - start
    tokens = sum(len(s.output_ids) for s in seqs) - before
    spec = engine.speculation_totals()
    trees, accepted = spec.steps - spec_before.steps, spec.accepted_tokens - spec_before.accepted_tokens
    out = {"tokens": tokens, "steps": steps, "seconds": round(seconds, 4), "tok_s": round(tokens / seconds, 2),
           "step_ms_median": round(float(np.median(step_ms)), 3), "step_ms_max": round(max(step_ms), 3),
           "step_max_at": int(np.argmax(step_ms))}  # which step (0: the first timed): a stall's place
    if trees:
        out["tau"] = round(1 + accepted / trees, 3)
    return out


def policy_report(policy: AdaptivePolicy, engine: Engine) -> dict:
    """Why the adaptive rows chose what they did: the calibrated forward costs, the switches between
    plain decoding and trees (and their reasons), probes and vetoes, the requests that ran without
    the draft, and what the cost model learned against what it measured."""
    table, detacher = policy.table, engine.speculation.detacher
    return {"forward_ms": {f"b{b} q{q}": round(float(policy.table.ms[0, i, j]), 3)
                           for i, b in enumerate(table.batches) for j, q in enumerate(table.tokens)},
            "switches": dict(policy.switches), "probes": policy.probes, "vetoes": policy.vetoes,
            "detached_requests": detacher.detached_requests if detacher else None,
            "left_requests": detacher.left_requests if detacher else None,
            "reattached_requests": detacher.reattached_requests if detacher else None,
            "costs": policy.costs.diagnostics()}


def sync(engine: Engine) -> None:
    if engine.target.device.type == "cuda":
        torch.cuda.synchronize(engine.target.device)


def run_case(args, raw: dict, head: str, traces: dict, case: str) -> list[dict]:
    context, batch = (int(x) for x in case.split(":"))
    specs = {name: parse_config(name, head) for name in args.config}
    slots = max(s.settings.tree_kv_slots for s in specs.values())
    target = build_target(raw, context, batch, args.steps, args.device, args.dtype, args.kernels, slots, args.exact)
    args.exact_numerics = target.exact
    g = torch.Generator().manual_seed(context + batch)
    prompts = [torch.randint(0, raw["vocab_size"] - 1, (context,), generator=g).tolist() for _ in range(batch)]
    # As a server starts: every graph either engine replays is captured before anything is timed (a
    # batch that shrinks as its sequences finish would otherwise capture in the first timed run).
    # With the adaptive rows, every size the policy may pick, as the services and the in-process engine
    # warm up (``tools/inprocess.build_engine``): a size left out is captured, or its step padded to a
    # captured one, while timed.
    sizes = {name: tree_sizes(s.settings) if args.adaptive else (s.settings.node_budget,) for name, s in specs.items()}
    trees = tuple(sorted({n + 1 for v in sizes.values() for n in v}))
    target.runner.warm_up(target.cfg.max_batch_tokens, trees)
    base = timed_run(Engine(target), prompts, args.steps)
    rows = [{"context": context, "batch": batch, "config": "target-only", **base}]
    print(f"ctx {context:>6} batch {batch:>3} target-only      {base['tok_s']:9.1f} tok/s  step median "
          f"{base['step_ms_median']} ms, max {base['step_ms_max']} ms", flush=True)
    for name, spec in specs.items():
        drafter = EagleDrafter.from_checkpoint(spec, target.model_config, target.model.model.embed_tokens.weight,
                                               batch, target.max_model_len, args.kernels)
        # as a server does: no graph captured while timed (batches shrink at the end), with the policy
        # every size it may pick
        drafter.warm_up([spec.settings.capped(n) for n in sizes[name]] if args.adaptive else None, chained=True)
        runs = [("replay", None)] + ([("replay, unchained", None)] if args.unchained else [])
        if args.adaptive:
            grid = CostGrid(tuple(sorted({1, batch})), tuple(sorted({1, *(n + 1 for n in sizes[name])})),
                            (context,), reps=3)
            table = calibrate(target, grid)
            runs.append(("replay+adaptive", AdaptivePolicy(table, spec.settings)))
            runs += [(f"replay+adaptive {text}", AdaptivePolicy(table, spec.settings, policy_variant(text)))
                     for text in args.adaptive_variant]
        for mode, policy in runs:
            replay = AcceptanceReplay.of_config(traces[name])
            engine = Engine(target, drafter, spec.settings, policy, replay)
            engine.speculation.chain = mode != "replay, unchained"
            target.runner.warm_up(target.cfg.max_batch_tokens, trees)  # a drafter's capture layers: new graphs
            warm = set(target.runner.graphs._graphs)
            # A policy that has already served (``--adaptive-warm``): as many runs of the same requests
            # first, the policy keeping what it learned, as a running server's has.
            before = [timed_run(engine, prompts, args.steps)["tok_s"] for _ in range(args.adaptive_warm if policy else 0)]
            r = timed_run(engine, prompts, args.steps, args.profile_slowest)
            if set(target.runner.graphs._graphs) - warm:  # a capture while timed: the warm-up missed a shape
                print(f"graphs captured while timed: {sorted(map(str, set(target.runner.graphs._graphs) - warm))}")
            row = {"context": context, "batch": batch, "config": f"{name} ({mode})", **r,
                   "speedup": round(r["tok_s"] / base["tok_s"], 3), "trace_tau": traces[name]["tau"]}
            if "tau" in r:
                row["efficiency"] = round(row["speedup"] / r["tau"], 3)
            if before:
                row["speedups_before"] = [round(t / base["tok_s"], 3) for t in before]  # the warm runs', in order
            if policy is not None:
                row["decisions"] = {str(k): v for k, v in sorted(policy.decisions.items())}
                row["policy"] = policy_report(policy, engine)
            gate = GATES.get((context, batch))
            if gate:
                row["gate"] = {**gate, "met": row["speedup"] >= gate["speedup"] and r.get("tau", 0) >= gate["tau"]}
            rows.append(row)
            print(f"ctx {context:>6} batch {batch:>3} {row['config']:<28} {r['tok_s']:9.1f} tok/s  x{row['speedup']:<6} "
                  f"tau {r.get('tau', '-')}  efficiency {row.get('efficiency', '-')}  step median {r['step_ms_median']} ms, "
                  f"max {r['step_ms_max']} ms (step {r['step_max_at']} of {r['steps']})"
                  + (f"; warm runs before it x{row['speedups_before']}" if before else ""), flush=True)
        del drafter
    del target
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--geometry", default="llama3-8b", help="llama3-8b, smollm2 or tiny (random weights)")
    ap.add_argument("--trace", default=str(DEFAULT_TRACE), help="benchmarks/record_acceptance.py output")
    ap.add_argument("--config", action="append", help="trace configs to replay (default: every one in the trace)")
    ap.add_argument("--case", action="append", help="CONTEXT:BATCH (repeatable; default: " + ", ".join(DEFAULT_CASES))
    ap.add_argument("--steps", type=int, default=128, help="timed new tokens per sequence")
    ap.add_argument("--draft-vocab", type=int, default=32000, help="the random head's draft vocabulary")
    ap.add_argument("--adaptive", action="store_true", help="also run the adaptive policy (cost table measured first)")
    ap.add_argument("--adaptive-variant", action="append", default=[], metavar="FIELD=VALUE[,...]",
                    help="with --adaptive: also a policy with these PolicyConfig fields changed (repeatable), "
                         "e.g. prior_acceptance=0.85 or leave_from=0")
    ap.add_argument("--adaptive-warm", type=int, default=0, metavar="N",
                    help="with --adaptive: each policy first serves the same requests N times untimed-for-the-row "
                         "(their speed-ups listed as speedups_before), then the timed run: a policy that has "
                         "learned, as a running server's has")
    ap.add_argument("--unchained", action="store_true",
                    help="also run each tree with the draft called after the step's sync (not chained behind "
                         "acceptance on the device): the two side by side")
    ap.add_argument("--profile-slowest", action="store_true",
                    help="time the speculative runs' steps under cProfile and print the slowest step's profile")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kernels", default="auto", choices=["auto", "triton", "reference"])
    ap.add_argument("--exact", action=argparse.BooleanOptionalAction, default=None,
                    help="the target's batch-invariant kernels (default: the engine's, on CUDA)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if (args.adaptive_variant or args.adaptive_warm) and not args.adaptive:
        ap.error("--adaptive-variant and --adaptive-warm need --adaptive")
    for text in args.adaptive_variant:
        try:
            policy_variant(text)
        except ValueError as exc:
            ap.error(f"--adaptive-variant {text!r}: {exc}")
    trace = json.loads(Path(args.trace).read_text())
    args.config = args.config or list(trace["configs"])
    unknown = [name for name in args.config if name not in trace["configs"]]
    if unknown:
        ap.error(f"--config {unknown[0]!r}: the trace has {sorted(trace['configs'])}")
    for name in args.config if args.adaptive else ():  # the policy's smaller trees need their own counts
        entry = trace["configs"][name]
        recorded = entry.get("per_size", {}).get("sizes", ())
        missing = set(tree_sizes(TreeSettings(**entry["tree"]))) - set(recorded)
        if entry["tree"]["tree"] == "dynamic" and "path_ranks" not in entry and missing:
            ap.error(f"--adaptive: the trace's {name} has counts for sizes {list(recorded)}, not for {sorted(missing)} "
                     f"the policy picks from (EAGLE3_TREE_SIZES={TREE_SIZES}): its smaller trees would replay another "
                     "size's acceptance; record it again (record_acceptance.py keeps path ranks, which replay any size)")
    raw = TINY if args.geometry == "tiny" else GEOMETRIES[args.geometry]
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    report = {"kind": "replay_gates",
              "REPLAY": f"acceptance REPLAYED from {Path(args.trace).name} ({trace.get('model')} + head "
                        f"{trace.get('head')}, {trace.get('prompts')}); random weights, outputs meaningless, "
                        "timing real",
              "device": device_name, "torch": torch.__version__, "geometry": args.geometry, "dtype": args.dtype,
              "kernels": args.kernels, "new_tokens": args.steps,
              "trace": {name: {**{k: trace["configs"][name][k] for k in ("tree", "tau", "acceptance_per_depth")},
                               **({"tau_per_size": dict(zip(*(trace["configs"][name]["per_size"][k]
                                                              for k in ("sizes", "tau"))))}
                                  if "per_size" in trace["configs"][name] else {})}
                        for name in args.config},
              "cases": []}
    with tempfile.TemporaryDirectory(prefix="eagle3-replay-head-") as tmp:
        head = str(write_random_head(tmp, raw, min(args.draft_vocab, raw["vocab_size"])))
        for case in args.case or DEFAULT_CASES:
            report["cases"] += run_case(args, raw, head, trace["configs"], case)
            report["exact_numerics"] = args.exact_numerics
            if args.out:  # after each case: what was measured survives a run cut short
                Path(args.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
