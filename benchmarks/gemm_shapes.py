"""Skinny matmuls (a few rows times a weight matrix) as a decode step runs them: F.linear next to
the same product written with the weight first, which lets cuBLAS choose other kernels.

    python benchmarks/gemm_shapes.py --rows 1 --rows 8 --rows 64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.attention_kernel import time_us  # noqa: E402
from benchmarks.decode_baseline import copy_bandwidth_gbs  # noqa: E402

SHAPES = {"8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (28672, 4096), "8b.down": (4096, 14336),
          "smol.qkv": (960, 576), "smol.o": (576, 576), "smol.gate_up": (3072, 576), "smol.down": (576, 1536)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, action="append", required=True)
    args = ap.parse_args()
    bw = copy_bandwidth_gbs(torch.device("cuda"))
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        floor = w.numel() * 2 / (bw * 1e9) * 1e6
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            a = time_us(lambda: F.linear(x, w))
            b = time_us(lambda: torch.mm(w, x.t()).t())
            print(f"{name:>14} rows {m:>3}: linear {a:7.1f} us  weight-first {b:7.1f} us  floor {floor:6.1f} us", flush=True)


if __name__ == "__main__":
    main()
