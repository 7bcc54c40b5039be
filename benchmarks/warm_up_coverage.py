"""Whether the start-up warm-up compiled every kernel variant that serving then launches: the target
built as the verify service builds it (``--exact``: the batch-invariant kernels), warmed up
(``ModelRunner.warm_up``), then long requests decoding while waves of prompts join them; every
Triton compilation after the warm-up is counted (each one stalls every stream while it compiles).

    python benchmarks/warm_up_coverage.py --exact                      # the embedded SmolLM2, on CUDA
    python benchmarks/warm_up_coverage.py --exact --pieces 48,12,2     # the warm-up's pieces before 4045b63

``--pieces``: the prompt pieces the warm-up runs beside its full chunks (``model_runner.WARM_PIECES``).
Also reported: the batch-invariant attention's launches seen while serving, as (prompt tile, split
over key chunks) pairs. On a CPU nothing compiles (the reference kernels), and the run only checks
that the scenario completes.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.sampling_params import SamplingParams  # noqa: E402
from kernels.compile_watch import CompileWatch  # noqa: E402
from verify_service import model_runner  # noqa: E402
from verify_service.config import EngineConfig  # noqa: E402
from verify_service.engine import Engine  # noqa: E402
from verify_service.target import Target  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="target model directory (default: embedded SmolLM2)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--exact", action="store_true", help="the batch-invariant kernels (CUDA)")
    ap.add_argument("--pieces", default=None, help="comma-separated prompt pieces for the warm-up (default: the shipped ones)")
    ap.add_argument("--long", type=int, action="append", help="lengths of the prompts decoding first (default 600, 700, 900)")
    ap.add_argument("--waves", default="1,3,8,16,40", help="prompts joining at a time, each wave five steps apart")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    import triton.knobs

    from kernels import attention_exact
    shipped = model_runner.WARM_PIECES, attention_exact._mode, triton.knobs.runtime.jit_post_compile_hook
    try:
        if args.pieces:
            model_runner.WARM_PIECES = tuple(int(x) for x in args.pieces.split(","))
        return _run(args)
    finally:  # (a caller in the same process, a test, gets the shipped ones back)
        model_runner.WARM_PIECES, attention_exact._mode, triton.knobs.runtime.jit_post_compile_hook = shipped


def _run(args) -> dict:
    if args.model is None:
        from hub.default_model import ensure_default_model
        args.model = str(ensure_default_model(progress=False))
    cfg = EngineConfig(args.model, device=args.device, dtype=args.dtype, max_model_len=4096, max_num_seqs=64,
                       exact=args.exact)
    target = Target.from_config(cfg)
    warm_s = target.runner.warm_up(cfg.max_batch_tokens)
    launches = set()
    if args.exact:
        from kernels import attention_exact
        mode = attention_exact._mode

        def recorded(meta, *rest):
            split = mode(meta, *rest)
            launches.add((bool(meta.custom_mask is None and meta.max_query_len >= attention_exact.WIDE_QUERY_LEN), split))
            return split

        attention_exact._mode = recorded
    watch = CompileWatch(logging.getLogger("warm_up_coverage"), "the warm-up")
    watch.start()
    engine = Engine(target)
    vocab = target.model_config.vocab_size
    rng = np.random.default_rng(0)
    ids = lambda n: rng.integers(1, min(vocab, 40000) - 1, n).tolist()  # noqa: E731
    for n in args.long or [600, 700, 900]:
        engine.add_request(ids(n), SamplingParams(max_tokens=300, ignore_eos=True))
    for _ in range(12):
        engine.step()
    for wave in (int(w) for w in args.waves.split(",")):
        for _ in range(wave):
            engine.add_request(ids(int(rng.integers(64, 300))), SamplingParams(max_tokens=30, ignore_eos=True))
        for _ in range(5):
            engine.step()
    while engine.has_work:
        engine.step()
    report = {"device": args.device, "exact": args.exact, "max_batch_tokens": cfg.max_batch_tokens,
              "warm_pieces": list(model_runner.WARM_PIECES), "warm_up_s": round(warm_s, 1),
              "compilations_after_warm_up": watch.compilations,
              "exact_attention_launches": [{"prompt_tile": t, "split": s} for t, s in sorted(launches)]}
    print(json.dumps(report), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
