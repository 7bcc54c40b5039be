"""``eagle3`` command line: fetch the embedded default model, generate text.

    eagle3 fetch-default                       # SmolLM2-135M-Instruct -> ~/.cache/eagle3
    eagle3 generate "What is the capital of France?"
    eagle3 generate --model /path/to/hf-model --raw "Once upon a time" --temperature 0.8

Parsing needs no torch: ``--help``, ``eagle3 health`` and ``eagle3 client`` run on a client-only
install. The engine verbs import what they need when they run.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from pathlib import Path

from common.errors import EagleError, InvalidRequestError
from common.sampling_params import SamplingParams
from common.devices import device_type
from common.tree_settings import DEFAULT_EVAL_CONFIGS, add_tree_arguments, tree_settings_from_args
from verify_service.config import EngineConfig
from verify_service.server_config import add_kernel_arguments

# The `engine` extra: a verb that needs one of these says how to install it when it is missing.
ENGINE_PACKAGES = ("torch", "numpy", "safetensors", "tokenizers", "jinja2", "tqdm")


def _add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", help="the user message (or the raw prompt text with --raw)")
    p.add_argument("--prompt-file", default=None, metavar="FILE",
                   help="read the prompt from FILE ('-': standard input) instead of the argument (long prompts)")
    p.add_argument("--model", default=None,
                   help="Hugging Face model directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--system", default=None, help="system message for the chat template")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None,
                   help="makes sampled output reproducible; with --draft the sampled text differs from plain "
                        "decoding with the same seed (the same distribution, not the same tokens)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", help="auto, float32, float16, bfloat16")
    p.add_argument("--max-model-len", type=int, default=None)
    add_kernel_arguments(p)
    p.add_argument("--stats", action="store_true", help="print token counts, speed and speculation metrics to stderr")
    spec = p.add_argument_group("speculative decoding (EAGLE-3)")
    spec.add_argument("--draft", default=None,
                      help="EAGLE-3 draft head directory, or 'default' (the head shipped for SmolLM2); enables speculation")
    add_tree_arguments(spec)


def _generate(args: argparse.Namespace) -> None:
    from draft_service.spec_config import SpecConfig
    from hub.default_model import ensure_default_model
    from tools.inprocess import build_engine

    prompt = read_prompt(args.prompt, args.prompt_file)
    cfg = EngineConfig(args.model or "<embedded SmolLM2>", dtype=args.dtype, device=args.device,
                       max_model_len=args.max_model_len, max_num_seqs=1, kernels=args.kernels,
                       enforce_eager=args.enforce_eager, sampling_acceptance=args.sampling_acceptance,
                       exact=args.exact)  # checks --device
    spec = None
    if args.draft:  # validated before the (slow) model load
        tree = tree_settings_from_args(args, device_type(args.device))
        spec = SpecConfig(args.draft, tree.tree, tree.depth, tree.top_k, tree.max_nodes,
                          static_tree_file=args.static_tree)
    else:
        _warn_unused_tree_flags(args)
    if args.model is None:
        cfg = dataclasses.replace(cfg, model_dir=str(ensure_default_model()))
    engine = build_engine(cfg, spec)
    target = engine.target
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop))
    if args.raw:
        ids = target.encode(prompt=prompt)
    else:
        system = [{"role": "system", "content": args.system}] if args.system else []
        ids = target.encode(messages=[*system, {"role": "user", "content": prompt}])
    start, n, last = time.perf_counter(), 0, None
    for event in engine.stream(ids, params):
        sys.stdout.write(event.text)
        sys.stdout.flush()
        n += len(event.token_ids)
        last = event
    sys.stdout.write("\n")
    sys.stdout.flush()
    if args.stats:
        secs = time.perf_counter() - start
        reason = last.finish_reason.value if last and last.finish_reason else "none"
        print(f"[{len(ids)} prompt tokens, {n} generated in {secs:.2f}s ({n / secs:.1f} tok/s), "
              f"finish: {reason}]", file=sys.stderr)
        if spec is None:
            print("[speculation: off (no --draft)]", file=sys.stderr)
        elif last is not None and last.speculation is not None:
            m = last.speculation
            print(f"[speculation: {spec.settings.describe()}, {m.steps} steps, tau {m.tau:.2f}, "
                  f"acceptance {m.acceptance_rate:.1%}, "
                  f"{m.draft_tokens} draft / {m.accepted_tokens} accepted / {m.rewound_tokens} rewound tokens, "
                  f"per depth {m.accepted_per_depth}]", file=sys.stderr)


def read_prompt(text: str | None, path: str | None) -> str:
    """The prompt from the argument or from ``path`` (``-``: standard input); exactly one of them."""
    if (text is None) == (path is None):
        raise InvalidRequestError("prompt", "give the prompt as an argument or with --prompt-file"
                                            + (", not both" if text is not None else ""))
    if text is not None:
        return text
    if path == "-":
        return sys.stdin.read()
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise InvalidRequestError("prompt_file", f"cannot read {path!r}: {exc.strerror}") from None


def _warn_unused_tree_flags(args: argparse.Namespace) -> None:
    """Tree flags only shape a draft's trees: say so when they are given without --draft."""
    given = [flag for flag, value in (("--tree", args.tree), ("--tree-depth", args.tree_depth),
                                      ("--tree-top-k", args.tree_top_k), ("--tree-nodes", args.tree_nodes),
                                      ("--static-tree", args.static_tree)) if value is not None]
    if given:
        print(f"warning: {', '.join(given)} ignored without --draft (no speculation)", file=sys.stderr)


