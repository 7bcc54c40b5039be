"""The attention kernel as the compiler makes it for a Hopper GPU, checked without one.

``benchmarks/kernel_resources.py`` compiles the kernel for sm_90 (Triton's bundled ``ptxas``, no
device needed). The Llama-3-8B tree tile the engine picks must keep the next key tile's copies in
flight while a tile is computed, its decode tile must leave room for four programs an SM, and
neither may spill: a change that puts the block-table read back inside its tile's iteration (the
pipeliner then waits for every copy at each tile's start), grows the decode tile's shared memory or
spills registers fails here, before any GPU time is spent.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import triton

from kernels.attention_triton import ATTN_PREFETCH_TILES, _programs_per_sm, attention_config

ROOT = Path(__file__).resolve().parent.parent
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def compiled(tmp_path, *args: str) -> dict:
    """``benchmarks/kernel_resources.py ARGS`` for one config: its row."""
    out = tmp_path / "resources.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_resources.py"), "--out", str(out), *args],
                   env=env, check=True, capture_output=True, timeout=300)
    (row,) = json.loads(out.read_text())["configs"]
    return row


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton carries no ptxas for NVIDIA targets")
def test_the_llama8b_tree_tile_keeps_copies_in_flight_without_spilling(tmp_path):
    cfg = attention_config(64, 4, 128, 2, tree=True)  # a 64-token tree step
    row = compiled(tmp_path, "--prefetch", str(ATTN_PREFETCH_TILES),  # (as a dependent launch asks L2 first)
                   "--config", f"{cfg.block_m},{cfg.block_n},{cfg.num_warps},{cfg.num_stages}")
    assert cfg.num_stages >= 3 and row["in_flight"] >= 2, row  # the next tile's two copy groups pending
    assert row["stack_bytes"] == 0, row


# A Hopper SM: 64K registers, 228 KiB of shared memory, 2048 threads.
HOPPER = SimpleNamespace(regs_per_multiprocessor=65536, shared_memory_per_multiprocessor=233472,
                         max_threads_per_multi_processor=2048)


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton carries no ptxas for NVIDIA targets")
def test_the_llama8b_decode_tile_fits_four_programs_an_sm_without_spilling(tmp_path):
    """A batch of decodes fills the GPU with programs, each streaming its sequence's keys: what hides
    the copies' latency is programs an SM. On an H200 at batch 64 and 4K keys the decode tile with 3
    stages (72 KB of shared memory: 3 programs an SM) took 298 us a layer, with 2 stages (39 KB: 4) 249
    us, the time to read the KV once (``benchmarks/results/attention/h200_decode_batch64.json``)."""
    cfg = attention_config(1, 4, 128, 2)
    row = compiled(tmp_path, "--causal", "--prefetch", str(ATTN_PREFETCH_TILES),
                   "--config", f"{cfg.block_m},{cfg.block_n},{cfg.num_warps},{cfg.num_stages}")
    assert _programs_per_sm(row["registers"], row["shared_bytes"], cfg.num_warps, HOPPER) >= 4, row
    assert row["stack_bytes"] == 0, row


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton carries no ptxas for NVIDIA targets")
def test_the_exact_decode_attention_keeps_copies_in_flight(tmp_path):
    """The batch-invariant kernel's open keys (all of a decode step's) as its launch compiles them. (Its
    registers sit at the limit: Triton 3.6 compiles it without spills, 3.9 with 160 bytes; not checked.)"""
    from kernels import attention_exact as ex
    row = compiled(tmp_path, "--exact", "--causal", "--config",
                   f"{ex.BLOCK_M},{ex.BLOCK_N},{ex.NUM_WARPS},{ex.NUM_STAGES}")
    assert row["in_flight"] >= 2, row


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton carries no ptxas for NVIDIA targets")
def test_the_exact_wide_tree_tile_fits_two_programs_an_sm_without_spilling(tmp_path):
    """A tree over a long prefix: the batch-invariant kernel's wide rows walking their whole chunks a
    loop a chunk (``TREE_NESTED``) as its launch compiles them for a tree of one wide tile a sequence
    (``nested_tile(False)``: ``NESTED_STAGES``, 16 columns of ones). Two programs an SM are what made
    that loop pay (the 8B's 64-token tree over 32K keys 284.5 -> 216.9 us a layer on an H200), and
    without the visibility selects (``OPEN_TILES``) the tile holds 198 registers with none spilled
    where with them it held 255 and spilled (Triton 3.9; on the H200 193.5 against 214.6 us)."""
    from kernels import attention_exact as ex
    stages, cols = ex.nested_tile(False)
    row = compiled(tmp_path, "--exact", "--tree-wide", "--nested", "--rowsum-cols", str(cols), "--config",
                   f"{ex.BLOCK_M},{ex.BLOCK_N},{ex.NUM_WARPS},{stages}")
    assert _programs_per_sm(row["registers"], row["shared_bytes"], ex.NUM_WARPS, HOPPER) >= 2, row
    assert row["stack_bytes"] == 0, row


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton carries no ptxas for NVIDIA targets")
def test_a_larger_trees_wide_tile_keeps_two_programs_an_sm_on_three_stages(tmp_path):
    """A tree of more than one wide tile a sequence (``nested_tile(True)``): three stages of copies,
    the next tile's two copy groups in flight, still two programs an SM, which the row sums' ones fit
    at 8 columns (115,712 bytes of shared memory, Triton 3.9) and not at 16 (116,736: one program).
    On an H200 that took the 8B's 64-token tree over 32K keys from 193.6 to 176.1 us a layer."""
    from kernels import attention_exact as ex
    stages, cols = ex.nested_tile(True)
    assert stages == 3 and cols == 8, (stages, cols)
    row = compiled(tmp_path, "--exact", "--tree-wide", "--nested", "--rowsum-cols", str(cols), "--config",
                   f"{ex.BLOCK_M},{ex.BLOCK_N},{ex.NUM_WARPS},{stages}")
    assert _programs_per_sm(row["registers"], row["shared_bytes"], ex.NUM_WARPS, HOPPER) >= 2, row
    assert row["in_flight"] >= 2, row
    wider = compiled(tmp_path, "--exact", "--tree-wide", "--nested", "--rowsum-cols", "16", "--config",
                     f"{ex.BLOCK_M},{ex.BLOCK_N},{ex.NUM_WARPS},{stages}")
    assert _programs_per_sm(wider["registers"], wider["shared_bytes"], ex.NUM_WARPS, HOPPER) == 1, wider
