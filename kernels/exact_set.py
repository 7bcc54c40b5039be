"""The batch-invariant kernel set (``--exact``): every target row's bits independent of the step.

A token's logits come out the same whether it is decoded alone, verified inside a 64-token
tree, prefilled in any chunking, or batched with any other sequences: every step runs the
projections with the layer's norms, activation and (where the heads allow) RoPE and the KV write
in their epilogues (``kernels/fused_linear_triton.py``), a row's products accumulated in K order
and its sums of squares in fixed point, the LM head uses one fixed matmul tile (``linear_exact``),
attention walks keys in position order in fixed tiles and fixed chunks (``paged_attention_exact``),
and RMSNorm is computed row by row. So greedy speculative output equals target-only
output in bf16 too, as it does in float32.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

import torch

from kernels.attention_exact import BLOCK_N, CHUNK, paged_attention_exact, prepare_attention_exact
from kernels.fused_linear_triton import (EXACT_ROW_TILE, WIDE_ROW_TILE, every_step, linear_add_norm_triton,
                                         scaled_gate_up_silu_triton, scaled_linear_triton, scaled_qkv_rope_triton)
from kernels.linear_triton import linear_exact
from kernels import KernelSet
from kernels.triton_set import TRITON

log = logging.getLogger(__name__)


# Per (device, dtype): whether the fast path's row tiles leave a row's bits unchanged there
# (``probe_row_tiles``). Where they do not, the set's projections take the fixed ``EXACT_ROW_TILE``.
_ROW_COUNT_TILES: dict[tuple[torch.device, torch.dtype], bool] = {}
PROBE_ROWS = (1, 7, 20, 64)  # calls of these many rows (16-, 16-, 32- and 64-row tiles) against one call of
PROBE_WHOLE = 192  # this many on the 128-row tile (two programs a column tile, the second one ragged)


def probe_row_tiles(o_proj: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, qkv: torch.Tensor,
                    norm: torch.Tensor, eps: float, qkv_bias: torch.Tensor | None = None,
                    heads: tuple[int, int, int] | None = None) -> bool:
    """Whether the fused projections give each row the same bits on the fast path's row tiles (from
    the row count) as inside one call of ``PROBE_WHOLE`` rows (the 128-row tile), on these weights'
    device and dtype: a layer's four projections (o_proj, gate_up, down, qkv: [out, in]) on random
    rows, then on rows of calls of 1, 7, 20 and 64 rows at three offsets, with the sums of h^2 in
    fixed point. ``heads`` (query heads, KV heads, head_dim): the qkv projection with RoPE and the
    KV write in its epilogue too (``scaled_qkv_rope``: rotated q, and the k and v it writes), as
    the layer runs it. On an H200 the tensor cores
    accumulate a row's products in K order whatever the tiles (``benchmarks/row_tile_bits.py``); a GPU
    that does not is found here. The result is kept for the device and dtype; a model's own weights
    compile the variants its steps use anyway. Not inside a CUDA graph's capture."""
    dev, dtype = o_proj.device, o_proj.dtype
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(PROBE_WHOLE, o_proj.shape[1], generator=gen).to(dev, dtype)
    res = torch.randn(PROBE_WHOLE, o_proj.shape[0], generator=gen).to(dev, dtype)
    rope = _rope_inputs(heads, dev, dtype) if heads is not None else None

    def layer(rows: slice, block_m: int | None = None) -> list[torch.Tensor]:
        tile = dict(exact_sums=True, block_m=block_m)
        h, hn, ss = linear_add_norm_triton(x[rows], o_proj, res[rows], norm, **tile)
        act = scaled_gate_up_silu_triton(hn, ss, eps, gate_up, **tile)
        q = scaled_linear_triton(hn, ss, eps, qkv, qkv_bias, **tile)
        out = linear_add_norm_triton(act, down, h, norm, **tile)
        rotated = [] if rope is None else rope(hn, ss, eps, qkv, qkv_bias, rows, block_m)
        return [h, hn, ss.T, act, q, *out[:2], out[2].T, *rotated]  # (partial sums: rows last -> first)

    # (the 128-row tile forced: calls of more than 64 rows take it only where the 64-row tile
    # would launch many programs, ``row_tile``, and 192 rows of a small layer would not)
    whole = layer(slice(0, PROBE_WHOLE), WIDE_ROW_TILE)
    same = all(torch.equal(got, want[start:start + n])
               for n in PROBE_ROWS for start in (0, 40, 120)
               for got, want in zip(layer(slice(start, start + n)), whole))
    _ROW_COUNT_TILES[(dev, dtype)] = same
    if not same:
        log.warning("the fused projections' row tiles change a row's bits on %s (%s, %s): the batch-invariant "
                    "set runs them on one fixed %d-row tile there (slower, as invariant)",
                    dev, torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type, dtype, EXACT_ROW_TILE)
    return same


