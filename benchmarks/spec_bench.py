"""Speculative vs target-only generation, side by side in one run (see tools/evaluate.py).

    python benchmarks/spec_bench.py --prompts mt_bench.jsonl --head random --config dynamic:6:8:59 \\
        --config chain:3 --max-tokens 128 --out results.json

``--head random`` writes a randomly initialised head for the target (tau near 1 expected:
a smoke test of the loop, not of a draft); ``--head default`` is the shipped SmolLM2 head.
A config is ``TREE:DEPTH[:TOP_K[:NODES]]``. Repeat ``--prompts`` for several sets.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from draft_service.eagle_init import write_random_head  # noqa: E402
from hub.default_model import ensure_default_model  # noqa: E402
from tools.evaluate import evaluate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="target model directory (default: embedded SmolLM2)")
    ap.add_argument("--head", required=True, help="EAGLE-3 head directory, 'default' or 'random'")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="with --head random")
    ap.add_argument("--prompts", action="append", required=True)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--config", action="append", required=True, help="TREE:DEPTH[:TOP_K[:NODES]]")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1, help="prompts generated together")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    model_dir = args.model or str(ensure_default_model(progress=False))
    head = args.head
    if head == "random":
        head = tempfile.mkdtemp(prefix="eagle3-random-head-")
        write_random_head(head, json.loads((Path(model_dir) / "config.json").read_text()), args.draft_vocab)
    report = evaluate(model_dir, head, args.prompts, args.config, args.max_tokens, args.batch, args.limit,
                      args.device, args.dtype, report=lambda name, row: print(json.dumps(row), flush=True))
    report["head"] = args.head
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
