"""Speed report: tok/s and speed-up against batch size, verify cost against tree size and context,
tau per depth, with Hugging Face transformers beside the engine on the same weights and prompts.

    python benchmarks/speed_report.py --device cuda --dtype bfloat16 --out speed_report.json
    python benchmarks/plot.py speed_report.json          # the PNGs, where matplotlib is installed

Rows per batch size (the first max(batch, --min-prompts) MT-bench first turns, chat template, greedy,
``--max-tokens`` new tokens at most, generated ``batch`` at a time): target-only (the reference),
EAGLE-3 with the fixed tree (default: the device's), EAGLE-3 with adaptive speculation (its cost table
measured first), transformers ``generate`` (left-padded batches) and its assisted generation where
it applies: prompt lookup (``prompt_lookup_num_tokens``), which needs no second model, at batch 1
(transformers assists one sequence at a time; SmolLM2-135M has no smaller sibling to assist it).
``--adaptive-variant FIELD=VALUE[,...]`` adds an adaptive engine whose ``PolicyConfig`` has
those fields changed, run in the same rounds (policy variants side by side on one machine).
``--control`` adds a second target-only engine, paired with the first like the others: its speed-up
is the pairing's own noise (how far from 1.0 an engine that does the same work reads).
Each row says how many outputs equal the target-only ones. The three engines are loaded together and
run in turn, ``--rounds`` times per batch size, their order rotated each round; each row's time is
its median round, so a speed-up compares runs made minutes apart at most, not a whole report apart;
``speedup_paired`` is the median over rounds of each round's speed-up against the reference's run of
the same round (seconds apart), ``speedup_best`` their fastest rounds' ratio (what a machine whose
speed drifts between rounds still shows), and each row gives its rounds' slowest step and the CUDA caching
allocator's device allocations, frees and retries (what stalls a round beside the engine's work). Verify cost: the target's forward
(``verify_service/cost_table.py``) over tokens per sequence x context x batch. tau per depth: the
share of verification steps that accepted a node at depth d, per speculative row at batch 1.
A model directory without a tokenizer (tests) gets prompts of token ids derived from the text.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import pstats
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.gc_heap import GcPauses, freeze_startup_heap  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402
from common.tree_settings import default_tree  # noqa: E402
from hub.default_model import ensure_default_model  # noqa: E402
from kernels.compile_watch import CompileWatch  # noqa: E402
from tools.evaluate import parse_config, run, summarize  # noqa: E402
from tools.inprocess import build_engine  # noqa: E402
from tools.train.data import load_prompts  # noqa: E402
from verify_service.adaptive import policy_variant  # noqa: E402
from verify_service.config import EngineConfig  # noqa: E402
from verify_service.cost_table import CostGrid, calibrate  # noqa: E402

DEFAULT_PROMPTS = Path(__file__).parent / "data" / "mt_bench.jsonl"
WATCH = CompileWatch(logging.getLogger("speed_report"), "the engine's warm-up")


def prompt_ids(engine, texts: list[str]) -> list[list[int]]:
    if engine.target.tokenizer is None:  # a test model: ids from the text's bytes
        vocab = engine.target.model_config.vocab_size
        return [[b % (vocab - 1) for b in t.encode()[:64]] for t in texts]
    return [engine.target.encode(messages=[{"role": "user", "content": t}]) for t in texts]


class RoundProbe:
    """What one engine's round did beside its work: its slowest step, the wall time of its steps that
    began with a prompt to run (a request waiting or prefilling) and of the others, and the CUDA caching
    allocator's device allocations, frees and retries (a cudaMalloc, or an allocation retried once the
    cache is emptied, stalls the stream for milliseconds: a round's time then says little about the engine)."""

    COUNTERS = ("segment.all.allocated", "segment.all.freed", "num_alloc_retries")

    def __init__(self, engine, device: str):
        self.engine, self.cuda = engine, device.startswith("cuda")
        self.slowest_ms = 0.0
        self.prompt_ms, self.prompt_steps, self.other_ms = 0.0, 0, 0.0
        self.counts = dict.fromkeys(self.COUNTERS, 0)

    def __enter__(self):
        step, sched = type(self.engine).step, self.engine.scheduler

        def timed(*args, **kwargs):
            prompt = bool(sched.waiting) or any(s.prefilling for s in sched.running)
            t0 = time.perf_counter()
            try:
                return step(self.engine, *args, **kwargs)
            finally:
                ms = (time.perf_counter() - t0) * 1e3
                self.slowest_ms = max(self.slowest_ms, ms)
                if prompt:
                    self.prompt_ms += ms
                    self.prompt_steps += 1
                else:
                    self.other_ms += ms

        self.engine.step = timed
        self._before = torch.cuda.memory_stats() if self.cuda else {}
        return self

    def __exit__(self, *exc):
        del self.engine.step  # the class's own again
        after = torch.cuda.memory_stats() if self.cuda else {}
        self.counts = {k: after.get(k, 0) - self._before.get(k, 0) for k in self.COUNTERS}


