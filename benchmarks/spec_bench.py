"""Speculative vs target-only generation, side by side in one run.

For each prompt (first turns, chat template applied) both generators run greedy; the
report gives exact-output agreement, tokens/s of each, the speed ratio, tau and acceptance
per depth, for every tree configuration asked for.

    python benchmarks/spec_bench.py --prompts mt_bench.jsonl --head random --config dynamic:6:8:59 \\
        --config chain:3 --max-tokens 128 --out results.json

``--head random`` writes a randomly initialised head for the target (tau near 1 expected:
a smoke test of the loop, not of a draft). A config is ``TREE:DEPTH[:TOP_K[:NODES]]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.default_model import ensure_default_model  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402
from common.spec_config import SpecConfig  # noqa: E402
from draft_service.eagle_init import write_random_head  # noqa: E402
from verify_service.config import EngineConfig  # noqa: E402
from verify_service.inprocess import build_generator  # noqa: E402


def load_prompts(path: str, limit: int | None) -> list[str]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r["turns"][0] for r in rows][:limit]


def parse_config(text: str, head: str) -> SpecConfig:
    parts = text.split(":")
    tree, depth = parts[0], int(parts[1])
    top_k = int(parts[2]) if len(parts) > 2 else 8
    nodes = int(parts[3]) if len(parts) > 3 else 59
    return SpecConfig(head, tree=tree, depth=depth, top_k=top_k, max_nodes=nodes)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(gen, prompts: list[list[int]], params: SamplingParams, batch: int) -> tuple[list[list[int]], float, list]:
    """Generate in groups of ``batch`` prompts; returns outputs, generation seconds, spec metrics."""
    outputs, metrics, total = [], [], 0.0
    for i in range(0, len(prompts), batch):
        sync()
        start = time.perf_counter()
        results = gen.generate(prompts[i:i + batch], params)
        sync()
        total += time.perf_counter() - start
        outputs += [r.token_ids for r in results]
        metrics += [r.spec for r in results]
    return outputs, total, metrics


def summarize(name: str, outputs, secs, metrics, reference, ref_secs) -> dict:
    tokens = sum(len(o) for o in outputs)
    same = sum(o == r for o, r in zip(outputs, reference))
    prefix = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), min(len(o), len(r)))
              for o, r in zip(outputs, reference)]
    row = {"config": name, "prompts": len(outputs), "tokens": tokens, "seconds": round(secs, 2),
           "tokens_per_s": round(tokens / secs, 1), "identical_outputs": same,
           "mean_common_prefix": round(statistics.mean(prefix), 1)}
    if metrics and metrics[0] is not None:
        steps = sum(m.steps for m in metrics)
        accepted = sum(m.accepted_tokens for m in metrics)
        depth = max(len(m.accepted_per_depth) for m in metrics)
        per_depth = [sum(m.accepted_per_depth[d] for m in metrics if d < len(m.accepted_per_depth))
                     for d in range(depth)]
        row.update({"tau": round((accepted + steps) / steps, 3) if steps else 0.0,
                    "acceptance_per_depth": [round(c / steps, 3) for c in per_depth],
                    "draft_tokens": sum(m.draft_tokens for m in metrics), "accepted_tokens": accepted,
                    "speedup_vs_target": round(ref_secs / secs * tokens / sum(len(r) for r in reference), 3)})
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="target model directory (default: embedded SmolLM2)")
    ap.add_argument("--head", required=True, help="EAGLE-3 head directory, or 'random'")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="with --head random")
    ap.add_argument("--prompts", required=True)
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
    cfg = EngineConfig(model_dir, device=args.device, dtype=args.dtype, max_model_len=4096,
                       max_num_seqs=args.batch)
    params = SamplingParams(max_tokens=args.max_tokens)
    base = build_generator(cfg)
    prompts = [base.engine.encode(messages=[{"role": "user", "content": q}])
               for q in load_prompts(args.prompts, args.limit)]
    run(base, prompts[:2], params, args.batch)  # warm-up
    reference, ref_secs, _ = run(base, prompts, params, args.batch)
    rows = [summarize("target-only", reference, ref_secs, None, reference, ref_secs)]
    print(json.dumps(rows[0]), flush=True)
    base_dtype = base.engine.dtype
    del base
    for text in args.config:
        gen = build_generator(cfg, parse_config(text, head))
        run(gen, prompts[:2], params, args.batch)
        outputs, secs, metrics = run(gen, prompts, params, args.batch)
        rows.append(summarize(text, outputs, secs, metrics, reference, ref_secs))
        print(json.dumps(rows[-1]), flush=True)
        del gen
    report = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "model": model_dir, "head": args.head, "max_tokens": args.max_tokens, "batch": args.batch,
              "dtype": str(base_dtype), "results": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
