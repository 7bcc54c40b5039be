"""Evaluate an EAGLE-3 head: speculative vs target-only generation, side by side in one run.

For each prompt set (first turns, chat template applied) the target-only engine runs
first (the reference); then every tree configuration runs the same prompts. Greedy. Each
row reports exact-output agreement with the reference, tokens/s, the speed ratio, tau
(committed tokens per verify step) and acceptance per depth (accepted draft tokens at depth
d per step). The target-only row also reports the head's draft-vocabulary coverage: the share of
the target's output tokens the draft vocabulary holds (a token outside it is never accepted). ``eagle3 eval-draft`` and ``benchmarks/spec_bench.py`` call :func:`evaluate`.

A configuration is ``TREE:DEPTH[:TOP_K[:NODES]]``: ``dynamic:6:8:59``, ``chain:3``.
"""

from __future__ import annotations

import dataclasses

import statistics
import time
from pathlib import Path

import torch

from common.sampling_params import SamplingParams
from draft_service.eagle_config import DraftConfig
from draft_service.eagle_loader import read_draft_tensors, vocab_maps
from draft_service.spec_config import SpecConfig
from tools.inprocess import build_engine
from tools.train.data import load_prompts
from verify_service.config import EngineConfig


def parse_config(text: str, head: str) -> SpecConfig:
    """``TREE:DEPTH[:TOP_K[:NODES]]`` -> a validated SpecConfig for ``head``."""
    parts = text.split(":")
    tree, depth = parts[0], int(parts[1])
    top_k = int(parts[2]) if len(parts) > 2 else 8
    nodes = int(parts[3]) if len(parts) > 3 else 59
    return SpecConfig(head, tree=tree, depth=depth, top_k=top_k, max_nodes=nodes)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def draft_vocab_mask(head: str) -> torch.Tensor:
    """bool [target vocab]: True at the target ids the head's draft vocabulary holds."""
    tensors = read_draft_tensors(head)
    return vocab_maps(tensors.get("d2t"), tensors.get("t2d"), DraftConfig.from_dir(head))[1]


def vocab_coverage(outputs: list[list[int]], mask: torch.Tensor) -> float:
    """Share of the tokens in ``outputs`` that ``mask`` marks (1.0 when there are none)."""
    ids = torch.tensor([t for o in outputs for t in o], dtype=torch.int64)
    return round(float(mask[ids].float().mean()), 4) if ids.numel() else 1.0


def run(engine, prompts: list[list[int]], params: SamplingParams, batch: int) -> tuple[list[list[int]], float, list]:
    """Generate in groups of ``batch`` prompts; returns outputs, generation seconds, spec metrics."""
    outputs, metrics, total = [], [], 0.0
    for i in range(0, len(prompts), batch):
        _sync()
        start = time.perf_counter()
        group = prompts[i:i + batch]
        per_request = params if params.seed is None else \
            [dataclasses.replace(params, seed=params.seed + i + j) for j in range(len(group))]  # seed + index
        results = engine.generate(group, per_request)
        _sync()
        total += time.perf_counter() - start
        outputs += [r.token_ids for r in results]
        metrics += [r.speculation for r in results]
    return outputs, total, metrics


def run_continuous(engine, prompts: list[list[int]], params: SamplingParams,
                   concurrency: int) -> tuple[int, float, int]:
    """Every prompt with ``concurrency`` requests in flight, the next one added as one finishes (a
    server's client's arrivals, at the engine's step boundaries); returns tokens, seconds, engine steps."""
    pending, live, tokens, steps = list(reversed(prompts)), 0, 0, 0
    _sync()
    start = time.perf_counter()
    while pending or live:
        while pending and live < concurrency:
            engine.add_request(pending.pop(), params)
            live += 1
        steps += 1
        for ev in engine.step():
            tokens += len(ev.token_ids)
            live -= ev.finish_reason is not None
    _sync()
    return tokens, time.perf_counter() - start, steps


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


def evaluate(model_dir: str, head: str, prompt_files: list[str], configs: list[str], max_tokens: int = 256,
             batch: int = 1, limit: int | None = None, device: str = "auto", dtype: str = "auto",
             temperature: float = 0.0, seed: int = 0, sampling_acceptance: str = "seeded",
             exact: bool | None = None, report=print) -> dict:
    """Every configuration on every prompt file; ``report`` gets each row as it is measured.

    ``temperature`` > 0: every request sampled, request i with seed ``seed + i`` (target-only and
    speculative runs alike, so "identical" compares the same seeds), trees verified by
    ``sampling_acceptance``."""
    specs = [(text, parse_config(text, head)) for text in configs]  # bad configs fail before loading
    mask = draft_vocab_mask(specs[0][1].draft_path) if specs else None
    cfg = EngineConfig(model_dir, device=device, dtype=dtype, max_model_len=4096, max_num_seqs=batch,
                       sampling_acceptance=sampling_acceptance, exact=exact)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed if temperature > 0 else None)
    sets = {}
    for path in prompt_files:
        base = build_engine(cfg)
        prompts = [base.target.encode(messages=[{"role": "user", "content": q}]) for q in load_prompts(path, limit)]
        run(base, prompts[:2], params, batch)  # warm-up
        reference, ref_secs, _ = run(base, prompts, params, batch)
        rows = [summarize("target-only", reference, ref_secs, None, reference, ref_secs)]
        if mask is not None:
            rows[0]["draft_vocab_coverage"] = vocab_coverage(reference, mask)
        report(Path(path).stem, rows[0])
        engine_dtype, engine_exact = str(base.target.dtype), base.target.exact
        del base
        for text, spec in specs:
            engine = build_engine(cfg, spec)
            run(engine, prompts[:2], params, batch)
            outputs, secs, metrics = run(engine, prompts, params, batch)
            rows.append(summarize(text, outputs, secs, metrics, reference, ref_secs))
            report(Path(path).stem, rows[-1])
            del engine
        sets[Path(path).stem] = rows
    return {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "model": model_dir, "head": head, "max_tokens": max_tokens, "batch": batch,
            "temperature": temperature, "seed": seed if temperature > 0 else None,
            "sampling_acceptance": sampling_acceptance if temperature > 0 else None, "exact": engine_exact,
            "dtype": engine_dtype, "results": sets}


def format_table(report: dict) -> str:
    """Markdown: one row per prompt set and configuration."""
    lines = ["| prompts | config | tau | acceptance per depth | identical | tok/s | vs target |",
             "|---|---|---|---|---|---|---|"]
    for name, rows in report["results"].items():
        for r in rows:
            depth = " ".join(f"{a:.2f}" for a in r.get("acceptance_per_depth", []))
            lines.append(f"| {name} | {r['config']} | {r.get('tau', 1.0):.2f} | {depth or '-'} | "
                         f"{r['identical_outputs']}/{r['prompts']} | {r['tokens_per_s']} | "
                         f"{r.get('speedup_vs_target', 1.0):.2f}x |")
    for name, rows in report["results"].items():
        if "draft_vocab_coverage" in rows[0]:
            lines.append(f"\n{name}: the draft vocabulary holds {rows[0]['draft_vocab_coverage']:.2%} "
                         "of the target-only output tokens")
    return "\n".join(lines)
