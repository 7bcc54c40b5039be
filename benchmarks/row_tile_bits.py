"""Do the fused projections' rows depend on the row tile? Bitwise, on this GPU.

Each projection of ``kernels/fused_linear_triton.py`` runs on 300 random rows with row tiles of
16, 32 and 64 rows (each tile with its own default K step) and once more in calls of 1 and 7
rows; every result (add_norm's partial sums of h^2 too) is compared bit for bit with the 64-row
tile's. Where nothing differs, this GPU's matrix instructions sum a row the same way whatever the
tile, and a batch-invariant set may pick the tile from the row count. ``--exact-sums`` sums h^2
in fixed point, as the batch-invariant set does; without it the scaled projections' row scale is
a plain sum, whose order follows the tile's layout (on an H200, the only differences seen at
de819fc: the scaled projections at a 16-row tile).

    python benchmarks/row_tile_bits.py [--geometry llama3-8b] [--exact-sums] [--out bits.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.fused_linear_triton import (linear_add_norm_triton, scaled_gate_up_silu_triton,  # noqa: E402
                                         scaled_linear_triton)

ROWS = 300
SHAPES = {  # (hidden, q + 2 kv width, intermediate) of the geometries
    "llama3-8b": (4096, 6144, 14336),
    "smollm2": (576, 960, 1536),
}


def projections(hidden: int, qkv: int, inter: int, dtype, gen, exact_sums: bool) -> dict:
    """name -> f(rows, block_m) -> the projection's outputs of those rows, on fixed random inputs."""
    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).cuda()

    x_h, x_i = rand(ROWS, hidden), rand(ROWS, inter, scale=0.1)
    res, norm_w = rand(ROWS, hidden), rand(hidden, scale=0.1) + 1
    ss = (torch.rand(4, ROWS, generator=gen) * hidden).cuda()
    w_qkv, w_gu = rand(qkv, hidden, scale=0.02), rand(2 * inter, hidden, scale=0.02)
    w_o, w_down = rand(hidden, hidden, scale=0.02), rand(hidden, inter, scale=0.02)
    return {
        "qkv (scaled)": lambda r, bm: (scaled_linear_triton(x_h[r], ss[:, r].contiguous(), 1e-5, w_qkv, block_m=bm,
                                                            exact_sums=exact_sums),),
        "gate_up (scaled, silu)": lambda r, bm: (
            scaled_gate_up_silu_triton(x_h[r], ss[:, r].contiguous(), 1e-5, w_gu, block_m=bm, exact_sums=exact_sums),),
        "o_proj (add, norm)": lambda r, bm: rows_first(linear_add_norm_triton(x_h[r], w_o, res[r], norm_w, block_m=bm,
                                                                             exact_sums=exact_sums)),
        "down (add, norm)": lambda r, bm: rows_first(linear_add_norm_triton(x_i[r], w_down, res[r], norm_w, block_m=bm,
                                                                           exact_sums=exact_sums)),
    }


def rows_first(outs: tuple) -> tuple:
    """add_norm's (h, hn, partial sums [programs, rows]) with every output's rows first."""
    h, hn, ss = outs
    return h, hn, ss.t()


def in_calls(f, rows: int, block_m: int | None) -> tuple:
    """f over all ROWS rows, ``rows`` at a time, outputs concatenated."""
    parts = [f(slice(s, min(s + rows, ROWS)), block_m) for s in range(0, ROWS, rows)]
    return tuple(torch.cat(outs) for outs in zip(*parts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--geometry", action="append", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--exact-sums", action="store_true", help="the sums of h^2 in fixed point (the exact set's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    results = {"device": torch.cuda.get_device_name(), "dtype": args.dtype, "exact_sums": args.exact_sums,
               "cases": []}
    for geometry in args.geometry or ["llama3-8b", "smollm2"]:
        gen = torch.Generator().manual_seed(0)
        for name, f in projections(*SHAPES[geometry], dtype, gen, args.exact_sums).items():
            ref = f(slice(0, ROWS), 64)
            variants = [(f"one call, tile {bm}", ROWS, bm) for bm in (16, 32)] + [
                (f"calls of {n} rows, tile 64", n, 64) for n in (1, 7, 64)] + [
                (f"calls of {n} rows, tile from the count", n, None) for n in (1, 7, 32)]
            for label, rows, block_m in variants:
                out = in_calls(f, rows, block_m)
                differ = sum(int((o != r).sum()) for o, r in zip(out, ref))
                total = sum(r.numel() for r in ref)
                results["cases"].append({"geometry": geometry, "projection": name, "variant": label,
                                         "elements_differing": differ, "elements": total})
                print(f"{geometry:>10} {name:<24} {label:<36} {differ:>9} of {total} differ", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
