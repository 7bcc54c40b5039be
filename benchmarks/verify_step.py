"""Verify-step cost against tree size and context, next to the one-token step and the floor.

One sequence of CONTEXT tokens is prefilled through the engine; then the target's forward
runs on the newest token plus a tree of N-1 nodes (a chain: the ancestor mask of the deepest
tree of that size), logits for every row and one host sync, as a verify step does. N = 1 is
the plain decode forward. The floor is (weights + the sequence's KV) / copy bandwidth.

    python benchmarks/verify_step.py --geometry llama3-8b --context 4096 --context 32768 \\
        --tokens 1 --tokens 8 --tokens 32 --tokens 64 --kernels reference --kernels triton --out verify.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.decode_baseline import copy_bandwidth_gbs, make_engine, step_bytes  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402
from runtime.step_layout import SeqChunk  # noqa: E402
from verify_service.engine import Engine  # noqa: E402


def prefilled(geometry: str, context: int, max_tokens: int, kernels: str, device):
    target = make_engine(geometry, 1, context, max_tokens, device, kernels)
    engine = Engine(target)
    prompt = torch.randint(0, target.model_config.vocab_size, (context,), generator=torch.Generator().manual_seed(1))
    seq_id = engine.add_request(prompt.tolist(), SamplingParams(max_tokens=max_tokens + 8, ignore_eos=True))
    while engine.sequences[seq_id].prefilling:
        engine.step()
    target.blocks.ensure_capacity(seq_id, context + max_tokens)
    return target, seq_id


def time_verify(target, seq_id: int, context: int, n: int, steps: int) -> float:
    """Median ms of one forward over the root + n-1 chain nodes (logits for every row, one sync)."""
    table = target.blocks.block_table(seq_id)
    tokens = np.arange(1, n + 1) % target.model_config.vocab_size
    mask = np.tril(np.ones((n, n), dtype=bool)) if n > 1 else None
    chunk = SeqChunk(tokens, context, table, logits_rows=np.arange(n), positions=np.arange(context, context + n),
                     custom_mask=mask)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        out = target.runner.step([chunk])
        out.logits.argmax(-1).cpu()  # the step's device-to-host copy
        times.append(time.perf_counter() - t)
    return statistics.median(times[3:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--geometry", default="llama3-8b")
    ap.add_argument("--context", type=int, action="append", required=True)
    ap.add_argument("--tokens", type=int, action="append", required=True, help="tree size incl. the root")
    ap.add_argument("--kernels", action="append", choices=["auto", "triton", "reference"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="print each case's top GPU kernels (torch.profiler, 5 steps)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    bandwidth = copy_bandwidth_gbs(device)
    results = {"device": torch.cuda.get_device_name(device), "copy_bandwidth_gbs": round(bandwidth, 1), "cases": []}
    for kernels in args.kernels or ["auto"]:
        for context in args.context:
            target, seq_id = prefilled(args.geometry, context, max(args.tokens), kernels, device)
            floor = step_bytes(target, 1, context) / (bandwidth * 1e9) * 1e3
            one = None
            for n in sorted(args.tokens):
                ms = time_verify(target, seq_id, context, n, args.steps)
                one = ms if n == 1 else one
                r = {"kernels": target.runner.kernels.name, "context": context, "tokens": n, "ms": round(ms, 3),
                     "floor_ms": round(floor, 3), "floor_ratio": round(ms / floor, 2),
                     "vs_one_token": round(ms / one, 3) if one else None}
                results["cases"].append(r)
                print(f"{r['kernels']:>9} ctx {context:>6} tokens {n:>3}: {ms:8.3f} ms  floor {floor:7.3f} ms  "
                      f"x{r['floor_ratio']:<6} vs 1 token x{r['vs_one_token']}", flush=True)
                if args.profile:
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        time_verify(target, seq_id, context, n, 5)
                    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8), flush=True)
            del target
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
