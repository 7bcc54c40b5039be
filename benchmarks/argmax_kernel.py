"""Greedy argmax alone: ``torch.argmax`` against ``kernels/argmax_triton.py`` per row count and vocabulary.

Each call is timed inside a CUDA graph of ten calls (no host launch cost), median of 50 replays, on
random float32 logits; each shape's results are checked equal first::

    python benchmarks/argmax_kernel.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.argmax_triton import argmax_triton  # noqa: E402

SHAPES = [(1, 49152), (1, 128256), (16, 49152), (60, 49152), (64, 128256), (240, 49152), (640, 49152), (3840, 49152)]


def time_us(fn, reps: int = 50, calls: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[reps // 2]


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a GPU")
    print("rows vocab torch_us triton_us")
    for rows, vocab in SHAPES:
        x = torch.randn(rows, vocab, device="cuda")
        assert torch.equal(argmax_triton(x), x.argmax(-1))
        print(rows, vocab, round(time_us(lambda: x.argmax(-1)), 1), round(time_us(lambda: argmax_triton(x)), 1), flush=True)


if __name__ == "__main__":
    main()
