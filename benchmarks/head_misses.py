"""Where a head's first draft token misses: the target's own confidence, and tokens outside the
draft vocabulary.

    python benchmarks/head_misses.py --prompts mt_bench.jsonl --head default --max-tokens 256 \\
        --out misses.json

The target answers the prompts greedily (fp32 by default, as the tau measurements). Then, teacher-
forced over each answer as in training, every answer position gets the target's top-1 probability
over the whole vocabulary and the head's first draft token (unrolled step 0: the target's features
of the position before and the token just committed). Positions are grouped by the target's top-1
probability: how many fall in each group, how often the head's token is the target's there, and how
often the target's token is outside the draft vocabulary (never acceptable). For the misses inside
the vocabulary, the rank the head gave the target's token.

Agreement here is over every answer position, not per chain (a chain starts only where the last one
ended), so it is close to, not equal to, a chain's first-depth acceptance.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.sampling_params import SamplingParams  # noqa: E402
from draft_service.eagle_loader import load_eagle  # noqa: E402
from draft_service.spec_config import SpecConfig  # noqa: E402
from hub.default_model import ensure_default_model  # noqa: E402
from tools.evaluate import run  # noqa: E402
from tools.train.data import Example, load_prompts  # noqa: E402
from tools.train.trainer import TrainConfig, Trainer  # noqa: E402
from tools.train.ttt import ttt_forward  # noqa: E402
from verify_service.engine import Engine  # noqa: E402

EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0)


@torch.no_grad()
def analyze(model_dir: str, head: str, prompts: str, max_tokens: int = 256, limit: int | None = None,
            batch: int = 8, device: str = "auto", dtype: str = "float32") -> dict:
    """Per-position agreement of the head's first draft token with the target's greedy token."""
    name, head = head, SpecConfig(head, tree="chain", depth=1).draft_path  # "default" -> the shipped head
    with tempfile.TemporaryDirectory(prefix="eagle3-misses-") as scratch:  # the trainer's run folder, unused
        cfg = TrainConfig(model_dir, prompts, scratch, batch=batch, gen_batch=batch, max_new_tokens=max_tokens,
                          num_prompts=limit, device=device, dtype=dtype)
        trainer = Trainer(cfg, progress=False)
    target = trainer.target
    net = load_eagle(head, target.model_config, target.model.model.embed_tokens.weight, torch.float32,
                     target.device, target.max_model_len + 1)
    encoded = [target.encode(messages=[{"role": "user", "content": q}]) for q in load_prompts(prompts, limit)]
    encoded = [ids for ids in encoded if len(ids) <= cfg.max_prompt_tokens]
    answers, _, _ = run(Engine(target), encoded, SamplingParams(max_tokens=max_tokens), batch)  # greedy
    examples = [Example(ids + answer, len(ids)) for ids, answer in zip(encoded, answers)]
    V = target.model_config.vocab_size
    identity = torch.zeros(V, dtype=torch.int64, device=target.device)  # the target's logits over every token
    draft_id = torch.full((V,), -1, dtype=torch.int64, device=target.device)
    draft_id[torch.arange(net.d2t.numel(), device=target.device) + net.d2t] = torch.arange(net.d2t.numel(),
                                                                                          device=target.device)
    p_top, hit, inside, rank = [], [], [], []
    for i in range(0, len(examples), batch):
        feats, logits, ids, mask = trainer.target_batch(examples[i:i + batch], identity)
        step0 = ttt_forward(net, ids, feats, 1).logits[0][:, :-1]  # row i predicts x_{i+2}: target position i+1
        target, m = logits[:, 1:], mask[:, 1:].bool()
        best = target.argmax(-1)[m]
        drafted = step0.argmax(-1)[m]
        p_top.append(target.softmax(-1).amax(-1)[m])
        hit.append(drafted + net.d2t[drafted] == best)
        inside.append(net.t2d[best])
        d = draft_id[best].clamp(min=0)
        scores = step0[m]
        rank.append((scores > scores.gather(1, d[:, None])).sum(-1) + 1)
    return summarize(torch.cat(p_top), torch.cat(hit), torch.cat(inside), torch.cat(rank), name,
                     Path(prompts).name, len(examples))


def summarize(p_top: torch.Tensor, hit: torch.Tensor, inside: torch.Tensor, rank: torch.Tensor,
              head: str, prompts: str, answers: int) -> dict:
    n = p_top.numel()
    groups = []
    for lo, hi in zip(EDGES[:-1], EDGES[1:]):
        sel = (p_top >= lo) & ((p_top < hi) if hi < 1.0 else (p_top <= hi))
        k = int(sel.sum())
        groups.append({"target_top1": f"{lo:.1f}-{hi:.1f}", "positions": k, "share": round(k / n, 4),
                       "agreement": round(float(hit[sel].float().mean()), 4) if k else None,
                       "outside_vocab": round(float((~inside[sel]).float().mean()), 4) if k else None})
    miss_in = ~hit & inside
    r = rank[miss_in]
    return {"head": head, "prompts": prompts, "answers": answers, "positions": n,
            "agreement": round(float(hit.float().mean()), 4),
            "outside_vocab": round(float((~inside).float().mean()), 4),
            "groups": groups,
            "misses_inside_vocab": int(miss_in.sum()),
            "miss_rank_2": round(float((r == 2).float().mean()), 4) if r.numel() else None,
            "miss_rank_3_10": round(float(((r >= 3) & (r <= 10)).float().mean()), 4) if r.numel() else None,
            "miss_rank_over_10": round(float((r > 10).float().mean()), 4) if r.numel() else None}


def format_report(rep: dict) -> str:
    lines = [f"{rep['prompts']}: {rep['answers']} answers, {rep['positions']} positions; the head's "
             f"first token agrees with the target at {rep['agreement']:.1%}; the target's token is outside the "
             f"draft vocabulary at {rep['outside_vocab']:.1%}",
             "| target's top-1 probability | share of positions | agreement | outside the vocabulary |",
             "|---|---|---|---|"]
    for g in rep["groups"]:
        agree = "-" if g["agreement"] is None else f"{g['agreement']:.1%}"
        out = "-" if g["outside_vocab"] is None else f"{g['outside_vocab']:.1%}"
        lines.append(f"| {g['target_top1']} | {g['share']:.1%} | {agree} | {out} |")
    if rep["miss_rank_2"] is not None:
        lines.append(f"misses inside the vocabulary ({rep['misses_inside_vocab']}): the target's token was the "
                     f"head's 2nd choice in {rep['miss_rank_2']:.1%}, 3rd-10th in {rep['miss_rank_3_10']:.1%}, "
                     f"lower in {rep['miss_rank_over_10']:.1%}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="target model directory (default: embedded SmolLM2)")
    ap.add_argument("--head", default="default", help="EAGLE-3 head directory or 'default'")
    ap.add_argument("--prompts", required=True, help="JSONL prompt file (first turns are used)")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model_dir = args.model or str(ensure_default_model(progress=False))
    rep = analyze(model_dir, args.head, args.prompts, args.max_tokens, args.limit, args.batch, args.device, args.dtype)
    print(format_report(rep))
    if args.out:
        Path(args.out).write_text(json.dumps(rep, indent=2))


if __name__ == "__main__":
    main()
