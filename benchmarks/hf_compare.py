"""Batch-1 target-only decoding: this engine next to Hugging Face transformers ``generate`` on the
same weights and prompts, in one run.

The weights are random with SmolLM2-135M's geometry (speed does not depend on their values;
every run generates exactly ``--new-tokens`` tokens): transformers builds the model, saves it as
a Hugging Face checkpoint, and the engine loads that checkpoint. transformers runs eagerly
(dynamic cache) and, where it works, with its static cache under ``torch.compile``.

    python benchmarks/hf_compare.py --new-tokens 256 --out hf_compare.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.decode_baseline import GEOMETRIES  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402
from verify_service.config import EngineConfig  # noqa: E402
from verify_service.engine import Engine  # noqa: E402
from verify_service.target import Target  # noqa: E402


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(100, vocab, (length,), generator=g).tolist() for _ in range(n)]


def time_engine(model_dir: str, ps: list[list[int]], new: int, enforce_eager: bool) -> float:
    cfg = EngineConfig(model_dir, dtype="bfloat16", device="cuda", max_model_len=2048, max_num_seqs=1,
                       enforce_eager=enforce_eager)
    engine = Engine(Target.from_config(cfg))
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    engine.generate([ps[0]], SamplingParams(max_tokens=32, ignore_eos=True))  # warm-up: compile, capture
    torch.cuda.synchronize()
    t = time.perf_counter()
    for p in ps:
        assert len(engine.generate([p], params)[0].token_ids) == new
    return len(ps) * new / (time.perf_counter() - t)


def time_hf(model, ps: list[list[int]], new: int, **kw) -> float:
    def run(p, n):
        ids = torch.tensor([p], device="cuda")
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)
        assert out.shape[1] == len(p) + n

    run(ps[0], new)  # warm-up (and compilation)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for p in ps:
        run(p, new)
    torch.cuda.synchronize()
    return len(ps) * new / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import transformers

    cfg = dict(GEOMETRIES["smollm2"], torch_dtype="bfloat16")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).to("cuda", torch.bfloat16).eval()
    ps = prompts(args.prompts, args.prompt_len, cfg["vocab_size"])
    res = {"device": torch.cuda.get_device_name(), "transformers": transformers.__version__, "torch": torch.__version__,
           "prompts": args.prompts, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "tok_per_s": {}}

    def record(name: str, tok_s: float) -> None:  # as each finishes: a run cut short keeps what it had
        res["tok_per_s"][name] = round(tok_s, 1)
        print(f"{name:>30}: {tok_s:8.1f} tok/s", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=2))

    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d, safe_serialization=True)
        record("engine", time_engine(d, ps, args.new_tokens, enforce_eager=False))
        record("engine_eager", time_engine(d, ps, args.new_tokens, enforce_eager=True))
    record("hf_generate", time_hf(model, ps, args.new_tokens))
    try:
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        record("hf_generate_static_compiled", time_hf(model, ps, args.new_tokens, cache_implementation="static"))
    except Exception as exc:  # reported, not hidden: the comparison says it did not run
        res["hf_static_compiled_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print("static cache + torch.compile did not run:", res["hf_static_compiled_error"])
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=2))

if __name__ == "__main__":
    main()
