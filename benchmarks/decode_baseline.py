"""Baseline (target-only) decode cost per step, next to its memory-bandwidth floor.

For each case: prefill ``batch`` sequences of ``context`` tokens through the engine's own
chunked prefill, then time full engine decode steps (scheduler, forward, sampling, the one
host sync). The floor is the bytes one step must read (weights + KV) divided by the
device-to-device copy bandwidth measured in the same run.

    python benchmarks/decode_baseline.py --case smollm2:1:512 --case llama3-8b:1:4096 --out results.json
    python benchmarks/decode_baseline.py --case smollm2:1:512 --kernels reference --kernels triton

``--kernels`` (repeatable) runs every case with each kernel set, side by side in one run.
``--exact`` also runs every case with the batch-invariant target kernels (README: Exact mode), right
after the default ones, and prints the mode's cost: the fraction of tok/s it loses.

A case is GEOMETRY:BATCH:CONTEXT; GEOMETRY is ``smollm2``, ``llama3-8b`` (random bf16
weights) or a model directory (real weights).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import pstats
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.config import ModelConfig  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402
from verify_service.config import EngineConfig  # noqa: E402
from verify_service.engine import Engine  # noqa: E402
from verify_service.loader import build_model, random_tensors  # noqa: E402
from verify_service.target import Target  # noqa: E402

GEOMETRIES = {
    "smollm2": {"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
                "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
                "max_position_embeddings": 8192, "tie_word_embeddings": True, "eos_token_id": 2},
    "llama3-8b": {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
                  "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
                  "max_position_embeddings": 131072, "eos_token_id": 128001,
                  "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
}


def copy_bandwidth_gbs(device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, counting bytes read + written: the best of 40 copies after
    about half a second of them (the memory's own rate, once the clocks settled; a median of a few
    copies right after start-up read 3.79 to 4.22 TB/s on one H200 from process to process, and every
    floor with it)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(400):
        dst.copy_(src)
    times = []
    for _ in range(40):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / min(times) / 1e9


def make_engine(geometry: str, batch: int, context: int, steps: int, device, kernels: str = "auto",
                exact: bool = False, max_model_len: int | None = None) -> Target:
    """``max_model_len``: the cache's capacity in positions, which a graphed step's attention grid
    follows (default: just what the case needs)."""
    max_len = max(context + steps + batch + 16, max_model_len or 0)
    cfg = EngineConfig(geometry if geometry not in GEOMETRIES else "<random>", device=str(device),
                       dtype="bfloat16", max_model_len=max_len, max_num_seqs=batch,
                       max_batch_tokens=4096, kv_cache_gib=None, kernels=kernels, exact=exact)
    if geometry in GEOMETRIES:
        mcfg = ModelConfig.from_hf(GEOMETRIES[geometry])
        tensors = random_tensors(mcfg, seed=0, device=device, dtype=torch.bfloat16)
        model = build_model(mcfg, tensors.items(), torch.bfloat16, device, max_len)
        del tensors
        return Target(cfg, model, tokenizer=None)
    return Target.from_config(cfg)


def step_bytes(target: Target, batch: int, context: int) -> int:
    """Bytes one decode step must read: every weight except the embedding table (one row
    each), the LM head (the embedding itself when tied), and the KV of every sequence."""
    m, cfg = target.model, target.model_config
    item = target.dtype.itemsize
    weights = sum(p.numel() for n, p in m.named_parameters() if "embed_tokens" not in n) * item
    if cfg.tie_word_embeddings:
        weights += m.model.embed_tokens.weight.numel() * item
    kv = batch * context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * item
    return weights + kv


def run_case(case: str, steps: int, bandwidth: float, device, kernels: str = "auto", linear: str = "default",
             profile: str | None = None, exact: bool = False, max_model_len: int | None = None) -> dict:
    """``linear``: ``cublas`` swaps the kernel set's projection matmul for F.linear (an A/B of the
    Triton one). ``profile``: write the host-side cProfile of the timed steps there."""
    geometry, batch, context = case.rsplit(":", 2)
    batch, context = int(batch), int(context)
    target = make_engine(geometry, batch, context, steps, device, kernels, exact, max_model_len)
    if linear == "cublas":
        target.runner.kernels = dataclasses.replace(target.runner.kernels, linear=torch.nn.functional.linear)
    engine = Engine(target)
    g = torch.Generator().manual_seed(1)
    for _ in range(batch):
        prompt = torch.randint(0, target.model_config.vocab_size, (context,), generator=g).tolist()
        # Sequences prefilled first decode while the others prefill (one sequence a step at most):
        # room for that, so every timed step still decodes the whole batch.
        engine.add_request(prompt, SamplingParams(max_tokens=steps + batch + 8, ignore_eos=True))
    t0 = time.perf_counter()
    while any(s.prefilling or not s.output_ids for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    times = []
    prof = cProfile.Profile() if profile else None
    for _ in range(steps):
        t = time.perf_counter()
        if prof:
            prof.enable()
        engine.step()  # ends in the step's device-to-host copy of the sampled ids
        if prof:
            prof.disable()
        times.append(time.perf_counter() - t)
    if prof:
        with open(profile, "w") as f:
            pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(40)
    assert all(len(s.output_ids) > 0 for s in engine.scheduler.running) and \
        len(engine.scheduler.running) == batch, "a sequence finished inside the timed steps"
    ms = statistics.median(times[3:]) * 1e3
    floor_ms = step_bytes(target, batch, context) / (bandwidth * 1e9) * 1e3
    result = {"case": case, "kernels": target.runner.kernels.name, "linear": linear,
              "step_ms": [round(x * 1e3, 3) for x in times], "batch": batch, "context": context, "ms_per_step": round(ms, 3),
              "p90_ms": round(sorted(times[3:])[int(0.9 * (len(times) - 3))] * 1e3, 3),
              "floor_ms": round(floor_ms, 3), "floor_ratio": round(ms / floor_ms, 2),
              "tokens_per_s": round(batch / ms * 1e3, 1), "prefill_s": round(prefill_s, 2),
              "step_bytes": step_bytes(target, batch, context)}
    del engine, target
    torch.cuda.empty_cache()
    return result


def attention_tile(text: str) -> dict:
    """ROWSxWARPS[xSTAGES] -> the overrides of kernels/attention_exact.py it names."""
    parts = text.lower().split("x")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) not in (2, 3) or values[0] not in (16, 32, 64, 128) or values[1] not in (2, 4, 8) \
            or (len(values) == 3 and not 1 <= values[2] <= 5):
        raise argparse.ArgumentTypeError(f"{text!r}: ROWSxWARPS or ROWSxWARPSxSTAGES (rows 16/32/64/128, warps 2/4/8, "
                                         "stages 1-5)")
    return dict(zip(("BLOCK_M", "NUM_WARPS", "NUM_STAGES"), values))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", action="append", required=True, help="GEOMETRY:BATCH:CONTEXT")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--kernels", action="append", choices=["auto", "triton", "reference"],
                    help="kernel set (repeatable: each case runs with each; default auto)")
    ap.add_argument("--linear", action="append", choices=["default", "cublas"],
                    help="projection matmul: the kernel set's own, or cuBLAS (repeatable, as --kernels)")
    ap.add_argument("--exact", action="store_true",
                    help="also run each case with the batch-invariant target kernels (--exact of the server), "
                         "side by side: the mode's cost")
    ap.add_argument("--exact-row-tile", type=int, action="append", default=[], choices=[0, 16, 32, 64],
                    help="with --exact, also the batch-invariant set with its projections on this fixed row tile "
                         "(0: the tile from the step's row count, as the fast path picks it)")
    ap.add_argument("--exact-attention-rows", type=int, action="append", default=[], choices=[16, 32, 64],
                    help="with --exact, also the batch-invariant set with its attention on tiles of this many query "
                         "rows (kernels/attention_exact.py BLOCK_M; a fixed tile too)")
    ap.add_argument("--exact-attention-tile", type=attention_tile, action="append", default=[],
                    help="with --exact, also the batch-invariant set with its attention on this tile: ROWSxWARPS or "
                         "ROWSxWARPSxSTAGES (kernels/attention_exact.py BLOCK_M, NUM_WARPS, NUM_STAGES; 64x8: the "
                         "64-row tile's two accumulators over eight warps instead of four)")
    ap.add_argument("--exact-chunk", type=int, action="append", default=[], choices=[128, 256, 512, 1024],
                    help="with --exact, also the batch-invariant set with its attention folding chunks of this many "
                         "keys (kernels/attention_exact.py CHUNK; any fixed chunk keeps the invariance)")
    ap.add_argument("--exact-split-rule", action="append", default=[], choices=["few", "waves"],
                    help="with --exact, also the batch-invariant set with its attention's launch shape picked by "
                         "this rule (kernels/attention_exact.py SPLIT_RULE; speed only)")
    ap.add_argument("--exact-split-programs", type=int, action="append", default=[],
                    help="with --exact, also the batch-invariant set with its attention's split launch taking about "
                         "this many programs an SM (kernels/attention_exact.py SPLIT_PROGRAMS_PER_SM; 0: one a "
                         "chunk; speed only)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="the cache's capacity in positions, as a server sizes it (a graphed step's attention grid "
                         "follows it; default: what each case needs)")
    ap.add_argument("--profile-dir", default=None, help="write each case's host cProfile here")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import kernels.exact_set as kernels_exact  # (Triton's)
    from kernels import attention_exact

    device = torch.device("cuda")
    default_exact = kernels_exact.EXACT
    bandwidth = copy_bandwidth_gbs(device)
    results = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
               "copy_bandwidth_gbs": round(bandwidth, 1), "cases": []}
    print(f"{results['device']}: device-to-device copy {bandwidth:.0f} GB/s (read + write)")
    # (label, exact, projections' fixed row tile, overrides of kernels/attention_exact.py): the fast set,
    # then with --exact the batch-invariant set as shipped and its variants
    variants = [("", False, None, {})]
    if args.exact:
        variants += [("exact", True, None, {})]
        variants += [(f"exact/{t or 'rows'}", True, t, {}) for t in args.exact_row_tile]
        variants += [(f"exact/attn{m}", True, None, {"BLOCK_M": m}) for m in args.exact_attention_rows]
        variants += [(f"exact/attn{'x'.join(map(str, t.values()))}", True, None, t) for t in args.exact_attention_tile]
        variants += [(f"exact/chunk{c}", True, None, {"CHUNK": c}) for c in args.exact_chunk]
        variants += [(f"exact/{r}", True, None, {"SPLIT_RULE": r}) for r in args.exact_split_rule]
        variants += [(f"exact/split{n}", True, None, {"SPLIT_PROGRAMS_PER_SM": n}) for n in args.exact_split_programs]
    shipped = {name: getattr(attention_exact, name)
               for name in ("BLOCK_M", "CHUNK", "SPLIT_RULE", "NUM_WARPS", "NUM_STAGES", "SPLIT_PROGRAMS_PER_SM")}
    baseline = None
    for case, kernels, linear, (label, exact, row_tile, attention) in [
            (c, k, m, v) for c in args.case for k in args.kernels or ["auto"] for m in args.linear or ["default"]
            for v in variants]:
        kernels_exact.EXACT = default_exact if row_tile is None else kernels_exact.with_row_tile(row_tile or None)
        for name, value in {**shipped, **attention}.items():
            setattr(attention_exact, name, value)
        profile = None
        if args.profile_dir:
            Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
            name = label.replace("/", "_") or kernels
            profile = str(Path(args.profile_dir) / f"{case.replace(':', '_')}_{name}_{linear}.txt")
        r = run_case(case, args.steps, bandwidth, device, kernels, linear, profile, exact, args.max_model_len)
        gc.collect()  # the case's engine and its KV cache (reference cycles) before the next sizes its cache
        torch.cuda.empty_cache()
        r["exact"] = exact
        if exact:  # the same case without the mode ran before
            r["kernels"] = label
            r["exact_cost"] = round(1 - r["tokens_per_s"] / baseline["tokens_per_s"], 4)
        else:
            baseline = r
        results["cases"].append(r)
        print(f"{r['case']:>24} {r['kernels']:>9} {linear:>7}: {r['ms_per_step']:8.3f} ms/step  floor {r['floor_ms']:7.3f} ms  "
              f"x{r['floor_ratio']:<6} {r['tokens_per_s']:9.1f} tok/s  p90 {r['p90_ms']} ms  (prefill {r['prefill_s']} s)"
              + (f"  exact mode cost {r['exact_cost']:.1%}" if exact else ""), flush=True)
        if args.out:  # after every case: a later case's failure keeps the earlier ones
            Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
