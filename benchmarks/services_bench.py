"""Both services as processes on one device: output agreement with the in-process target-only
engine, end-to-end tokens/s with speculation and without it (the same server, per-request
``speculate=False``, side by side in one run), and the per-step control-plane overhead of the
draft link.

    python benchmarks/services_bench.py --prompts mt_bench.jsonl --limit 20 --max-tokens 64 \\
        --device cuda --dtype bfloat16 --head random --out services.json

The control-plane overhead is, per draft round trip, the time not spent computing: gRPC
messages, thread hand-offs, shared-buffer synchronisation (reported by the verify service).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cli.up import spawn, wait_healthy  # noqa: E402
from client.eagle3_client import Eagle3Client  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402
from draft_service.eagle_init import write_random_head  # noqa: E402
from hub.default_model import ensure_default_model  # noqa: E402
from tools.inprocess import build_engine  # noqa: E402
from tools.train.data import load_prompts  # noqa: E402
from verify_service.config import EngineConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--head", default="random")
    ap.add_argument("--tree", default="chain:3", help="TREE:DEPTH (server default tree)")
    ap.add_argument("--adaptive-speculation", default="off", choices=["on", "off"],
                    help="the verify service's --adaptive-speculation (off: always the --tree)")
    ap.add_argument("--exact", action="store_true",
                    help="batch-invariant target kernels in the verify service and the in-process reference")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = str(ensure_default_model(progress=False))
    tmp = Path(tempfile.mkdtemp(prefix="eagle3-bench-"))
    head = args.head
    if head == "random":
        head = str(tmp / "head")
        write_random_head(head, json.loads((Path(model) / "config.json").read_text()), 8192)
    tree, depth = args.tree.split(":")
    texts = load_prompts(args.prompts, args.limit)

    # Reference: the in-process target-only engine, same device and dtype.
    ref_gen = build_engine(EngineConfig(model, device=args.device, dtype=args.dtype, max_model_len=4096,
                                        max_num_seqs=1, exact=args.exact))
    prompts = [ref_gen.target.encode(messages=[{"role": "user", "content": t}]) for t in texts]
    params = SamplingParams(max_tokens=args.max_tokens)
    reference = [ref_gen.generate([p], params)[0].token_ids for p in prompts]
    del ref_gen

    public, internal = f"unix:{tmp}/public.sock", f"unix:{tmp}/draft.sock"
    common = ["--device", args.device]
    verify = spawn(["serve-verify", "--model", model, "--listen", public, "--internal", internal, "--dtype",
                    args.dtype, "--max-model-len", "4096", "--max-num-seqs", "8", "--tree", tree,
                    "--tree-depth", depth, "--adaptive-speculation", args.adaptive_speculation, *common,
                    *(["--exact"] if args.exact else [])],
                   tmp / "verify.log")
    draft = None
    try:
        client = Eagle3Client(public, timeout_s=600)
        wait_healthy(client, "", verify, "verify service")
        draft = spawn(["serve-draft", "--draft", head, "--verify", internal, "--listen", f"unix:{tmp}/dh.sock",
                       "--tree", tree, "--tree-depth", depth, *common], tmp / "draft.log")
        wait_healthy(client, "eagle3.speculation", draft, "draft service")
        client.complete(prompts[0], max_tokens=8)  # warm-up
        rows, start_t = [], time.perf_counter()
        for p in prompts:
            c = client.complete(p, max_tokens=args.max_tokens)
            rows.append((c.token_ids, c.speculation))
        secs = time.perf_counter() - start_t
        plain_start = time.perf_counter()
        plain = [client.complete(p, max_tokens=args.max_tokens, speculate=False).token_ids for p in prompts]
        plain_secs = time.perf_counter() - plain_start
        metrics = client.metrics()
        tokens = sum(len(t) for t, _ in rows)
        report = {"device": args.device, "dtype": args.dtype, "tree": args.tree, "exact": args.exact,
                  "prompts": len(prompts),
                  "max_tokens": args.max_tokens, "identical_outputs": sum(t == r for (t, _), r in zip(rows, reference)),
                  "tokens": tokens, "tokens_per_s": round(tokens / secs, 1),
                  "plain_tokens_per_s": round(sum(len(t) for t in plain) / plain_secs, 1),
                  "speedup_vs_plain": round(tokens / secs / (sum(len(t) for t in plain) / plain_secs), 3),
                  "plain_identical_outputs": sum(t == r for t, r in zip(plain, reference)),
                  "speculated_requests": sum(bool(s and s.get("speculated")) for _, s in rows),
                  "control_plane_p50_us": metrics["control_plane_p50_us"],
                  "control_plane_p99_us": metrics["control_plane_p99_us"],
                  "speculative_steps": metrics["speculative_steps"], "draft_errors": metrics["draft_errors"]}
        print(json.dumps(report), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2))
    finally:
        for p in (draft, verify):
            if p is not None:
                p.terminate()
                p.wait(30)


if __name__ == "__main__":
    main()
