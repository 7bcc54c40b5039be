"""Greedy argmax alone: ``torch.argmax`` against ``kernels/argmax_triton.py`` per row count and vocabulary.

Each call is timed inside a CUDA graph of ten calls (no host launch cost; ``attention_kernel.time_us``), median of 50 replays, on
random float32 logits; each shape's results are checked equal first::

    python benchmarks/argmax_kernel.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.attention_kernel import time_us  # noqa: E402
from kernels.argmax_triton import argmax_triton  # noqa: E402

SHAPES = [(1, 49152), (1, 128256), (16, 49152), (60, 49152), (64, 128256), (240, 49152), (640, 49152), (3840, 49152)]


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a GPU")
    print("rows vocab torch_us triton_us")
    for rows, vocab in SHAPES:
        x = torch.randn(rows, vocab, device="cuda")
        assert torch.equal(argmax_triton(x), x.argmax(-1))
        print(rows, vocab, round(time_us(lambda: x.argmax(-1), reps=50), 1),
              round(time_us(lambda: argmax_triton(x), reps=50), 1), flush=True)


if __name__ == "__main__":
    main()
