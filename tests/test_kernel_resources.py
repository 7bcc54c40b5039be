"""The attention kernel as the compiler makes it for a Hopper GPU, checked without one.

``benchmarks/kernel_resources.py`` compiles the kernel for sm_90 (Triton's bundled ``ptxas``, no
device needed). The Llama-3-8B tree and decode tiles the engine picks must keep the next key
tile's copies in flight while a tile is computed, and must not spill: a change that puts the
block-table read back inside its tile's iteration (the pipeliner then waits for every copy at each
tile's start) or that spills registers fails here, before any GPU time is spent.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from kernels.attention_triton import attention_config

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
@pytest.mark.parametrize("tokens", [64, 1])  # a 64-token tree step, a decode step
def test_llama8b_attention_tiles_keep_copies_in_flight_without_spilling(tokens, tmp_path):
    cfg = attention_config(tokens, 4, 128, 2, tree=tokens > 1)
    row = compiled(tmp_path, "--config", f"{cfg.block_m},{cfg.block_n},{cfg.num_warps},{cfg.num_stages}",
                   *([] if tokens > 1 else ["--causal"]))
    assert cfg.num_stages >= 3 and row["in_flight"] >= 2, row  # the next tile's two copy groups pending
    assert row["stack_bytes"] == 0, row


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton carries no ptxas for NVIDIA targets")
def test_the_exact_decode_attention_keeps_copies_in_flight(tmp_path):
    """The batch-invariant kernel's open keys (all of a decode step's) as its launch compiles them. (Its
    registers sit at the limit: Triton 3.6 compiles it without spills, 3.9 with 160 bytes; not checked.)"""
    from kernels import attention_exact as ex
    row = compiled(tmp_path, "--exact", "--causal", "--config",
                   f"{ex.BLOCK_M},{ex.BLOCK_N},{ex.NUM_WARPS},{ex.NUM_STAGES}")
    assert row["in_flight"] >= 2, row
