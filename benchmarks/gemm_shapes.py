"""Skinny matmuls (a few rows times a weight matrix) as a decode step runs them: F.linear next to
the same product written with the weight first (cuBLAS then chooses other kernels) and the
project's Triton matmul (``kernels/linear_triton.py``) under its default tiles and a sweep.
Each timed call reads a weight copy the previous calls did not touch (copies cycle through
more than twice the L2 cache), as in a real step where every layer's weights arrive cold.

    python benchmarks/gemm_shapes.py --rows 1 --rows 8 --rows 64 --sweep --out gemm.json

``--exact-sweep`` times candidate tiles for the batch-invariant mode's one config
(``EXACT_CONFIG``, the LM head's: the same tiles at every row count) and prints the best of them
per shape and row count. ``--shape`` (repeatable) keeps only the named shapes::

    python benchmarks/gemm_shapes.py --rows 1 --rows 64 --shape smol.lm_head --shape 8b.lm_head --exact-sweep
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.attention_kernel import time_us  # noqa: E402
from benchmarks.decode_baseline import copy_bandwidth_gbs  # noqa: E402
from kernels.linear_triton import EXACT_CONFIG, LinearConfig, linear_config, linear_triton  # noqa: E402

SWEEP = [LinearConfig(16, n, k, 4, s) for n in (16, 32, 64) for k in (128, 256) for s in (3, 4)]

EXACT_SWEEP = [LinearConfig(*c) for c in ((16, 32, 256, 4, 4), (16, 64, 128, 4, 4), (32, 32, 128, 4, 4),
                                           (32, 64, 128, 4, 4), (64, 32, 128, 4, 4), (64, 64, 64, 4, 4),
                                           (64, 64, 128, 4, 3), (64, 128, 64, 4, 3), (64, 128, 64, 8, 3),
                                           (128, 64, 64, 4, 3), (128, 128, 64, 8, 3),
                                           (64, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 128, 64, 8, 4),
                                           (64, 256, 64, 8, 3), (64, 128, 128, 8, 3), (64, 64, 128, 4, 4))]

SHAPES = {"8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (28672, 4096), "8b.down": (4096, 14336),
          "smol.qkv": (960, 576), "smol.o": (576, 576), "smol.gate_up": (3072, 576), "smol.down": (576, 1536),
          "8b.lm_head": (128256, 4096), "smol.lm_head": (49152, 576)}


def write_cases(path: str, bandwidth_gbs: float, cases: list) -> None:
    """The results as JSON: the device, its copy bandwidth and one entry a timed case."""
    Path(path).write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_bandwidth_gbs": bandwidth_gbs,
                                      "cases": cases}, indent=1))


def _cycling(fn, weights):
    """``fn(weight)`` on the next weight copy at each call."""
    turn = iter(range(10**9))
    return lambda: fn(weights[next(turn) % len(weights)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, action="append", required=True)
    ap.add_argument("--sweep", action="store_true", help="also time every small-row Triton config (rows <= 16)")
    ap.add_argument("--exact-sweep", action="store_true", help="time the batch-invariant mode's candidate tiles")
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES), help="only these shapes (default: all)")
    ap.add_argument("--out", default=None, help="JSON file for the results")
    args = ap.parse_args()
    results = []
    bw = copy_bandwidth_gbs(torch.device("cuda"))
    for name, (n, k) in SHAPES.items():
        if args.shape and name not in args.shape:
            continue
        copies = max(2, -(-256 * 2**20 // (n * k * 2)))  # > 2x the 50 MB L2 of an H100
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        floor = n * k * 2 / (bw * 1e9) * 1e6
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            a = time_us(_cycling(lambda w: F.linear(x, w), ws))
            b = time_us(_cycling(lambda w: torch.mm(w, x.t()).t(), ws))
            c = time_us(_cycling(lambda w: linear_triton(x, w), ws))
            e = time_us(_cycling(lambda w: linear_triton(x, w, EXACT_CONFIG), ws))
            row = {"shape": name, "rows": m, "linear_us": a, "weight_first_us": b, "triton_us": c, "exact_us": e,
                   "triton_config": list(dataclasses.astuple(linear_config(m))), "floor_us": round(floor, 2)}
            if args.sweep and m <= 16:
                swept = sorted((time_us(_cycling(lambda w, cfg=cfg: linear_triton(x, w, cfg), ws)), list(dataclasses.astuple(cfg)))
                               for cfg in SWEEP)
                row["sweep_best"] = swept[:3]
            if args.exact_sweep:
                row["exact_sweep_us"] = {str(dataclasses.astuple(cfg)): time_us(
                    _cycling(lambda w, cfg=cfg: linear_triton(x, w, cfg), ws)) for cfg in EXACT_SWEEP}
            results.append(row)
            print(f"{name:>14} rows {m:>3}: linear {a:7.1f} us  weight-first {b:7.1f} us  triton {c:7.1f} us  "
                  f"exact {e:7.1f} us  floor {floor:6.1f} us" + (f"  best {row['sweep_best'][0]}" if "sweep_best" in row else ""),
                  flush=True)
    if args.exact_sweep:
        for r in results:
            best = sorted((round(us, 1), c) for c, us in r["exact_sweep_us"].items())
            print(f"exact tiles, {r['shape']} at {r['rows']} rows (us, best first; cuBLAS {r['linear_us']:.1f}, "
                  f"EXACT_CONFIG {r['exact_us']:.1f}): {best[:4]}")
    if args.out:
        write_cases(args.out, bw, results)


if __name__ == "__main__":
    main()
