"""The draft top-k's launch shape swept on the GPU: chunk size and warps of its two kernels
(``kernels/topk_triton.py``), for a tree level's rows (batch x fed nodes) over a draft vocabulary.

    python benchmarks/topk_sweep.py --rows 10 --rows 160 --vocab 32000 --k 10 --out topk_sweep.json

Each configuration is captured in a CUDA graph of ``--reps`` launches and replayed (the time per
launch, as a draft graph pays it); its results are checked against the default configuration's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.topk_triton import draft_topk_triton  # noqa: E402


def time_config(logits, k, d2t, reps: int, **shape) -> float:
    """Microseconds per top-k launch pair, replayed from a CUDA graph."""
    draft_topk_triton(logits, k, d2t, **shape)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            draft_topk_triton(logits, k, d2t, **shape)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / reps)
    return best


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, action="append", help="rows a level (default 10, 40, 160, 640)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    assert torch.cuda.is_available(), "a sweep of GPU launch shapes needs a GPU"
    gen = torch.Generator(device="cuda").manual_seed(0)
    d2t = torch.randint(0, 100, (args.vocab,), device="cuda", generator=gen)
    report = {"device": torch.cuda.get_device_name(), "vocab": args.vocab, "k": args.k, "rows": {}}
    for m in args.rows or [10, 40, 160, 640]:
        logits = torch.randn(m, args.vocab, device="cuda", generator=gen).to(torch.bfloat16)
        want = draft_topk_triton(logits, args.k, d2t)
        results = []
        for block, cw, mw in itertools.product((256, 512, 1024, 2048), (1, 2, 4, 8), (1, 2, 4)):
            if cw * 32 > block:
                continue
            got = draft_topk_triton(logits, args.k, d2t, block=block, chunk_warps=cw, merge_warps=mw)
            same = all(torch.equal(a, b) for a, b in zip(got, want))
            us = time_config(logits, args.k, d2t, args.reps, block=block, chunk_warps=cw, merge_warps=mw)
            results.append({"block": block, "chunk_warps": cw, "merge_warps": mw, "us": round(us, 2), "same": same})
        results.sort(key=lambda r: r["us"])
        report["rows"][m] = results
        print(m, results[:5], "default:", next(r for r in results if r["block"] == 2048 and r["chunk_warps"] == 8
                                                 and r["merge_warps"] == 4), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