def batch_prompts(path: str, n: int) -> tuple[list[str], int]:
    """``n`` first turns of the prompt file: all of them, repeated in order as many times as it takes
    when the file holds fewer (MT-bench has 80: a batch of 128 is 128 requests in flight, not 80).
    Returns the prompts and how many of them are distinct."""
    texts = load_prompts(path)
    return [texts[i % len(texts)] for i in range(n)], min(n, len(texts))


def engine_rows(engines: list[tuple[str, object]], prompts, batches, min_prompts: int, params, rounds: int,
                reference, gc_freeze: bool = True, device: str = "cpu") -> list[dict]:
    """One row per engine and batch size. The engines run in turn ``rounds`` times per batch size (the
    order rotated each round), so a drift of the machine's speed (clocks, other load) reaches them all
    alike; a row's seconds are its median round. ``reference`` (the first engine's outputs and median
    seconds per batch) is filled here: the first engine must be target-only. ``gc_freeze``: the heap
    frozen after the warm-up, as the services freeze theirs (``common/gc_heap.py``); each row says what
    the garbage collector took in its rounds."""
    for _, engine in engines:
        run(engine, prompts[:2], params, 1)  # warm-up: kernels, CUDA graphs
    if gc_freeze:
        freeze_startup_heap()
    pauses = GcPauses().install()
    rows = []
    for b in batches:
        ps = prompts[:max(b, min_prompts)]
        runs: dict[str, list] = {name: [] for name, _ in engines}
        decisions = {name: Counter() for name, _ in engines}
        compiled = {name: 0 for name, _ in engines}
        collected = {name: [0, 0.0] for name, _ in engines}  # full collections, seconds of all collections
        probes = {name: [] for name, _ in engines}
        for r in range(rounds):
            for name, engine in engines[r % len(engines):] + engines[:r % len(engines)]:
                policy = getattr(engine, "policy", None)
                before = Counter(policy.decisions) if policy else None
                count, (gcs, gc_s) = WATCH.compilations, pauses.snapshot()
                with RoundProbe(engine, device) as probe:
                    runs[name].append(run(engine, ps, params, b))
                probes[name].append(probe)
                compiled[name] += WATCH.compilations - count
                collected[name][0] += pauses.collections[2] - gcs[2]
                collected[name][1] += sum(pauses.seconds) - sum(gc_s)
                if policy:
                    decisions[name] += policy.decisions - before
        for name, engine in engines:
            outputs, _, metrics = runs[name][0]
            seconds = [secs for _, secs, _ in runs[name]]
            ref_out, ref_secs = reference.setdefault(b, (outputs, statistics.median(seconds)))
            row = summarize(name, outputs, statistics.median(seconds), metrics if metrics and metrics[0] else None,
                            ref_out, ref_secs)
            if row.get("tau") == 0.0:  # no tree verified (adaptive speculation decoded plainly throughout)
                del row["tau"], row["acceptance_per_depth"]
            row["seconds_per_round"] = [round(x, 4) for x in seconds]
            if name != engines[0][0]:  # each round against the reference's of the same round (run minutes apart at most)
                ref_rounds = [secs for _, secs, _ in runs[engines[0][0]]]
                tokens = sum(map(len, outputs)) / sum(map(len, ref_out))
                row["speedup_paired"] = round(statistics.median(r / x for r, x in zip(ref_rounds, seconds)) * tokens, 3)
                row["speedup_best"] = round(min(ref_rounds) / min(seconds) * tokens, 3)  # each one's fastest round
            row["slowest_step_ms_per_round"] = [round(p.slowest_ms, 1) for p in probes[name]]
            row["prompt_steps_per_round"] = [p.prompt_steps for p in probes[name]]
            row["prompt_steps_ms_per_round"] = [round(p.prompt_ms, 2) for p in probes[name]]
            row["other_steps_ms_per_round"] = [round(p.other_ms, 2) for p in probes[name]]
            row["allocator"] = {k: sum(p.counts[k] for p in probes[name]) for k in RoundProbe.COUNTERS}
            row["compilations"] = compiled[name]  # Triton compilations inside the timed runs
            row["gc"] = {"full_collections": collected[name][0], "ms": round(collected[name][1] * 1e3, 2)}  # all rounds
            policy = getattr(engine, "policy", None)
            if policy:  # this batch's decisions, and the policy's model against the steps it measured
                detacher = engine.speculation.detacher
                row["adaptive"] = {**policy.diagnostics(),
                                   "decisions": {str(k): v for k, v in sorted(decisions[name].items())},
                                   "requests_without_draft": detacher.detached_requests,  # since start, all batches
                                   "requests_left_draft": detacher.left_requests}
            rows.append({"batch": b, **row})
            print(json.dumps(rows[-1]), flush=True)
    pauses.remove()
    return rows