def _rope_inputs(heads: tuple[int, int, int], device: torch.device, dtype: torch.dtype):
    """For ``probe_row_tiles``: ``scaled_qkv_rope`` on a call's rows, at positions equal to their row
    numbers (random angles, float32 tables as a model's), each into its own slot of a fresh cache
    (NaN elsewhere): [rotated q, k, v of its slots]."""
    n_q, n_kv, head_dim = heads
    angles = torch.rand(PROBE_WHOLE, head_dim // 2, generator=torch.Generator().manual_seed(4)) * 6.3
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    slots = torch.arange(PROBE_WHOLE, device=device)

    def run(hn, ss, eps, qkv, qkv_bias, rows: slice, block_m: int | None) -> list[torch.Tensor]:
        caches = [torch.full((PROBE_WHOLE, 1, n_kv, head_dim), float("nan"), dtype=dtype, device=device)
                  for _ in range(2)]
        q = scaled_qkv_rope_triton(hn, ss, eps, qkv, qkv_bias, slots[rows], cos, sin, *caches, slots[rows],
                                   n_q, n_kv, head_dim, exact_sums=True, block_m=block_m)
        return [q, *(c[rows] for c in caches)]
    return run


def probe_layer(layer) -> bool:
    """``probe_row_tiles`` on a target decoder layer's fused weights (``verify_service/model.py``),
    its qkv projection with RoPE in the epilogue too where the layer runs it so."""
    attn, mlp, norm = layer.self_attn, layer.mlp, layer.post_attention_layernorm
    heads = (attn.num_heads, attn.num_kv_heads, attn.head_dim) if attn.rope_in_projection else None
    return probe_row_tiles(attn.o_proj.weight, mlp.gate_up_weight, mlp.down_proj.weight, attn.qkv_weight,
                           norm.weight, norm.eps, attn.qkv_bias, heads)


def _synthetic_probe(device: torch.device, dtype: torch.dtype) -> bool:
    """``probe_row_tiles`` on random weights of a small layer (kernels used without a model: tests,
    benchmarks). K of 1152: over 1024, so the K step follows the row tile."""
    gen = torch.Generator().manual_seed(1)

    def w(n, k):
        return (torch.randn(n, k, generator=gen) * k ** -0.5).to(device, dtype)

    return probe_row_tiles(w(576, 1152), w(2 * 1536, 576), w(576, 1536), w(1152 + 256, 576),
                           (1 + 0.1 * torch.randn(576, generator=gen)).to(device, dtype), 1e-5,
                           heads=(18, 2, 64))  # (1408 qkv columns: 18 query heads and 2 KV heads of 64)


def row_count_tiles(x: torch.Tensor) -> bool:
    """Whether the set's projections take the fast path's row tiles for ``x``'s device and dtype: on
    a GPU where the probe found them invariant (probed here at first use, with random weights, when
    no model layer was probed before); never in Triton's interpreter, which rounds each dot per K
    step, the K step following the row tile (``row_linear_config``)."""
    if not x.is_cuda:
        return False
    key = (x.device, x.dtype)
    if key not in _ROW_COUNT_TILES:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"the batch-invariant set's row-tile probe has not run for {x.device} and {x.dtype}: "
                               "run kernels.exact_set.probe_layer before capturing graphs")
        _synthetic_probe(*key)
    return _ROW_COUNT_TILES[key]


def _gpu_row_count_tile(fn, exact_sums: bool):
    """``fn`` on the fast path's row tile (from the step's row count) where ``row_count_tiles``, else
    on the fixed ``EXACT_ROW_TILE``."""
    @functools.wraps(fn)
    def call(x, *args, **kwargs):
        return fn(x, *args, block_m=None if row_count_tiles(x) else EXACT_ROW_TILE, exact_sums=exact_sums,
                  **kwargs)
    return call