LOG_LEVELS = ("debug", "info", "warning", "error")
LONG_WORK = ("train-draft", "self-prompts")


def build_parser() -> argparse.ArgumentParser:
    from cli import client_verbs as client_cli
    from draft_service import server_config as draft_flags
    from verify_service import server_config as verify_flags

    parser = argparse.ArgumentParser(prog="eagle3", description="EAGLE-3 speculative decoding server: command line")
    sub = parser.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch-default", help="obtain and convert SmolLM2-135M-Instruct (idempotent)")
    fetch.add_argument("--cache-dir", default=None)
    fetch.add_argument("--quiet", action="store_true")
    _add_generate_args(sub.add_parser("generate", help="generate text in this process (no servers)"))
    verify_flags.add_arguments(sub.add_parser("serve-verify", help="run the verify service (the front door)"))
    draft_flags.add_arguments(sub.add_parser("serve-draft", help="run the draft service beside a verify service"))
    _add_train_args(sub.add_parser("train-draft", help="train an EAGLE-3 head for a target by self-distillation"))
    _add_self_prompt_args(sub.add_parser("self-prompts", help="the target writes chat prompts itself (training data)"))
    _add_eval_args(sub.add_parser("eval-draft", help="tau, acceptance per depth and speed of a head vs target-only"))
    up = sub.add_parser("up", help="start both services, wait until healthy, stream an answer")
    _add_up_args(up)
    client_cli.add_subcommands(sub)
    for name, verb in sub.choices.items():
        default = "info" if name in LONG_WORK else "warning"  # long work logs its progress
        verb.add_argument("--log-level", default=default, choices=LOG_LEVELS,
                          help=f"logging threshold (default: {default}; info shows the services' progress)")
    return parser


