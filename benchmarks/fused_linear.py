"""The few-row projections of a decode layer, each as the separate kernels a step used to run and as
the one kernel with the elementwise work in its epilogue (``kernels/fused_linear_triton.py``):

    qkv:      rms_norm (with the residual add) + F.linear      against  scaled_linear_triton
    o:        F.linear                                          against  linear_add_norm_triton
    gate_up:  rms_norm + F.linear + silu_mul                    against  scaled_gate_up_silu_triton
    down:     F.linear                                          against  linear_add_norm_triton
    lm_head:  F.linear                                          against  scaled_linear_triton (no scale)

so a layer's sum covers the same work both ways. Timed as ``gemm_shapes.py`` times (calls captured
back to back in a CUDA graph, every call on a weight copy the previous calls did not touch, as
layers' weights arrive cold). Above 64 rows the fused kernel is also timed on the 32- and 64-row
tiles (``fused_by_row_tile_us``). ``--sweep`` also times every tile of ``SWEEP`` for the fused kernel;
above 64 rows (the 128-row tile of the batch-invariant set's prefill chunks) every tile of
``WIDE_SWEEP`` instead, each checked bit for bit against the 64-row tile on the same rows (a tile
that changes a row's bits cannot serve the batch-invariant set).

    python benchmarks/fused_linear.py --rows 1 --rows 16 --sweep --out fused.json
    python benchmarks/fused_linear.py --rows 4096 --sweep --geometry 8b --out fused_prefill.json

``--geometry head`` times the shipped SmolLM2 draft head's projections instead (its LM head scaled,
as a tree level's is); ``--warm`` reads one copy of each weight at every call (L2-warm).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.attention_kernel import time_us  # noqa: E402
from benchmarks.decode_baseline import copy_bandwidth_gbs  # noqa: E402
from benchmarks.gemm_shapes import SHAPES, _cycling, write_cases  # noqa: E402
from kernels.fused_linear_triton import (WIDE_ROW_TILE, RowLinearConfig, linear_add_norm_triton,  # noqa: E402
                                         row_linear_config, row_tile, scaled_gate_up_silu_triton,
                                         scaled_linear_triton)
from kernels.fused_triton import rms_norm_triton, silu_mul_triton  # noqa: E402

SWEEP = [RowLinearConfig(n, k, w, s) for n in (16, 32, 64, 128) for k in (128, 256, 512) for w in (4, 8)
         for s in (3, 4) if n * k <= 16384]
WIDE_SWEEP = [RowLinearConfig(n, k, w, s, group_m=g) for n in (64, 128, 256) for k in (64, 128) for w in (4, 8)
              for s in (3, 4) for g in (1, 8) if n * k <= 16384]
LM_HEADS = {"8b.lm_head": (128256, 4096), "smol.lm_head": (49152, 576)}
# The shipped SmolLM2 draft head's projections (a tree level's few rows): its MLP is 4,608 wide, its
# LM head 14,336 draft tokens over the 576-wide output (``hub/heads/smollm2-135m-instruct``).
HEAD_SHAPES = {"head.qkv": (960, 1152), "head.o": (576, 576), "head.gate_up": (9216, 576), "head.down": (576, 4608),
               "head.lm_head": (14336, 576)}
EPS = 1e-5


def _pair(kind: str, m: int, n: int, k: int):
    """(separate kernels, fused kernel) as functions of the weight, on fixed inputs of ``m`` rows."""
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x, r, nw = torch.randn(m, k, **bf16), torch.randn(m, k, **bf16), torch.ones(k, **bf16)
    ss = torch.rand(k // 16, m, device="cuda")  # a producer's partial sums of h^2 (16-column programs)
    # fused(w, cfg=None, block_m=None): the fused kernel (the exact set's fixed-point sums) on a tile
    if kind in ("qkv", "gate_up"):
        act = silu_mul_triton if kind == "gate_up" else (lambda t: t)
        fused = scaled_gate_up_silu_triton if kind == "gate_up" else scaled_linear_triton
        return (lambda w: act(F.linear(rms_norm_triton(x, nw, EPS, r)[0], w)),
                lambda w, cfg=None, bm=None: fused(x, ss, EPS, w, config=cfg, block_m=bm, exact_sums=True))
    if kind in ("o", "down"):
        res, nw_out = torch.randn(m, n, **bf16), torch.ones(n, **bf16)
        return lambda w: F.linear(x, w), lambda w, cfg=None, bm=None: linear_add_norm_triton(
            x, w, res, nw_out, config=cfg, block_m=bm, exact_sums=True)[:2]
    return lambda w: F.linear(x, w), lambda w, cfg=None, bm=None: scaled_linear_triton(x, None, EPS, w, config=cfg,
                                                                                      block_m=bm)


def _sweep(fused, ws, rows: int, part_n: int) -> list:
    """(us, tile[, same bits]) for every tile of SWEEP (WIDE_SWEEP above 64 rows: each also checked
    bit for bit against the 64-row tile, its partial sums of h^2 over ``part_n`` columns) whose
    copies fit in shared memory."""
    timed = []
    wide = rows > 64
    want = fused(ws[0], None, 64) if wide else None
    for cfg in WIDE_SWEEP if wide else SWEEP:
        if wide:
            if cfg.block_n % part_n:
                continue
            cfg = dataclasses.replace(cfg, part_n=part_n)
        try:
            us = time_us(_cycling(lambda w, c=cfg: fused(w, c), ws))
        except OutOfResources:
            continue
        row = [us, list(dataclasses.astuple(cfg))]
        if wide:
            got = fused(ws[0], cfg, WIDE_ROW_TILE)
            row.append(all(torch.equal(a, b) for a, b in zip(_outputs(got), _outputs(want))))
        timed.append(tuple(row))
    return timed


def _outputs(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def _kind(name: str) -> str:
    return name.split(".")[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, action="append", required=True)
    ap.add_argument("--sweep", action="store_true", help="also time every tile of SWEEP for the fused kernel")
    ap.add_argument("--geometry", choices=["8b", "smol", "head"], action="append",
                    help="only this geometry's shapes (default: 8b and smol; head: the SmolLM2 draft head's)")
    ap.add_argument("--warm", action="store_true",
                    help="one copy of each weight, read again at every call (L2-warm, as a draft's levels may "
                         "find theirs), instead of copies cycled past the L2")
    ap.add_argument("--out", default=None, help="JSON file for the results")
    args = ap.parse_args()
    bw = copy_bandwidth_gbs(torch.device("cuda"))
    results = []
    for name, (n, k) in {**SHAPES, **LM_HEADS, **HEAD_SHAPES}.items():
        if name.split(".")[0] not in (args.geometry or ["8b", "smol"]):
            continue
        copies = 1 if args.warm else max(2, -(-256 * 2**20 // (n * k * 2)))  # > 2x the L2 of an H100/H200
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        floor = n * k * 2 / (bw * 1e9) * 1e6
        for m in args.rows:
            if m > 64 and name in LM_HEADS:  # (a prefill chunk's LM head runs over its last rows alone)
                continue
            # (the head's LM head reads its input scaled, as a level's does: the final norm folded in)
            separate, fused = _pair("qkv" if name == "head.lm_head" else _kind(name), m, n, k)
            gate_up = _kind(name) == "gate_up"
            config = row_linear_config(n // 2 if gate_up else n, k, 1 + gate_up,
                                       row_tile(m, n // 2 if gate_up else n, k, 1 + gate_up))
            row = {"shape": name, "kind": _kind(name), "rows": m, "floor_us": round(floor, 2),
                   "separate_us": time_us(_cycling(separate, ws)), "fused_us": time_us(_cycling(fused, ws)),
                   "config": list(dataclasses.astuple(config))}
            if m > 64:  # the few-row tiles at this row count too (each with its own default columns)
                row["fused_by_row_tile_us"] = {str(bm): time_us(_cycling(lambda w, b=bm: fused(w, None, b), ws))
                                               for bm in (32, 64)}
            if args.sweep:
                row["sweep"] = sorted(_sweep(fused, ws, m, config.partial_columns))
                row["sweep_best"] = row["sweep"][:4]
            results.append(row)
            print(f"{name:>14} rows {m:>3}: separate {row['separate_us']:7.1f} us  fused {row['fused_us']:7.1f} us"
                  f"  floor {floor:6.1f} us" + (f"  best {row['sweep_best'][:2]}" if args.sweep else "")
                  + "".join(f"  {b}-row tile {us:7.1f} us" for b, us in row.get("fused_by_row_tile_us", {}).items()),
                  flush=True)
        del ws
    for m in args.rows:
        for prefix in ("8b.", "smol.", "head."):
            rows = [r for r in results if r["rows"] == m and r["shape"].startswith(prefix) and "lm_head" not in r["shape"]]
            if not rows:
                continue
            print(f"{prefix} layer at {m} rows: separate {sum(r['separate_us'] for r in rows):.1f} us, "
                  f"fused {sum(r['fused_us'] for r in rows):.1f} us, floor {sum(r['floor_us'] for r in rows):.1f} us")
    if args.out:
        write_cases(args.out, bw, results)


if __name__ == "__main__":
    main()