def with_row_tile(row_tile: int | None, exact_sums: bool = True) -> KernelSet:
    """The batch-invariant set with its projections on one ``row_tile``-row tile, or (``None``) on
    the tile from the step's row count, as the fast path picks it, with the sums of h^2 in fixed
    point (``exact_sums``). Any fixed tile keeps a row's bits independent of the step. The tile
    from the row count does too on an H200 once the sums are in fixed point: the tensor cores
    accumulate a row's products in K order whatever the row and K tiles
    (``benchmarks/row_tile_bits.py --exact-sums``: 0 of 64 cases differ, 52a76bf), and the GPU
    tests check it bitwise; on other GPUs ``probe_row_tiles`` decides."""
    if row_tile is None:
        def project(fn):
            return _gpu_row_count_tile(fn, exact_sums)
    else:
        def project(fn):
            return functools.partial(fn, block_m=row_tile, exact_sums=exact_sums)
    return dataclasses.replace(
        TRITON,
        prepare_attention=prepare_attention_exact,
        paged_attention=paged_attention_exact,
        linear=linear_exact,
        scaled_linear=project(scaled_linear_triton),
        scaled_gate_up_silu=project(scaled_gate_up_silu_triton),
        linear_add_norm=project(linear_add_norm_triton),
        fused_rows=every_step,
        # (q and k rotated and the KV written in the projection's epilogue, one launch a layer less a
        # step; the row-tile probe covers it: where its rows change with the tile, the fixed tile)
        scaled_qkv_rope=project(scaled_qkv_rope_triton),
        name="exact",  # (the engine captures graphs for the sets it knows by name)
    )


# The projections on the fast path's row tiles with the sums in fixed point (H200, 52a76bf,
# decode_baseline.py --exact-row-tile 0: the 8B batch-1 step at 4K 4.893 ms against 5.409 on one
# fixed 64-row tile, 4.553 on the fast path; README: Exact mode).
EXACT = with_row_tile(None)


# Keys per fold chunk of the exact attention, for a model (``EAGLE3_EXACT_CHUNK``, read at import):
# ``auto`` (the default) picks it by the model's KV width; a number fixes it (a multiple of 64). The
# bits depend on it (every chunk keeps the invariance), so one server keeps one for its model. On
# an H200 (bcaee65, ``switch_ab.py --variant base= --variant auto=EAGLE3_EXACT_CHUNK=auto ...
# --exact``, ``exact_mode/exact_switches_h200_bcaee65.json``): SmolLM2 (3 KV heads of 64) batch 1
# 0.744 ms with 128-key chunks against 0.905 with 512 (the fast kernels 0.776), batch 64 1.174
# against 1.256 (1.154); the 8B keeps 512 (128-key chunks cost it 4.764 against 4.677 ms at batch
# 1 and 16.428 against 14.367 at batch 64: 6a72e18, ``exact_mode/exact_variants_h200_6a72e18.json``).
FOLD_CHUNK = os.environ.get("EAGLE3_EXACT_CHUNK", "auto")
AUTO_NARROW_KV = 256  # ``auto``: 128-key chunks for a KV head width (heads x head_dim) up to this


def fold_chunk(num_kv_heads: int, head_dim: int, setting: str | None = None) -> int:
    """Keys per fold chunk for a model of ``num_kv_heads`` KV heads of ``head_dim`` under ``setting``
    (default ``FOLD_CHUNK``): ``auto`` gives 128 for a KV width of at most ``AUTO_NARROW_KV``
    (SmolLM2's 192), else ``CHUNK``; a number, itself. Raises ValueError for anything else."""
    setting = FOLD_CHUNK if setting is None else setting
    if setting == "auto":
        return 128 if num_kv_heads * head_dim <= AUTO_NARROW_KV else CHUNK
    try:
        chunk = int(setting)
    except ValueError:
        chunk = 0
    if chunk < BLOCK_N or chunk % BLOCK_N or chunk > 1 << 16:
        raise ValueError(f"EAGLE3_EXACT_CHUNK must be auto or a multiple of {BLOCK_N} up to 65536 keys, "
                         f"got {setting!r}")
    return chunk


def with_chunk(chunk: int) -> KernelSet:
    """The batch-invariant set with its attention folding chunks of ``chunk`` keys."""
    if chunk == CHUNK:
        return EXACT
    return dataclasses.replace(EXACT, paged_attention=functools.partial(paged_attention_exact, chunk=chunk))
