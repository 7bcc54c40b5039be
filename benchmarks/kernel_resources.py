"""The paged attention kernel compiled for a Hopper GPU on a machine without one: registers,
spills, shared memory and how far ahead its key/value copies run, per tile config.

Triton compiles to PTX and runs its bundled ``ptxas`` without a device, so what the compiler
makes of a kernel change can be read before any GPU time is spent::

    python benchmarks/kernel_resources.py --config 64,64,4,3 --config 16,64,4,3 --out resources.json

Per config it prints the registers a thread and the stack bytes (spills) from ``cuobjdump
-res-usage``, the shared memory a program, and ``in_flight``: the ``num`` of the first
``ttg.async_wait`` of the TTGIR, the open-keys loop's wait at the start of a tile, which returns
once at most ``num`` copy groups are pending. A tile's key and value copies are two groups: 0
means a tile waits for every copy issued so far (the next tile's copies are issued only after
this one's scores and softmax), 2 that the next tile's copies stay in flight while this tile is
computed. The launch's integer arguments are specialised as a real
launch specialises them (strides divisible by 16). Default geometry: Llama-3-8B (4 query heads a
KV head, head_dim 128), bf16, a tree step (packed mask) with key splits.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import attention_exact  # noqa: E402
from kernels.attention_triton import _attention_kernel  # noqa: E402

_POINTERS = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "out_ptr": "*fp32", "lse_ptr": "*fp32",
             "qsl_ptr": "*i64", "seq_lens_ptr": "*i64", "tables_ptr": "*i32", "mask_ptr": "*i32",
             "mask_start_ptr": "*i64", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32",
             "pos_ptr": "*i64", "table_ptr": "*i32", "used_ptr": "*i32"}


def compile_config(block_m: int, block_n: int, warps: int, stages: int, group: int, head_dim: int, masked: bool,
                   split: bool, exact: bool = False, capability: int = 90, prefetch: int = 0,
                   tree_wide: bool = False, nested: bool = False, rowsum_cols: int = 16):
    """The attention kernel (``exact``: the batch-invariant one, whose tiles are fixed: ``block_m`` and
    ``block_n`` are its module's) compiled for ``sm_<capability>`` with these tiles and launch constants
    (``prefetch``: key tiles asked of L2 before the dependent launch's wait, EAGLE3_ATTN_PREFETCH;
    ``tree_wide``: a tree's split launch with its whole-chunk programs on ``TREE_WIDE_ROWS`` rows;
    ``nested``: those programs in a loop a chunk, ``TREE_NESTED``; ``rowsum_cols``: the columns of ones
    in their row sums, ``nested_tile``)."""
    kernel = attention_exact._exact_attention_kernel if exact else _attention_kernel
    names = kernel.arg_names
    const = dict(G=group, BLOCK_Q=block_m // group, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim,
                 BLOCK_D=head_dim, BLOCK_SIZE=16, HAS_MASK=masked, SPLIT=split, PRECISION="tf32",
                 DOT_DTYPE=tl.bfloat16)
    wide = tree_wide and masked and split
    sub = attention_exact.TREE_WIDE_ROWS // block_m if wide else attention_exact.TREE_TILES if masked and split else 1
    const.update(CHUNK=attention_exact.CHUNK, USE_GDC=False, RAGGED=False, BLOCK_B=1, SUB=sub,
                 SHARED_Q=block_m // group * (sub if wide else 1), SHARED_M=block_m * (sub if wide else 1),
                 SHARED_TWO=not wide,
                 FLAT=attention_exact.walks_flat(masked, attention_exact.CHUNK), NESTED=nested,
                 OPEN=rowsum_cols if wide and attention_exact.OPEN_TILES else 0) if exact else const.update(
        EVEN_D=True, RAGGED=False, BLOCK_B=1, USE_GDC=False, PREFETCH_TILES=prefetch,
        ROW_LINES=max(1, head_dim * 2 // 128), LINE=64)
    out_type = "*bf16" if exact else "*fp32"  # (the exact kernel writes bf16 outputs, its partials float32)
    unspecialised = set(kernel.do_not_specialize) | {"scale_log2"}
    sig = {n: "constexpr" if n in const else out_type if n == "out_ptr" else
           _POINTERS.get(n, "fp32" if n == "scale_log2" else "i32") for n in names}
    aligned = [n for n in names if n not in const and n not in unspecialised and (n in _POINTERS or n.startswith("stride"))]
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=dict(num_warps=warps,
                                                                                         num_stages=stages))


def resources(kernel) -> dict:
    """Registers, stack, shared memory and the copy groups left in flight at a tile's start."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        usage = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    regs, stack = (int(x) for x in re.search(r"REG:(\d+) STACK:(\d+)", usage).groups())
    waits = [int(n) for n in re.findall(r"ttg\.async_wait[^\n]*\{num = (\d+)", kernel.asm["ttgir"])]
    return {"registers": regs, "stack_bytes": stack, "shared_bytes": kernel.metadata.shared,
            "in_flight": waits[0] if waits else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", action="append", required=True, help="block_m,block_n,warps,stages (repeatable)")
    ap.add_argument("--group", type=int, default=4, help="query heads a KV head")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true", help="no packed mask (decode and prefill steps)")
    ap.add_argument("--one-split", action="store_true", help="no key splits")
    ap.add_argument("--exact", action="store_true",
                    help="the batch-invariant kernel (--exact); --config M,N its fixed tiles, W,S its launch's")
    ap.add_argument("--tree-wide", action="store_true",
                    help="with --exact: a tree's whole-chunk programs on TREE_WIDE_ROWS rows (the wide tree tile)")
    ap.add_argument("--nested", action="store_true",
                    help="with --exact: a tree's whole-chunk programs in a loop a chunk (TREE_NESTED)")
    ap.add_argument("--rowsum-cols", type=int, choices=(8, 16), default=16,
                    help="with --tree-wide: the columns of ones in the wide rows' row sums (ROWSUM_COLS: 8 on "
                         "the three stages of a tree of more than one wide tile, nested_tile)")
    ap.add_argument("--prefetch", type=int, default=0,
                    help="key tiles asked of L2 before the wait (EAGLE3_ATTN_PREFETCH; not with --exact)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for text in args.config:
        m, n, w, s = (int(x) for x in text.split(","))
        r = resources(compile_config(m, n, w, s, args.group, args.head_dim, not args.causal, not args.one_split,
                                     args.exact, prefetch=args.prefetch, tree_wide=args.tree_wide, nested=args.nested,
                                     rowsum_cols=args.rowsum_cols))
        rows.append({"config": [m, n, w, s], **r})
        print(f"m{m:>3} n{n:>3} w{w} s{s}: {r['registers']:>3} registers, {r['stack_bytes']:>4} stack bytes, "
              f"{r['shared_bytes']:>6} shared bytes, in flight {r['in_flight']}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"triton": triton.__version__, "group": args.group,
                                              "head_dim": args.head_dim, "masked": not args.causal,
                                              "split": not args.one_split, "exact": args.exact, "prefetch": args.prefetch,
                                              "tree_wide": args.tree_wide, "nested": args.nested,
                                              "rowsum_cols": args.rowsum_cols,
                                              "configs": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
