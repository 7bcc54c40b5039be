"""Profile target-only decode steps with torch.profiler; prints the top ops by host and device time.

    python benchmarks/profile_step.py MODEL_DIR_OR_GEOMETRY [--batch 1] [--context 512] [--kernels triton] [--exact]

``--prefill`` profiles the prompts' prefill steps instead (the first one, which compiles, unprofiled).
``--trace T.json`` also writes the profiled steps' chrome trace (``trace_kernels.py T.json --parts STEPS``
lists one step's kernels in order and charges the step's span to them).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.decode_baseline import make_engine  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402
from verify_service.engine import Engine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--kernels", choices=["auto", "triton", "reference"], default="auto")
    ap.add_argument("--exact", action="store_true", help="the batch-invariant target kernels (--exact of the server)")
    ap.add_argument("--prefill", action="store_true", help="profile --steps prefill steps (needs prompts enough to last)")
    ap.add_argument("--trace", default=None, help="write the profiled steps' chrome trace here")
    args = ap.parse_args()
    target = make_engine(args.model, args.batch, args.context, 64, torch.device("cuda"), args.kernels, args.exact)
    engine = Engine(target)
    for _ in range(args.batch):
        engine.add_request(list(range(1, args.context + 1)), SamplingParams(max_tokens=64, ignore_eos=True))
    def prefilling() -> bool:
        return bool(engine.scheduler.waiting) or any(s.prefilling for s in engine.scheduler.running)

    if args.prefill:
        engine.step()  # (compiles)
    else:
        while prefilling():
            engine.step()  # the prompts' prefill, unprofiled
        for _ in range(5):
            engine.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            if args.prefill and not prefilling():
                raise SystemExit(f"the prefill ended before {args.steps} profiled steps: more --batch or --context")
            engine.step()
        torch.cuda.synchronize()
    if args.trace:
        prof.export_chrome_trace(args.trace)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main()
