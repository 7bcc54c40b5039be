"""Paged attention kernel alone: time per call against tree size and context, for tile configs.

Llama-3-8B geometry by default (32 query heads, 8 KV heads, head_dim 128), one sequence (``--batch``: more), bf16.
For each (context, tokens) every config in the sweep is timed (CUDA graph replays, median), next to
the time to read the sequence's KV once at the measured copy bandwidth::

    python benchmarks/attention_kernel.py --context 4096 --context 32768 --tokens 1 --tokens 64 --sweep

``--baseline FILE`` (an earlier ``kernels/attention_triton.py``) times that file's kernel at its own
default tiles beside this tree's, alternated per case (this, baseline, this, baseline), in one
process on the same inputs; ``--exact-baseline FILE`` does the same for ``kernels/attention_exact.py``.

A graphed step's attention sees the cache's capacity as ``max_seq_len`` (its grid must not depend on
the step's lengths); ``--capacity N`` times the kernels so. ``--exact-chunk`` sets the exact
kernel's fold chunk (a model's: 128 keys for SmolLM2, 512 for the 8B), and
``--exact-split-programs`` (repeatable) times it under other values of its launch switch
(``EAGLE3_EXACT_SPLIT_PROGRAMS``; speed only)::

    python benchmarks/attention_kernel.py --heads 9 --kv-heads 3 --head-dim 64 --context 512 --tokens 60 \
        --capacity 8192 --exact --exact-chunk 128 --exact-split-programs 0 --exact-split-programs 2
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.decode_baseline import copy_bandwidth_gbs  # noqa: E402
from kernels import attention_exact  # noqa: E402
from kernels.attention_exact import ancestor_table, paged_attention_exact  # noqa: E402
from kernels.attention_triton import (AttentionConfig, _attention_kernel, _num_splits, _slots, attention_config,  # noqa: E402
                                      pack_mask, paged_attention_triton)
from kernels.metadata import AttentionMetadata  # noqa: E402

# The batch-invariant kernel's tiles and launch (every launch of it must take the same: a choice of
# the mode, not of the step): keys per tile, warps, stages. Its rows stay 64.
EXACT_SWEEP = [(m, n, w, s) for m in (16, 64) for n in (32, 64) for w in (4, 8) for s in (2, 3)] + \
    [(16, 128, w, s) for w in (4, 8) for s in (2, 3)]  # one tile a 128-key chunk (SmolLM2's)
SWEEP = [AttentionConfig(m, n, w, s) for m in (16, 64, 128) for n in (32, 64) for w in (4, 8) for s in (2, 3)] + \
    [AttentionConfig(m, n, 8, s) for m, n in ((128, 128), (256, 32), (256, 64)) for s in (2, 3)]


def tree_of(tokens: int, depth: int | None, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The ancestor-or-self matrix [tokens, tokens] of a step's tree and each node's depth. ``depth``
    None: a causal chain (node j below node j - 1, at depth j); else a tree of that depth shaped like
    the EAGLE-2 trees the engine verifies: the root, then the other nodes spread over levels 1 to
    ``depth`` (the first levels take the remainder), each level's nodes children of the level
    before's first node."""
    if depth is None or tokens <= 1:
        return torch.tril(torch.ones(tokens, tokens, dtype=torch.bool, device=device)), torch.arange(tokens)
    if depth < 1:
        raise ValueError(f"a tree's depth must be >= 1, got {depth}")
    levels = min(depth, tokens - 1)
    sizes = [(tokens - 1) // levels + (i < (tokens - 1) % levels) for i in range(levels)]
    parents, depths, first = [-1], [0], 0  # ``first``: the previous level's first node
    for d, size in enumerate(sizes, start=1):
        start = len(parents)
        parents += [first] * size
        depths += [d] * size
        first = start
    table = torch.eye(tokens, dtype=torch.bool)
    for j in range(1, tokens):
        table[j] |= table[parents[j]]
    return table.to(device), torch.tensor(depths)


def setup(context: int, tokens: int, heads: int, kv_heads: int, head_dim: int, block: int = 16, batch: int = 1,
          capacity: int | None = None, tree_depth: int | None = None):
    """``batch`` sequences of ``context`` cached keys and ``tokens`` new ones each (a causal chain, or
    a tree of ``tree_depth``: ``tree_of``), their blocks scattered over the cache; ``capacity``:
    ``max_seq_len`` as a graphed step has it (default: the step's own, context + tokens). Returns the
    queries, the caches, the metadata and the tree's ancestor-or-self matrix."""
    dev = torch.device("cuda")
    total = context + tokens
    per_seq = -(-total // block)
    nblocks = batch * per_seq
    k_cache = torch.randn(nblocks, block, kv_heads, head_dim, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch * tokens, heads, head_dim, device=dev, dtype=torch.bfloat16)
    tree, depths = tree_of(tokens, tree_depth, dev)
    rows = torch.arange(batch * tokens, device=dev)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, device=dev) * tokens, seq_lens=torch.full((batch,), total, device=dev),
        block_tables=torch.randperm(nblocks, device=dev).view(batch, per_seq), slot_mapping=rows,
        positions=context + depths.to(dev).repeat(batch), token_seq=rows // tokens, token_q_idx=rows % tokens,
        max_query_len=tokens, max_seq_len=max(total, capacity or 0),
        custom_mask=pack_mask(tree).repeat(batch, 1) if tokens > 1 else None,
        mask_start=torch.full((batch,), context, device=dev) if tokens > 1 else None)
    return q, k_cache, v_cache, meta, tree


