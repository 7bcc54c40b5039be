"""Where a head-training step spends its time: phase by phase, then the whole step, then the
top operators by host and by device time.

    python benchmarks/train_step_profile.py                       # SmolLM2 geometry, random weights
    python benchmarks/train_step_profile.py --batch 32 --prompt-len 200 --answer-len 256 --ttt-steps 7

Random target weights of the geometry (timing does not depend on weight values, and no
checkpoint is needed) and random token sequences of the given lengths. Phases are timed with
a device sync between them (so their sum exceeds a real step, which overlaps host and device
work); "whole step" is ``Trainer.step`` as training runs it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.decode_baseline import GEOMETRIES  # noqa: E402
from common.config import ModelConfig  # noqa: E402
from tools.train.data import Example  # noqa: E402
from tools.train.trainer import TrainConfig, Trainer  # noqa: E402
from tools.train.ttt import ttt_loss  # noqa: E402
from verify_service.loader import random_tensors  # noqa: E402


def random_model_dir(root: Path, geometry: str) -> Path:
    if geometry not in GEOMETRIES:
        return Path(geometry)  # a model directory
    raw = GEOMETRIES[geometry]
    tensors = random_tensors(ModelConfig.from_hf(raw), seed=0, std=0.02)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(raw))
    save_file(tensors, str(root / "model.safetensors"))
    return root


def random_examples(n: int, vocab: int, prompt_len: int, answer_len: int, seed: int = 0) -> list[Example]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = rng.randint(prompt_len // 2, prompt_len * 3 // 2)
        out.append(Example([rng.randrange(vocab) for _ in range(p + answer_len)], p))
    return out


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - start


def phases(trainer: Trainer, net, opt, params, batch) -> dict[str, float]:
    """One step split at device syncs: seconds per phase."""
    (feats, logits, ids, mask), t_target = timed(lambda: trainer.target_batch(batch, net.d2t))
    out, t_unroll = timed(lambda: trainer._unroll(net, ids, feats))
    (loss, _), t_loss = timed(lambda: ttt_loss(out, logits, mask))
    opt.zero_grad(set_to_none=True)
    _, t_backward = timed(loss.backward)

    def update():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    _, t_opt = timed(update)
    return {"target forward + logits": t_target, "draft unroll": t_unroll, "loss": t_loss,
            "backward": t_backward, "clip + AdamW": t_opt}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="smollm2", help=f"{', '.join(GEOMETRIES)} or a model directory")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--answer-len", type=int, default=256)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--no-autocast", action="store_true")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp())
    model = random_model_dir(root / "model", args.geometry)
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"turns": ["unused"]}) + "\n")
    cfg = TrainConfig(str(model), str(prompts), str(root / "run"), draft_vocab=args.draft_vocab, batch=args.batch,
                      ttt_steps=args.ttt_steps, max_new_tokens=args.answer_len, device=args.device,
                      max_prompt_tokens=args.prompt_len * 3 // 2 + 1, autocast=not args.no_autocast)
    trainer = Trainer(cfg, progress=False)
    vocab = trainer.target.model_config.vocab_size
    examples = random_examples(args.batch * (args.steps + 3), vocab, args.prompt_len, args.answer_len)
    net, _ = trainer.build_head(examples)
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    batches = [examples[i:i + args.batch] for i in range(0, len(examples), args.batch)]

    for b in batches[:2]:  # warm-up: allocator, kernels, autotuning
        trainer.step(net, opt, params, 0, b)
    split = [phases(trainer, net, opt, params, b) for b in batches[2:2 + args.steps]]
    whole = [timed(lambda b=b: trainer.step(net, opt, params, 0, b))[1] for b in batches[2:2 + args.steps]]
    tokens = statistics.mean(sum(len(e.ids) for e in b) for b in batches)
    print(f"device {trainer.target.device}, batch {args.batch}, ~{tokens:.0f} tokens a batch, "
          f"{args.ttt_steps} unrolled steps, autocast {cfg.autocast}")
    for name in split[0]:
        print(f"  {name:24s} {1e3 * statistics.median(s[name] for s in split):8.1f} ms")
    step_ms = 1e3 * statistics.median(whole)
    print(f"  {'whole step':24s} {step_ms:8.1f} ms  ({1e3 / step_ms:.2f} steps/s)")
    if args.no_profile:
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for b in batches[2:5]:
            trainer.step(net, opt, params, 0, b)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    if torch.cuda.is_available():
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20))


if __name__ == "__main__":
    main()
