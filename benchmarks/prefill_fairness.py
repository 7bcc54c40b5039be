"""The decoding streams' largest gap between tokens while a long prompt is prefilled.

In process, one engine: ``--streams`` sequences decode; then a ``--prompt``-token request
arrives and is prefilled in chunks of ``--max-batch-tokens`` (shared with the decodes). Every
step gives each decoding sequence one token, so the gap between its tokens is a step's
duration; the largest over the prefill is reported::

    python benchmarks/prefill_fairness.py --geometry llama3-8b --prompt 32768 --streams 4 --out gap.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.decode_baseline import make_engine  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402
from verify_service.engine import Engine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--geometry", default="llama3-8b")
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--max-batch-tokens", type=int, default=2048)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    compiles: list[str] = []  # Triton compilations after the warm-up: each is a stall of its step
    if device.type == "cuda":
        import triton.knobs
        triton.knobs.runtime.jit_post_compile_hook = \
            lambda *a, **kw: compiles.append(f"{getattr(kw.get('fn'), 'name', kw.get('fn'))}: {str(kw.get('repr'))[:300]}")
    target = make_engine(args.geometry, args.streams + 1, args.prompt, 4096, device)
    print(f"warm-up (as the server runs it at start-up): {target.runner.warm_up(args.max_batch_tokens):.1f} s",
          flush=True)
    engine = Engine(target)
    if engine.scheduler.max_batch_tokens != args.max_batch_tokens:
        engine.scheduler.max_batch_tokens = args.max_batch_tokens
    vocab = target.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    streams = [engine.add_request(torch.randint(0, vocab, (64,), generator=g).tolist(),
                                  SamplingParams(max_tokens=4000, ignore_eos=True)) for _ in range(args.streams)]
    for _ in range(8):
        engine.step()
    long_id = engine.add_request(torch.randint(0, vocab, (args.prompt,), generator=g).tolist(),
                                 SamplingParams(max_tokens=4, ignore_eos=True))
    gaps, started, step_compiles = [], time.perf_counter(), {}
    compiles.clear()
    while engine.sequences[long_id].prefilling:
        t = time.perf_counter()
        events = engine.step()
        gaps.append(time.perf_counter() - t)
        if compiles:
            step_compiles[len(gaps) - 1] = compiles[:]
            compiles.clear()
        assert set(streams) <= {e.seq_id for e in events if e.token_ids}, "a decoding stream got no token"
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "geometry": args.geometry, "prompt": args.prompt, "streams": args.streams,
              "max_batch_tokens": args.max_batch_tokens, "prefill_steps": len(gaps),
              "prefill_s": round(time.perf_counter() - started, 3),
              "max_gap_ms": round(max(gaps) * 1e3, 2), "median_gap_ms": round(sorted(gaps)[len(gaps) // 2] * 1e3, 2),
              "gaps_ms": [round(g * 1e3, 2) for g in gaps],  # in step order: which step a spike was
              "compiles_by_step": step_compiles}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