# Bytes read before each timed call (``--l2-flush``), so its keys, values and partials come from HBM
# as in a model's step, where a layer's weights pass through the L2 between its attention calls (a
# read, not a write: written lines would be written back while the call runs, costing it bandwidth).
L2_FLUSH: torch.Tensor | None = None


def _graph_us(body, reps: int, calls: int) -> list[float]:
    """Each replay's time over ``calls``: ``body`` captured ``calls`` times in one CUDA graph."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            body()
    graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return times


def time_us(fn, reps: int = 20, calls: int = 10) -> float:
    """Device time of one call: ``calls`` calls captured in a CUDA graph (no host launch cost
    between them), the replay timed with CUDA events, median over ``reps``. With ``L2_FLUSH`` each
    call follows a read of that buffer, and the reads' own time (timed alone) is taken off."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compiles
    torch.cuda.current_stream().wait_stream(side)
    if L2_FLUSH is None:
        return statistics.median(_graph_us(fn, reps, calls))
    flush = L2_FLUSH

    def flushed():
        flush.amax()
        fn()

    return statistics.median(_graph_us(flushed, reps, calls)) - \
        statistics.median(_graph_us(flush.amax, reps, calls))


def splits_of(cfg: AttentionConfig, meta: AttentionMetadata, group: int, kv_heads: int) -> int:
    """The key splits ``paged_attention_triton`` picked for ``cfg`` (its programs per SM are known
    once it ran)."""
    programs = meta.num_seqs * -(-meta.max_query_len // max(1, cfg.block_m // group)) * kv_heads
    slots = [n for key, n in _slots.items() if dict(key[2]).get("BLOCK_M") == cfg.block_m and
             dict(key[2]).get("BLOCK_N") == cfg.block_n and dict(key[2]).get("num_warps") == cfg.num_warps and
             dict(key[2]).get("num_stages") == cfg.num_stages]
    return _num_splits(programs, meta.max_seq_len, cfg.block_n, slots[-1]) if slots else 0


def compiled_resources() -> list[dict]:
    """Registers a thread and shared memory a program of each compiled attention variant: how
    many programs one SM holds at once (the launch's waves)."""
    rows = []
    for kernel_cache, *_ in _attention_kernel.device_caches.values():
        for kernel in kernel_cache.values():
            meta = kernel.metadata
            rows.append({"num_warps": meta.num_warps, "num_stages": meta.num_stages, "n_regs": kernel.n_regs,
                         "shared_bytes": meta.shared})
    return rows


def load_file(path: str, name: str):
    """A kernel module from an earlier version's file (its imports resolve in this tree)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (its dataclasses look their module up while it loads)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def exact_settings(**values):
    """The batch-invariant kernel's module constants (``BLOCK_M``, ``SPLIT_PROGRAMS_PER_SM``, ...)
    set to ``values`` for the block."""
    saved = {name: getattr(attention_exact, name) for name in values}
    for name, value in values.items():
        setattr(attention_exact, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(attention_exact, name, value)


def parse_settings(ap: argparse.ArgumentParser, text: str) -> dict[str, int]:
    """``NAME=INT[,NAME=INT...]`` -> the batch-invariant kernel's constants to set (``--exact-settings``)."""
    values = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if not hasattr(attention_exact, name) or not value.lstrip("-").isdigit():
            ap.error(f"--exact-settings {text!r}: {item!r} is not NAME=INT for a constant of kernels/attention_exact.py")
        values[name] = int(value)
    return values


def exact_launch(block_m: int, block_n: int, num_warps: int, num_stages: int):
    """The batch-invariant kernel launched with these query rows and keys a tile, warps and stages,
    for the block."""
    return exact_settings(BLOCK_M=block_m, BLOCK_N=block_n, NUM_WARPS=num_warps, NUM_STAGES=num_stages)


def alternated(fns: dict, rounds: int = 2) -> dict[str, list[float]]:
    """Each of ``fns`` timed ``rounds`` times, in turn (a, b, a, b): us per call, by name."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(round(time_us(fn), 1))
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, action="append", required=True)
    ap.add_argument("--tokens", type=int, action="append", required=True)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tree-depth", type=int, default=None,
                    help="the --tokens as a tree of this depth shaped like the engine's EAGLE-2 trees (levels "
                         "fanning out below each level's first node) instead of a causal chain")
    ap.add_argument("--batch", type=int, default=1, help="sequences, each of --context keys and --tokens queries")
    ap.add_argument("--sweep", action="store_true", help="time every config of the sweep, not just the default")
    ap.add_argument("--splits", type=int, action="append", default=[],
                    help="also time the default tiles with this many key splits (repeatable)")
    ap.add_argument("--exact", action="store_true", help="also time the batch-invariant kernel (--exact)")
    ap.add_argument("--exact-sweep", action="store_true",
                    help="with --exact: also time its other tiles and launches (EXACT_SWEEP)")
    ap.add_argument("--exact-chunk", type=int, default=None,
                    help="with --exact: its fold chunk in keys (default: the module's CHUNK, 512)")
    ap.add_argument("--exact-split-programs", type=int, action="append", default=[],
                    help="with --exact: also time it with this SPLIT_PROGRAMS_PER_SM, for tree steps too "
                         "(repeatable; 0: one a chunk)")
    ap.add_argument("--exact-tree-split-programs", type=int, action="append", default=[],
                    help="with --exact: also time it with this TREE_SPLIT_PROGRAMS_PER_SM (repeatable)")
    ap.add_argument("--exact-tree-tiles", type=int, choices=(1, 2), action="append", default=[],
                    help="with --exact: also time it with this TREE_TILES (repeatable)")
    ap.add_argument("--exact-tree-wide", type=int, choices=(0, 1), action="append", default=[],
                    help="with --exact: also time it with TREE_WIDE off (0) or on (1) (repeatable)")
    ap.add_argument("--exact-tree-wide-programs", type=int, action="append", default=[],
                    help="with --exact: also time it with this TREE_WIDE_PROGRAMS_PER_SM (repeatable)")
    ap.add_argument("--exact-settings", action="append", default=[],
                    help="with --exact: also time it with these module constants, NAME=INT[,NAME=INT...] "
                         "(repeatable; e.g. TREE_WIDE_PROGRAMS_PER_SM=4,TREE_TILES=1), and say whether the output "
                         "has the default's bits")
    ap.add_argument("--exact-mode", choices=("fold", "split"), action="append", default=[],
                    help="with --exact: also time it with its launch shape forced (repeatable; the same bits)")
    ap.add_argument("--capacity", type=int, default=None,
                    help="max_seq_len as a graphed step sees it (the cache's capacity; default: the step's own)")
    ap.add_argument("--baseline", default=None, help="an earlier kernels/attention_triton.py, timed beside this one")
    ap.add_argument("--exact-baseline", default=None,
                    help="with --exact: an earlier kernels/attention_exact.py, timed beside this one")
    ap.add_argument("--l2-flush", type=int, default=0, metavar="MB",
                    help="read this many MB before each timed call (its time taken off), so the call reads "
                         "its keys from HBM as inside a model's step (0: off; 200 covers an H200's L2)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    settings = [parse_settings(ap, text) for text in args.exact_settings]
    global L2_FLUSH
    if args.l2_flush:
        L2_FLUSH = torch.empty(args.l2_flush << 20, dtype=torch.uint8, device="cuda")
    baseline = load_file(args.baseline, "attention_baseline") if args.baseline else None
    exact_baseline = load_file(args.exact_baseline, "attention_exact_baseline") if args.exact_baseline else None
    bw = copy_bandwidth_gbs(torch.device("cuda"))
    g = args.heads // args.kv_heads
    results = {"device": torch.cuda.get_device_name(), "copy_bandwidth_gbs": round(bw, 1), "batch": args.batch,
               "tree_depth": args.tree_depth, "l2_flush_mb": args.l2_flush,
               "cases": []}
    for context in args.context:
        for tokens in args.tokens:
            q, k, v, meta, tree = setup(context, tokens, args.heads, args.kv_heads, args.head_dim, batch=args.batch,
                                        capacity=args.capacity, tree_depth=args.tree_depth)
            read_us = 2 * k[:, :, :, :].numel() * k.element_size() / (bw * 1e9) * 1e6
            default = attention_config(tokens, g, args.head_dim, tree=tokens > 1)
            auto = splits_of(default, meta, g, args.kv_heads)
            configs = [default] + [dataclasses.replace(default, splits=n) for n in args.splits if n != auto] + \
                ([c for c in SWEEP if c != default and c.block_m >= g] if args.sweep else [])
            for cfg in configs:
                try:
                    us = time_us(lambda: paged_attention_triton(q, k, v, meta, args.head_dim ** -0.5, cfg))
                except Exception as exc:  # a config the compiler refuses (e.g. out of shared memory)
                    print(f"ctx {context} tokens {tokens} {cfg}: {type(exc).__name__}", flush=True)
                    continue
                splits = cfg.splits or splits_of(cfg, meta, g, args.kv_heads)
                r = {"context": context, "tokens": tokens, "config": [cfg.block_m, cfg.block_n, cfg.num_warps,
                                                                      cfg.num_stages], "splits": splits,
                     "default": cfg == default, "us": round(us, 1), "kv_read_us": round(read_us, 1)}
                results["cases"].append(r)
                print(f"ctx {context:>6} tokens {tokens:>3} m{cfg.block_m:>3} n{cfg.block_n:>3} w{cfg.num_warps} "
                      f"s{cfg.num_stages} x{splits:<2}{' *' if r['default'] else '  '}: {us:8.1f} us  "
                      f"(KV read {read_us:.1f} us)",
                      flush=True)
            scale = args.head_dim ** -0.5
            if baseline is not None:
                times = alternated({"this": lambda: paged_attention_triton(q, k, v, meta, scale),
                                    "baseline": lambda: baseline.paged_attention_triton(q, k, v, meta, scale)})
                results["cases"].append({"context": context, "tokens": tokens, "config": "default, against --baseline",
                                         "us_this": times["this"], "us_baseline": times["baseline"],
                                         "kv_read_us": round(read_us, 1)})
                print(f"ctx {context:>6} tokens {tokens:>3} default: this {times['this']} us, "
                      f"baseline {times['baseline']} us", flush=True)
            if args.exact:
                exact_meta = dataclasses.replace(
                    meta, custom_mask=ancestor_table(tree).repeat(args.batch, 1) if tokens > 1 else None)
                def exact(mode="auto"):
                    return paged_attention_exact(q, k, v, exact_meta, scale, mode, chunk=args.exact_chunk)

                us = time_us(exact)
                results["cases"].append({"context": context, "tokens": tokens, "config": "exact", "us": round(us, 1),
                                         "kv_read_us": round(read_us, 1)})
                print(f"ctx {context:>6} tokens {tokens:>3} exact (batch-invariant): {us:8.1f} us", flush=True)
                for mode in args.exact_mode:
                    us = time_us(lambda: exact(mode))
                    results["cases"].append({"context": context, "tokens": tokens, "config": f"exact mode={mode}",
                                             "us": round(us, 1), "kv_read_us": round(read_us, 1)})
                    print(f"ctx {context:>6} tokens {tokens:>3} exact mode={mode}: {us:8.1f} us", flush=True)
                switches = [{"SPLIT_PROGRAMS_PER_SM": n, "TREE_SPLIT_PROGRAMS_PER_SM": n}
                            for n in args.exact_split_programs] + \
                    [{"TREE_SPLIT_PROGRAMS_PER_SM": n} for n in args.exact_tree_split_programs] + \
                    [{"TREE_TILES": n} for n in args.exact_tree_tiles] + \
                    [{"TREE_WIDE": bool(n)} for n in args.exact_tree_wide] + \
                    [{"TREE_WIDE_PROGRAMS_PER_SM": n} for n in args.exact_tree_wide_programs] + \
                    [{"TREE_TILES": n, "TREE_SPLIT_PROGRAMS_PER_SM": p} for n in args.exact_tree_tiles
                     for p in args.exact_tree_split_programs] + \
                    settings
                reference = exact()
                for values in switches:
                    with exact_settings(**values):
                        us = time_us(exact)
                        same = torch.equal(exact(), reference)
                    config = "exact " + " ".join(f"{k}={v}" for k, v in values.items())
                    results["cases"].append({"context": context, "tokens": tokens, "config": config,
                                             "us": round(us, 1), "kv_read_us": round(read_us, 1),
                                             "same_bits_as_default": same})
                    print(f"ctx {context:>6} tokens {tokens:>3} {config}: {us:8.1f} us"
                          f"{'' if same else ' (OTHER BITS than the default)'}", flush=True)
                if args.exact_sweep:
                    chunk = args.exact_chunk or attention_exact.CHUNK
                    for m, n, w, st in EXACT_SWEEP:
                        if m < g or chunk % n:  # (a chunk is whole tiles)
                            continue
                        with exact_launch(m, n, w, st):
                            us = time_us(exact)
                        config = f"exact m{m} n{n} w{w} s{st}"
                        results["cases"].append({"context": context, "tokens": tokens, "config": config,
                                                 "us": round(us, 1), "kv_read_us": round(read_us, 1)})
                        print(f"ctx {context:>6} tokens {tokens:>3} {config}: {us:8.1f} us", flush=True)
                if exact_baseline is not None:
                    times = alternated({"this": exact,
                                        "baseline": lambda: exact_baseline.paged_attention_exact(
                                            q, k, v, exact_meta, scale, chunk=args.exact_chunk)})
                    results["cases"].append({"context": context, "tokens": tokens,
                                             "config": "exact, against --exact-baseline", "us_this": times["this"],
                                             "us_baseline": times["baseline"], "kv_read_us": round(read_us, 1)})
                    print(f"ctx {context:>6} tokens {tokens:>3} exact: this {times['this']} us, "
                          f"baseline {times['baseline']} us", flush=True)
    results["compiled"] = compiled_resources()
    for row in results["compiled"]:
        print("compiled:", row)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