def _add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="target model directory (default: the embedded SmolLM2)")
    p.add_argument("--prompts", action="append", required=True,
                   help="JSONL of {\"turns\": [...]} training prompts; repeat for several files (used in order)")
    p.add_argument("--out", required=True, help="run directory (examples, resume state, exported head/)")
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=8, help="sequences per step (over all processes under torchrun)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--ttt-steps", type=int, default=4, help="unrolled draft steps (training-time test)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="answer length when distilling")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gen-batch", type=int, default=64, help="prompts answered together while distilling")
    p.add_argument("--time-limit-s", type=float, default=None,
                   help="stop after this long with state saved; the same command resumes")
    p.add_argument("--dtype", default="auto", help="the target's dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--kv-cache-gib", type=float, default=None, help="the target's KV cache (default: 16 on CUDA)")
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="longer training prompts are skipped")
    p.add_argument("--generate-only", action="store_true",
                   help="only distil (answer the prompts into OUT/examples.jsonl), then stop")
    p.add_argument("--init-head", default=None, help="start from this head's weights and vocabulary")
    p.add_argument("--warmup-steps", type=int, default=None, help="linear warm-up (default: 5%% of --steps)")
    p.add_argument("--new-vocab", action="store_true",
                   help="with --init-head: choose the draft vocabulary from this run's answers (any --draft-vocab) "
                        "and carry the head's rows over for ids in both")
    p.add_argument("--no-autocast", action="store_true", help="run the head in float32 on CUDA (default: bfloat16 autocast)")
    p.add_argument("--draft-intermediate-size", type=int, default=None,
                   help="the head's MLP width (default: --init-head's, else the target's); wider than --init-head's "
                        "widens it without changing its output at the start")


def _add_self_prompt_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="target model directory (default: the embedded SmolLM2)")
    p.add_argument("--out", required=True, help="JSONL prompt file to write (appended to: a stopped run resumes)")
    p.add_argument("--count", type=int, required=True, help="distinct prompts wanted")
    p.add_argument("--max-tokens", type=int, default=128, help="longest prompt; longer turns are dropped")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--batch", type=int, default=256, help="prompts sampled together")
    p.add_argument("--seed", type=int, default=0, help="attempt k samples with seed SEED + k")
    p.add_argument("--time-limit-s", type=float, default=None, help="stop after this long; the same command resumes")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-gib", type=float, default=None)


def _self_prompts(args: argparse.Namespace) -> None:
    from pathlib import Path

    from hub.default_model import ensure_default_model
    from tools.train.self_prompts import generate_self_prompts
    from verify_service.engine import Engine
    from verify_service.target import Target

    if args.count <= 0:
        raise InvalidRequestError("count", f"must be > 0, got {args.count}")
    target = Target.from_config(EngineConfig(
        args.target or str(ensure_default_model()), device=args.device, dtype=args.dtype,
        kv_cache_gib=args.kv_cache_gib, max_num_seqs=args.batch, max_batch_tokens=max(2048, 2 * args.batch)))
    deadline = None if args.time_limit_s is None else time.monotonic() + args.time_limit_s
    got = generate_self_prompts(Engine(target), Path(args.out), args.count, args.max_tokens, args.temperature,
                                args.top_p, args.batch, args.seed, deadline=deadline)
    print(f"{len(got)} prompts in {args.out}" + ("" if len(got) >= args.count else
                                                 "; stopped by the time limit: run the same command to resume"))


def _train(args: argparse.Namespace) -> None:
    from hub.default_model import ensure_default_model
    from tools.train.trainer import TrainConfig, Trainer

    cfg = TrainConfig(args.target or str(ensure_default_model()), args.prompts, args.out,
                      draft_vocab=args.draft_vocab, steps=args.steps, batch=args.batch, lr=args.lr,
                      ttt_steps=args.ttt_steps, max_new_tokens=args.max_new_tokens, num_prompts=args.num_prompts,
                      eval_every=args.eval_every, seed=args.seed, device=args.device, gen_batch=args.gen_batch,
                      time_limit_s=args.time_limit_s, dtype=args.dtype, kv_cache_gib=args.kv_cache_gib,
                      warmup_steps=args.warmup_steps, max_prompt_tokens=args.max_prompt_tokens,
                      init_head=args.init_head, new_vocab=args.new_vocab, autocast=not args.no_autocast,
                      draft_intermediate=args.draft_intermediate_size)
    if args.generate_only:
        examples = Trainer(cfg).prepare()
        print(f"{len(examples)} examples in {args.out}/examples.jsonl" if examples is not None
              else f"stopped by the time limit; run the same command to resume ({args.out})")
        return
    trainer = Trainer(cfg)
    head = trainer.train()
    if trainer.group.main:
        print(head if head is not None else f"stopped by the time limit; run the same command to resume ({args.out})")
    trainer.group.close()