def profile_run(name: str, engine, prompts, params, batch: int, dump: str | None = None) -> str:
    """One run under cProfile: the functions by own time and by cumulative time (``dump``: also the
    raw statistics to this path, for ``profile_diff.py``)."""
    prof = cProfile.Profile()
    prof.enable()
    _, secs, _ = run(engine, prompts, params, batch)
    prof.disable()
    if dump:
        prof.dump_stats(dump)
    text = io.StringIO()
    text.write(f"=== {name}, batch {batch}: {secs:.3f} s under the profiler ===\n")
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(30)
    return text.getvalue()


def hf_rows(model_dir: str, prompts, batches, min_prompts: int, max_tokens: int, device: str, dtype,
            eos: tuple[int, ...], reference) -> list[dict]:
    """transformers generate at every batch size, prompt-lookup assisted generation at batch 1."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    pad = eos[0] if eos else 0
    rows = []
    cases = [(b, "hf generate", {}) for b in batches] + [(1, "hf assisted (prompt lookup)", {"prompt_lookup_num_tokens": 10})]
    for b, name, extra in cases:
        if b not in reference:
            continue
        ps = prompts[:max(b, min_prompts)]
        _hf_generate(model, ps[:1], 1, 4, pad, device, extra)  # warm-up
        sync(device)
        start = time.perf_counter()
        outputs = []
        for i in range(0, len(ps), b):
            outputs += _hf_generate(model, ps[i:i + b], b, max_tokens, pad, device, extra)
        sync(device)
        secs = time.perf_counter() - start
        outputs = [_cut_at_eos(o, eos) for o in outputs]
        row = {"batch": b, **summarize(name, outputs, secs, None, *reference[b])}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


@torch.inference_mode()
def _hf_generate(model, prompts, b, max_tokens, pad, device, extra) -> list[list[int]]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                         pad_token_id=pad, **extra)
    return out[:, width:].tolist()


def _cut_at_eos(tokens: list[int], eos: tuple[int, ...]) -> list[int]:
    """transformers pads finished rows with eos: keep up to and including the first (as the engine does)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1]
    return tokens


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def tau_per_depth(rows: list[dict]) -> dict:
    first = min(r["batch"] for r in rows)
    return {r["config"]: {"tau": r["tau"], "acceptance_per_depth": r["acceptance_per_depth"]}
            for r in rows if r["batch"] == first and "tau" in r}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="target model directory (default: embedded SmolLM2)")
    ap.add_argument("--head", default="default", help="EAGLE-3 head directory, or 'default' (the shipped one)")
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    ap.add_argument("--batch", type=int, action="append", help="batch sizes (default 1, 4, 16, 64)")
    ap.add_argument("--min-prompts", type=int, default=4, help="prompts per batch size at least")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--tree", default=None, help="TREE:DEPTH[:TOP_K[:NODES]] (default: the device's default tree)")
    ap.add_argument("--no-adaptive", action="store_true", help="skip the adaptive speculation rows")
    ap.add_argument("--adaptive-variant", action="append", default=[], metavar="FIELD=VALUE[,FIELD=VALUE]",
                    help="one more adaptive engine, its PolicyConfig with these fields changed, in the same rounds")
    ap.add_argument("--control", action="store_true",
                    help="a second target-only engine in the same rounds: the pairing's own noise")
    ap.add_argument("--build-order", choices=("listed", "reversed"), default="listed",
                    help="load the engines in their rows' order (target-only first) or the reverse: a later "
                    "loaded engine may run slower on the same work (see --control)")
    ap.add_argument("--profile-batch", type=int, default=None, help="after the rows, one more run of every "
                    "engine at this batch size under cProfile: OUT.profile.txt (where the host time goes)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of every engine per batch size, in turn; "
                    "rows report the median (the engines are all loaded at once)")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    ap.add_argument("--gc-freeze", choices=("on", "off"), default="on",
                    help="freeze the heap after the engines' warm-up, as the services do (off: as before they did)")
    ap.add_argument("--verify-tokens", type=int, action="append", help="default 1, 2, 4, 8, 16, 32, 64")
    ap.add_argument("--verify-contexts", type=int, action="append", help="default 512, 2048, 6144")
    ap.add_argument("--verify-batches", type=int, action="append", help="default 1, 16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--exact", action=argparse.BooleanOptionalAction, default=None,
                    help="the batch-invariant target kernels, or not (default: the engine's, on on CUDA)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    try:
        variants = [(text, policy_variant(text)) for text in args.adaptive_variant]
    except ValueError as exc:
        ap.error(f"--adaptive-variant {exc}")
    batches = sorted(set(args.batch or [1, 4, 16, 64]))
    model = args.model or str(ensure_default_model(progress=False))
    tree = args.tree or _tree_text(default_tree(args.device.partition(":")[0]))
    spec = parse_config(tree, args.head)
    texts, distinct = batch_prompts(args.prompts, max(max(batches), args.min_prompts))
    longest = max(args.verify_contexts or [6144]) + max(args.verify_tokens or [64]) + 1
    cfg = EngineConfig(model, device=args.device, dtype=args.dtype, max_model_len=max(4096, longest),
                       max_num_seqs=max(batches), exact=args.exact)
    params = SamplingParams(max_tokens=args.max_tokens)
    report = {"kind": "speed_report", "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "model": Path(model).name, "head": args.head, "dtype": args.dtype,
              "prompts": f"{Path(args.prompts).name}, first turns, chat template",
              "distinct_prompts": distinct, "max_tokens": args.max_tokens,
              "tree": tree, "batches": batches, "throughput": []}
    reference: dict[int, tuple] = {}
    # Each engine loads its own target (weights, KV cache, graphs), in list order or the reverse.
    builders = [("target-only", lambda: build_engine(cfg)), (f"eagle3 {tree}", lambda: build_engine(cfg, spec))]
    if args.control:
        builders.append(("target-only (control)", lambda: build_engine(cfg)))
    if not args.no_adaptive:
        builders.append((f"eagle3 adaptive (limits {tree})", lambda: build_engine(cfg, spec, adaptive=True)))
        builders += [(f"eagle3 adaptive ({text})",
                      lambda config=config: build_engine(cfg, spec, adaptive=True, policy_config=config))
                     for text, config in variants]
    order = builders if args.build_order == "listed" else builders[::-1]
    built = {name: make() for name, make in order}
    report["build_order"] = [name for name, _ in order]
    engines = [(name, built[name]) for name, _ in builders]
    engine = engines[0][1]
    report["exact"] = engine.target.exact  # the target's numerics (batch-invariant or the fastest)
    adaptive = None if args.no_adaptive else engines[3 if args.control else 2][1]  # the default policy's engine
    prompts = prompt_ids(engine, texts)
    eos = engine.target.model_config.eos_token_ids
    report["verify_cost"] = _verify_cost(engine.target, args).to_json()  # before any request: see calibrate
    if args.device.startswith("cuda"):
        WATCH.start()  # every engine warmed up: from here a compilation is logged, and rows count theirs
    report["rounds"] = args.rounds
    report["gc_freeze"] = args.gc_freeze
    report["throughput"] += engine_rows(engines, prompts, batches, args.min_prompts, params, args.rounds, reference,
                                        args.gc_freeze == "on", args.device)
    if adaptive is not None:
        report["adaptive_decisions"] = {str(k): v for k, v in sorted(adaptive.policy.decisions.items())}
    if args.profile_batch:
        b = args.profile_batch
        Path(args.out + ".profile.txt").write_text(
            "".join(profile_run(name, e, prompts[:max(b, args.min_prompts)], params, b) for name, e in engines))
    del engine, engines, adaptive, built
    report["tau_per_depth"] = tau_per_depth(report["throughput"])
    report["hf"] = _hf(args, model, prompts, batches, eos, reference, report)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return report


def _hf(args, model, prompts, batches, eos, reference, report) -> dict:
    if args.no_hf:
        return {"ran": False, "why": "--no-hf"}
    try:
        import transformers
    except ImportError:
        return {"ran": False, "why": "transformers is not installed"}
    try:
        rows = hf_rows(model, prompts, batches, args.min_prompts, args.max_tokens, args.device,
                       getattr(torch, args.dtype), eos, reference)
    except Exception as exc:  # reported, not hidden: the JSON says transformers did not run
        return {"ran": False, "transformers": transformers.__version__, "error": f"{type(exc).__name__}: {exc}"[:500]}
    report["throughput"] += rows
    return {"ran": True, "transformers": transformers.__version__,
            "assisted": "prompt lookup (prompt_lookup_num_tokens=10), batch 1: transformers assists one sequence "
                        "at a time, and SmolLM2-135M has no smaller model to assist it"}


def _verify_cost(target, args):
    tokens = tuple(sorted(set(args.verify_tokens or [1, 2, 4, 8, 16, 32, 64])))
    contexts = tuple(sorted(set(args.verify_contexts or [512, 2048, 6144])))
    batches = tuple(sorted(set(args.verify_batches or [1, 16])))
    batches = tuple(b for b in batches if b <= target.cfg.max_num_seqs) or (1,)
    return calibrate(target, CostGrid(batches, tokens, contexts, reps=5, warmup=2))


def _tree_text(t) -> str:
    return f"chain:{t.depth}" if t.tree == "chain" else f"{t.tree}:{t.depth}:{t.top_k}:{t.max_nodes}"


if __name__ == "__main__":
    main()