def _add_eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="target model directory (default: the embedded SmolLM2)")
    p.add_argument("--draft", default="default", help="EAGLE-3 head directory (default: the shipped SmolLM2 head)")
    p.add_argument("--prompts", action="append", required=True,
                   help="JSONL of {\"turns\": [...]} (first turns are used); repeat for several sets")
    p.add_argument("--config", action="append", default=None,
                   help=f"TREE:DEPTH[:TOP_K[:NODES]], repeatable (default: {', '.join(DEFAULT_EVAL_CONFIGS)})")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=1, help="prompts generated together (tau does not depend on it)")
    p.add_argument("--limit", type=int, default=None, help="first N prompts of each set")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy; above 0: sampled with --seed, target-only and speculative alike")
    p.add_argument("--seed", type=int, default=0, help="the sampled requests' seed (request i: seed + i)")
    p.add_argument("--sampling-acceptance", default="seeded", choices=["seeded", "residual"],
                   help="how sampled requests verify trees (see eagle3 serve-verify --help)")
    p.add_argument("--exact", action=argparse.BooleanOptionalAction, default=None,
                   help="batch-invariant target kernels for every run, or not (default: the engine's, on on "
                        "CUDA; see eagle3 serve-verify --help)")
    p.add_argument("--out", default=None, help="write the report as JSON here")


def _eval(args: argparse.Namespace) -> None:
    import json

    from hub.default_model import ensure_default_model
    from tools.evaluate import evaluate, format_table

    configs = args.config or list(DEFAULT_EVAL_CONFIGS)
    report = evaluate(args.target or str(ensure_default_model()), args.draft, args.prompts, configs,
                      args.max_tokens, args.batch, args.limit, args.device, args.dtype,
                      temperature=args.temperature, seed=args.seed, sampling_acceptance=args.sampling_acceptance,
                      exact=args.exact, report=lambda name, row: print(f"[{name}] {json.dumps(row)}", file=sys.stderr, flush=True))
    print(format_table(report))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


def _add_up_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default="What is the capital of France?")
    p.add_argument("--draft", default="default",
                   help="EAGLE-3 head for the draft service (default: the head shipped for SmolLM2); the services "
                        "use the device's default tree: a chain of 3 on a CPU, the dynamic tree on a GPU")
    p.add_argument("--no-draft", action="store_true", help="start only the verify service (one token per step)")
    p.add_argument("--device", default="auto")
    p.add_argument("--listen", default="127.0.0.1:50051")
    p.add_argument("--run-dir", default=None, help="where the internal unix socket lives (default: a temp dir)")
    p.add_argument("--once", action="store_true", help="stop the services after the answer")


def _run(args: argparse.Namespace) -> int:
    if args.command == "fetch-default":
        from hub.default_model import ensure_default_model
        print(ensure_default_model(args.cache_dir, progress=not args.quiet))
    elif args.command == "generate":
        _generate(args)
    elif args.command == "serve-verify":
        from hub.default_model import ensure_default_model
        from verify_service import server, server_config
        server.serve(server_config.from_args(args, args.model or str(ensure_default_model())))
    elif args.command == "serve-draft":
        from draft_service import server, server_config
        server.serve(server_config.from_args(args))
    elif args.command == "train-draft":
        _train(args)
    elif args.command == "eval-draft":
        _eval(args)
    elif args.command == "self-prompts":
        _self_prompts(args)
    elif args.command == "up":
        from cli.up import up
        return up(args)
    else:
        from cli import client_verbs as client_cli
        return client_cli.run(args)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _run(args)
    except EagleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        package = (exc.name or "").partition(".")[0]
        if package not in ENGINE_PACKAGES:
            raise
        print(f"error: eagle3 {args.command} needs the engine extra ({package} is not installed): "
              f"pip install 'eagle3-serve[engine]'", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
