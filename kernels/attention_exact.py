"""Batch-invariant paged attention: a query's output bits depend only on its own keys and values.

The fast kernel (``kernels/attention_triton.py``) picks its tiles and its KV splits from the
step's shape, and walks a tree step's keys in cache order, with the tree's nodes where the
verification wrote them. So the logits of a token differ in their last bits between the
64-token tree step that verified it and the one-token decode step target-only decoding runs
at the same position, and a greedy argmax near a tie flips. This kernel computes every query
the same way whatever the step around it:

* **Keys in position order, in fixed tiles.** A query at position p sees the keys at positions
  0..p. Tile i always holds positions [i * BLOCK_N, (i + 1) * BLOCK_N), whatever the step, and
  column c of a tile is always position i * BLOCK_N + c. In a tree step a node's ancestors sit
  at cache index ``mask_start + node`` while decoding after compaction finds them at
  ``mask_start + depth``: the tiles holding tree positions are gathered per query, each column
  from the ancestor at that depth (``prepare_attention_exact`` turns the boolean ancestor mask
  into that table once per step), so the query sees the very tile it would see in a decode step.
* **Fixed chunks, folded left.** Positions are cut into chunks of ``CHUNK`` keys at fixed
  boundaries. Each chunk's online softmax gives (m, l, acc); the chunks are folded left to
  right, with one helper, whether one program walks them in turn (``fold``: many programs
  already) or each chunk's partials are written apart and a second kernel folds them
  (``split``: flash-decoding, for a long sequence with few queries). Both give the same bits.
  In the split mode a (query tile, KV head) has ``chunk_programs`` programs, the i-th taking
  chunks i, i + chunk_programs, ...: a graphed step's grid is sized by the cache's capacity, and
  one program per chunk of it would be mostly programs with nothing to do.
  In the split mode the one or two chunks holding tree tiles get one program per token (which
  walks both where the tree crosses a chunk's end), so the per-token gathers run side by side
  rather than one after another (on an H200 the whole-chunk programs taking them, a tile's tokens
  in turn, made a 60-token SmolLM2 tree's attention 14.2 against 11.7 us at 256 keys and a
  speculative step 1.93 against 1.70 ms: ``benchmarks/results/exact_mode/``, 77aee99).
* **One tile shape, or tiles that agree.** Every launch for a model uses the same ``BLOCK_M`` x
  ``BLOCK_N`` tiles and warps (``BLOCK_M`` widened to the query heads of a KV head where they are
  more), except that a step of prompt-sized runs without a tree takes ``WIDE_TILE`` where
  ``wide_tile_ok`` found that it gives every row the narrow tile's bits on this GPU: a row's
  scores, its sum of weights and its weighted values are all matrix products, which the matrix
  instructions add in K order whatever the row tile (the projections' evidence,
  ``benchmarks/row_tile_bits.py``), and its maximum is exact in any order.

A ragged step (``meta.ragged``: a graphed prompt step, causal chunks of any lengths) takes the
fold launch with the fast kernel's grid, fixed by the step's capacity of tokens
(``attention_triton._program_tile``); a row's arithmetic, and so its bits, are those of any launch.

Visibility is positional: a query sees the keys at positions up to its own (its ancestors in a
tree). Outside a tree, a token's KV index must equal its position, as every causal step here
lays it out.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch
import triton
import triton.language as tl

from kernels.attention import unpack_mask
from kernels.attention_triton import _DOT_DTYPES, LOG2E, _program_tile, _query_tile, _sm_count
from kernels.metadata import AttentionMetadata
from kernels.pdl import PDL_ALL, dependent, launch_options, small_launch

log = logging.getLogger(__name__)


def _env_count(name: str, default: int, unit: str) -> int:
    """A setting of this module from the environment (read at import): a count of ``unit``, at least 0."""
    text = os.environ.get(name, str(default))
    if not text.isdigit():
        raise ValueError(f"{name}={text!r}: {unit}, a whole number at least 0")
    return int(text)

# Query rows per program (tokens x the query heads sharing a KV head), at least the group of query
# heads: a function of the model alone. 16 (H200, 52a76bf, decode_baseline.py --exact-attention-rows
# 16): the 8B batch-64 step at 4K 14.132 ms against 16.659 with 64 rows, batch 1 5.276 against
# 5.409; compiled for sm_90, the tree variant holds 168 registers and no spill against 255 and spills.
BLOCK_M = 16
BLOCK_N = 64  # keys per tile
CHUNK = 512  # keys per fold chunk by default: a multiple of BLOCK_N (kernels.exact_set.fold_chunk picks a model's)
# The fold kernel reads a token's chunks one at a time, each chunk's loads after the last one's fold.
# Tried and dropped (speed only, the same bits): a software-pipelined loop (three stages through shared
# memory: the 8B's 32K decode step 5.547 -> 5.814 ms, attention/combine_one_shot_h200/) and chunks read
# 2, 4 or 8 at a time as straight-line code (the 8B's exact 32K step 5.51 -> 5.66 / 5.90 / 5.75 ms,
# SmolLM2's 0.681 -> 0.689 / 0.706 / 0.696; exact_mode/tried/fold_blocks_h200_61e360a/).
SPLIT_BYTES = 256 * 2**20  # the most the split mode's float32 partials may take
NUM_WARPS = 4
NUM_STAGES = 3  # the next key tile's copies in flight while a tile is computed (kernel_resources.py --exact)
MODES = ("auto", "fold", "split")
TILES = ("auto", "narrow", "wide", "tree")

# A prefill-sized step's tile (rows, warps, stages), where ``wide_tile_ok``: the 16-row tile reads
# every key tile for four tokens of the 8B's query groups and made its 4K-token prefill chunks' attention
# 4.4x the fast kernel's (H200, eaa4349, ``profile_step.py llama3-8b --prefill --exact``: 210.6
# against 47.8 ms for three chunks). At four warps the 64-row tile's running and chunk accumulators
# spill (255 registers, 288 stack bytes); at eight they fit (228 registers with the row sums as
# products, none spilled: ``kernel_resources.py --exact --causal --one-split --config 64,64,8,3``,
# sm_90, ad377b5). With it and the row sums as products (H200, 503dc1b, the same profile): 126.5 ms.
WIDE_TILE = (64, 8, 3)
WIDE_QUERY_LEN = 64  # a step without a tree whose longest run of new tokens is at least this long takes it
WIDE_PROBE_TOKENS = 600  # the probe's prompt: across a 512-key chunk's end
_WIDE_OK: dict[tuple, bool] = {}  # (device, dtype, query heads a KV head, head_dim, tile) -> the probe's verdict


def tile_shape(tile: str) -> tuple[int, int, int]:
    """(rows, warps, stages) of a named tile: ``narrow`` (every step's), ``wide`` (prompt-sized
    steps, ``WIDE_TILE``), ``tree`` (a tree step's whole-chunk programs: ``TREE_WIDE_ROWS`` rows on
    the narrow tile's warps and stages)."""
    return {"narrow": (BLOCK_M, NUM_WARPS, NUM_STAGES), "wide": WIDE_TILE,
            "tree": (TREE_WIDE_ROWS, NUM_WARPS, NUM_STAGES)}[tile]


def probe_wide_tile(device: torch.device, dtype: torch.dtype, group: int, head_dim: int,
                    chunk: int | None = None, tile: str = "wide") -> bool:
    """Whether the ``tile`` (``wide`` or ``tree``, ``tile_shape``) gives every query row the bits of
    the narrow tile on this device and dtype, for a KV head of ``group`` query heads of
    ``head_dim``: one random prompt of ``WIDE_PROBE_TOKENS`` tokens (more where a chunk and the tree
    steps below need them) attended in one launch on each tile, compared bit for bit, and for ``tree``
    also two tree steps over that prompt (its last positions as a chain: one wide tile's tokens, then
    two tiles', the two shapes of ``nested_tile``) in the split launch, whose whole-chunk programs take
    the wide rows (``_shared_chunks``, ``_tile_seen`` where ``OPEN_TILES``) or the narrow tiles. The
    narrow tile's rows do not depend on the step, so equal bits here make the other tile's rows those
    of any step. Kept for the device, dtype, geometry and tile. Not inside a CUDA graph's capture."""
    assert tile in ("wide", "tree"), tile
    gen = torch.Generator().manual_seed(2)
    chains = probe_tree_tokens(group) if tile == "tree" else ()
    n = max(WIDE_PROBE_TOKENS, (chunk or CHUNK) + BLOCK_N + max(chains)) if chains else WIDE_PROBE_TOKENS  # (a whole chunk before a tree)
    blocks, size = triton.cdiv(n, 16), 16
    k, v = (torch.randn(blocks, size, 1, head_dim, generator=gen).to(device, dtype) for _ in range(2))
    q = torch.randn(n, group, head_dim, generator=gen).to(device, dtype)

    def ints(values) -> torch.Tensor:
        return torch.as_tensor(values, dtype=torch.int64, device=device)

    meta = AttentionMetadata(query_start_loc=ints([0, n]), seq_lens=ints([n]), block_tables=ints([list(range(blocks))]),
                             slot_mapping=ints(range(n)), positions=ints(range(n)), token_seq=ints([0] * n),
                             token_q_idx=ints(range(n)), max_query_len=n, max_seq_len=n)
    scale = head_dim ** -0.5
    outs = [paged_attention_exact(q, k, v, meta, scale, "fold", chunk, tile=t) for t in ("narrow", tile)]
    same = torch.equal(*outs)
    for t in chains:
        if not same:
            break
        first = n - t
        chain = torch.tril(torch.ones(t, t, dtype=torch.bool, device=device))
        tree = AttentionMetadata(query_start_loc=ints([0, t]), seq_lens=ints([n]), block_tables=meta.block_tables,
                                 slot_mapping=ints(range(first, n)), positions=ints(range(first, n)),
                                 token_seq=ints([0] * t), token_q_idx=ints(range(t)), max_query_len=t, max_seq_len=n,
                                 custom_mask=ancestor_table(chain), mask_start=ints([first]))
        outs = [paged_attention_exact(q[first:], k, v, tree, scale, "split", chunk, tile=x) for x in ("narrow", tile)]
        same = torch.equal(*outs)
    _WIDE_OK[(q.device, dtype, group, head_dim, tile)] = same  # (the tensor's device: "cuda" names cuda:0 there)
    if not same:
        log.warning("the batch-invariant attention's %d-row %s tile changes a row's bits on %s (%s, %s): %s keep "
                    "the %d-row tile there (slower, as invariant)", tile_shape(tile)[0], tile, device,
                    torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "cpu", dtype,
                    "prefill steps" if tile == "wide" else "trees' whole-chunk programs", BLOCK_M)
    return same


def probe_tree_tokens(group: int) -> tuple[int, int]:
    """The tree probe's chains for a KV head of ``group`` query heads: the tokens of one wide tile
    (``TREE_WIDE_ROWS`` rows: two stages of copies, ``nested_tile``) and of two (the steps of more)."""
    wide = max(1, TREE_WIDE_ROWS // max(BLOCK_M, triton.next_power_of_2(group))) * narrow_tokens(group)
    return wide, 2 * wide


def narrow_tokens(group: int) -> int:
    """Tokens of a KV head's ``group`` query heads that one narrow query tile holds (at least one)."""
    return max(BLOCK_M, triton.next_power_of_2(group)) // group


def one_tile_tree(meta: AttentionMetadata, group: int) -> bool:
    """Whether a tree step's sequences each fit one narrow query tile (``ONE_TILE_TREES``): such a step
    takes the one-token step's launch shape and a tile a whole-chunk program."""
    return bool(ONE_TILE_TREES) and meta.max_query_len <= narrow_tokens(group)


def few_tree(meta: AttentionMetadata, group: int | None = None) -> bool:
    """Whether a tree step is small enough (at most ``TREE_FEW_TOKENS`` tokens a sequence, or, given
    the KV head's ``group`` of query heads, one narrow query tile a sequence: ``one_tile_tree``) to
    take a one-token step's launch shape: the narrow tile, ``SPLIT_PROGRAMS_PER_SM`` programs an SM."""
    return meta.max_query_len <= TREE_FEW_TOKENS or (group is not None and one_tile_tree(meta, group))


def tree_wide_wanted(max_seq_len: int, chunk: int | None = None, tokens: int | None = None,
                     group: int = 1) -> bool:
    """Whether a tree step over at most ``max_seq_len`` keys, folded in chunks of ``chunk`` keys
    (default ``CHUNK``), asks for the wide rows (``TREE_WIDE``): over ``TREE_WIDE_MIN_KEYS`` keys or
    more, or over fewer on chunks of ``TREE_WIDE_ANY_CHUNK`` keys or more where its ``tokens`` a
    sequence (None: any) fill more than the ``TREE_TILES`` narrow query tiles of one whole-chunk
    program for a KV head of ``group`` query heads. ``wide_tile_ok(..., "tree")`` then says whether
    it gets them."""
    chunk = chunk or CHUNK
    past_tiles = tokens is None or tokens > TREE_TILES * narrow_tokens(group)
    return TREE_WIDE and (max_seq_len >= TREE_WIDE_MIN_KEYS or 0 < TREE_WIDE_ANY_CHUNK <= chunk and past_tiles)


def wide_tile_ok(q: torch.Tensor, group: int, chunk: int | None = None, tile: str = "wide") -> bool:
    """Whether steps of these queries may take the ``tile`` (``wide``: prefill-sized steps; ``tree``:
    a tree's whole-chunk programs): on a GPU where the probe found that it agrees with the narrow
    tile (probed here at first use when the engine did not probe at start-up); never in Triton's
    interpreter, whose dots are no matrix instructions."""
    if not q.is_cuda:
        return False
    key = (q.device, q.dtype, group, q.shape[-1], tile)
    if key not in _WIDE_OK:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"the batch-invariant attention's tile probe has not run for {key}: run "
                               "kernels.attention_exact.probe_wide_tile before capturing graphs")
        probe_wide_tile(q.device, q.dtype, group, q.shape[-1], chunk, tile)
    return _WIDE_OK[key]


def ancestor_table(mask: torch.Tensor) -> torch.Tensor:
    """bool [T, cols] ancestor mask -> int32 [T, cols]: entry [t, d] is the mask column of token t's
    ancestor at depth d (its d-th visible column, in column order; the token itself last), -1 past
    its own depth. Fixed shapes, no host sync."""
    T, cols = mask.shape
    rank = torch.where(mask, mask.to(torch.int64).cumsum(1) - 1, cols)  # invisible columns -> a spare column
    table = torch.full((T, cols + 1), -1, dtype=torch.int32, device=mask.device)
    col = torch.arange(cols, dtype=torch.int32, device=mask.device).expand(T, cols)
    table.scatter_(1, rank, col)  # distinct targets among visible columns
    return table[:, :cols].contiguous()


# How a tree step's ancestor table is built (``EAGLE3_EXACT_TABLE``, read at import): ``triton`` (the
# default), one kernel from the packed words (``ancestor_table_triton``) on CUDA, or ``torch``, the ops
# above (the packed mask unpacked, a cumulative sum, a scatter: about 14 small launches). Speed only:
# the same table. On an H200 (61e360a, exact_mode/table_kernel_h200_61e360a/; SmolLM2's chained tree
# step, ``profile_spec_step.py smollm2 --exact --timeline``, three processes each) the device's busy
# time a step went 1.4347 / 1.4348 / 1.4367 -> 1.4322 / 1.4323 / 1.4339 ms and the host's time outside
# the wait for the step's tokens 0.48-0.75 -> 0.37-0.59 ms; the step itself, device-bound, stayed at
# 1.465-1.476 ms (``switch_ab.py --script replay``: 1.671 / 1.672 against 1.667-1.699 ms).
TABLE_BUILDER = os.environ.get("EAGLE3_EXACT_TABLE", "triton")
assert TABLE_BUILDER in ("torch", "triton"), "EAGLE3_EXACT_TABLE: torch or triton"


def prepare_attention_exact(meta: AttentionMetadata) -> AttentionMetadata:
    """Per-step work shared by every layer: the ancestor mask (bool, or packed words) becomes the
    per-depth table."""
    mask = meta.custom_mask
    if mask is None:
        return meta
    if TABLE_BUILDER == "triton" and mask.dtype == torch.int32 and mask.is_cuda:
        return dataclasses.replace(meta, custom_mask=ancestor_table_triton(mask))
    mask = unpack_mask(mask) if mask.dtype == torch.int32 else mask
    return dataclasses.replace(meta, custom_mask=ancestor_table(mask))


def ancestor_table_triton(words: torch.Tensor) -> torch.Tensor:
    """``ancestor_table(unpack_mask(words))`` in one launch: packed ancestor masks, int32 [T, W] (bit j
    of word w: column 32 w + j) -> int32 [T, 32 W], entry [t, d] the column of row t's d-th visible
    column, -1 past its last."""
    T, W = words.shape
    out = torch.empty(T, 32 * W, dtype=torch.int32, device=words.device)
    if T and W:
        _ancestor_table_kernel[(T,)](words, out, words.stride(0), out.stride(0), 32 * W,
                                     COLS=triton.next_power_of_2(32 * W), **small_launch(words))
    return out


@triton.jit(do_not_specialize=["stride_w", "stride_o", "cols"])
def _ancestor_table_kernel(words_ptr, out_ptr, stride_w, stride_o, cols, COLS: tl.constexpr, USE_GDC: tl.constexpr):
    """One row: its visible columns' ranks (a cumulative sum), each visible column stored at its
    rank and -1 from the row's count on (the two stores' targets are disjoint)."""
    if USE_GDC:  # launched dependent (kernels/pdl.py): wait before any load, store or return
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, COLS)
    in_row = col < cols
    word = tl.load(words_ptr + t * stride_w + col // 32, mask=in_row, other=0)
    visible = (((word >> (col % 32)) & 1) != 0) & in_row
    ones = visible.to(tl.int32)
    rank = tl.cumsum(ones, 0) - 1
    count = tl.sum(ones, 0)
    tl.store(out_ptr + t * stride_o + rank, col, mask=visible)
    tl.store(out_ptr + t * stride_o + col, tl.full([COLS], -1, tl.int32), mask=in_row & (col >= count))


# How ``auto`` picks the launch shape (speed only: both give the same bits). ``"few"``: split when
# the fold launch has fewer than two programs an SM (measured with 64-row tiles). ``"waves"``: also
# split when the fold launch would fill its last wave of the device's program slots below
# ``WAVE_FILL`` (8B geometry, batch 64, 4K: 512 programs on 396 slots, a second wave two-thirds
# empty), as the fast kernel sizes its key splits to fill one wave. ``PROGRAMS_PER_SM``: what one
# SM holds of the 16 x 64 tiles with 3 stages (kernel_resources.py --exact, sm_90, head_dim 128:
# 162 registers, 70 KB of shared memory: 3 by either). To be measured on a GPU
# (``decode_baseline.py --exact --exact-split-rule waves``) before it is the default.
SPLIT_RULE = "few"
PROGRAMS_PER_SM = 3
WAVE_FILL = 0.75
# The split launch's programs for the chunks, about this many an SM over the step's (query tile, KV
# head) pairs, each walking every chunk_programs-th chunk (``chunk_programs``); 0: one program per
# chunk of ``meta.max_seq_len`` (in a graph, of the cache's capacity: SmolLM2 at batch 64 launched
# 12,288 programs for about 1,000 chunks holding keys). ``EAGLE3_EXACT_SPLIT_PROGRAMS``, read at
# import. Speed only: a chunk's partials are the same whichever program computes them.
SPLIT_PROGRAMS_PER_SM = _env_count("EAGLE3_EXACT_SPLIT_PROGRAMS", 4, "programs an SM, 0 for one a chunk")
# The same for a tree step, whose whole-chunk programs share the GPU with one program a token for
# its tree chunks (``EAGLE3_EXACT_TREE_SPLIT_PROGRAMS``, read at import). 1 (H200, a541014, SmolLM2's
# 60-token tree at a capacity of 8,192, ``attention_kernel.py --exact-tree-split-programs``): at 128 /
# 256 / 384 / 512 / 1,024 keys 9.8 / 10.5 / 13.4 / 14.8 / 15.8 us against 10.8 / 11.5 / 13.8 / 14.5 /
# 17.2 with 4; MT-bench at batch 1 (one round, exact_mode/tree_split_programs_h200_a541014/) 2,824.9
# against 2,725.7 speculative tok/s.
TREE_SPLIT_PROGRAMS_PER_SM = _env_count("EAGLE3_EXACT_TREE_SPLIT_PROGRAMS", 1, "programs an SM, 0 for one a chunk")
# Query tiles a whole-chunk program of a tree step's split launch takes at once (``EAGLE3_EXACT_TREE_TILES``,
# read at import): 2 loads each key tile of the chunks before the tree's once for two 16-row tiles, each
# attending it with its own dots and state (``_shared_chunks``: a row's arithmetic is the one tile's, so
# are its bits), where 1 has a program a tile, each loading the key tile. Speed only. Measured on the
# H200 (60-token tree, benchmarks/attention_kernel.py --exact-tree-tiles): 2 against 1 took 35.8 against
# 39.9 us at SmolLM2's 4,096 keys and 72.5 against 80.5 at the 8B's, the same from 128 to 1,024 keys;
# 4 tiles (tried) spilled registers and lost everywhere (40.2 and 81.6 us).
TREE_TILES = int(os.environ.get("EAGLE3_EXACT_TREE_TILES", "2"))
assert TREE_TILES in (1, 2), "EAGLE3_EXACT_TREE_TILES: 1 or 2"
# A tree step's whole-chunk programs may instead take one tile of ``TREE_WIDE_ROWS`` rows (the query
# tiles of ``TREE_WIDE_ROWS // BLOCK_M`` narrow ones) on the narrow tiles' warps and stages, where
# ``wide_tile_ok(..., "tree")`` found that such a tile gives every row the narrow tile's bits on this
# GPU. Narrow tiles make a tree over a long prefix read each key tile once for every 32 rows: on an
# H200 a 64-token tree over 32K keys of the 8B took 453.6 us a layer, against 107.3 for the fast
# kernel's 64-row tiles (``attention_kernel.py --context 32768 --tokens 64 --exact --sweep
# --l2-flush 200``). ``EAGLE3_EXACT_TREE_WIDE`` (read at import): 0 keeps the narrow tiles. Speed
# only, as ``TREE_TILES``: a row's partials are the narrow tile's bits where the probe says so.
TREE_WIDE = os.environ.get("EAGLE3_EXACT_TREE_WIDE", "1") != "0"
TREE_WIDE_ROWS = 64
# ... for a launch over at least this many keys (``meta.max_seq_len``: in a graph the cache's
# capacity; ``EAGLE3_EXACT_TREE_WIDE_MIN_KEYS``, read at import). On the H200 (``attention_kernel.py --exact --exact-tree-wide 0``, keys from HBM) the
# 8B's 64-token tree took 329 against 456 us at 32K keys and 69 against 72 at 4K (capacity 32K);
# SmolLM2's 60-token tree (capacity 8,192, 128-key chunks) 20.8 against 22.2 us at 2,048 keys but
# 14.8 against 12.6 at 512, where fewer programs share the prefix's few chunks.
TREE_WIDE_MIN_KEYS = _env_count("EAGLE3_EXACT_TREE_WIDE_MIN_KEYS", 16384, "keys")
# ... or over any number of keys where the fold chunk is at least ``TREE_WIDE_ANY_CHUNK`` keys
# (``EAGLE3_EXACT_TREE_WIDE_ANY_CHUNK``, read at import; 0: never). Since the wide rows walk a loop a
# chunk (``TREE_NESTED``), a chunk of eight key tiles or more keeps them ahead below 16K keys too. On
# one H200 (``attention_kernel.py --capacity 4400 --exact --exact-settings TREE_WIDE_MIN_KEYS=0
# --l2-flush 200``, cbf07fc, ``benchmarks/results/exact_mode/tree_wide_short_h200_cbf07fc/``) the 8B's
# trees (512-key chunks) over 4,096 keys took 30.0 / 51.2 / 71.8 -> 29.1 / 32.5 / 45.9 us for 16 / 32 /
# 60 tokens (8 tokens 24.6 -> 27.5), over 8,000 and 12,000 keys (capacity 12,400) 129.3 -> 87.8 and
# 176.6 -> 105.0 us for 60 tokens; SmolLM2's (128-key chunks, capacity 8,192) lost at 300 and 512 keys
# (60 tokens 11.3 -> 11.8 and 12.8 -> 13.5 us, 16 tokens 9.7 -> 11.1), so its chunks keep the
# narrow tiles there. The 8B's replayed 60-token tree at 4K (batch 1, ``switch_ab.py --script replay
# ... --case 4096:1 --config dynamic:7:10:59 --exact``): 8.857 / 8.891 -> 8.155 / 8.146 ms a step.
# Below ``TREE_WIDE_MIN_KEYS`` a tree that one narrow whole-chunk program holds (``TREE_TILES`` tiles:
# the 8B's 8 tokens) keeps the narrow tiles: at 4K keys batch 1 / 4 / 16, 24.6 / 50.2 / 162.2 us
# narrow against 27.5 / 52.6 / 179.5 wide (over 32K keys the wide rows win there too: 87.6 against 92.3).
TREE_WIDE_ANY_CHUNK = _env_count("EAGLE3_EXACT_TREE_WIDE_ANY_CHUNK", 512, "keys, 0 for never")
# The wide tiles' whole-chunk programs, about this many an SM over the step's (wide tile, KV head)
# pairs (``chunk_programs``; ``EAGLE3_EXACT_TREE_WIDE_PROGRAMS``, read at import). 2 (the 8B's
# 64-token tree, capacity 32K): at 32K keys 1 / 2 / 3 / 4 took 380 / 329 / 303 / 293 us, at 4K
# 67.6 / 69.3 / 74.7 / 75.5 us.
TREE_WIDE_PROGRAMS_PER_SM = _env_count("EAGLE3_EXACT_TREE_WIDE_PROGRAMS", 2, "programs an SM, 0 for one a chunk")
# ... rounded down to whole programs a (wide tile, KV head) pair rather than up (``EAGLE3_EXACT_TREE_WIDE_FLOOR=1``,
# read at import; ``chunk_programs(..., floor=True)``): the 8B's 64-token tree over 32K keys has 32 pairs,
# and 2 an SM rounded up is 9 programs a pair, 288 of 132 SMs that hold one each: three waves, the last
# a sixth full; rounded down, 8 (256: two). Across 1 / 2 / 3 / 4 programs an SM (rounded up) that tree's
# attention took 380 / 329 / 303 / 293 us a layer, about 68 us plus 1.5 us for each key tile on an SM's
# longest run of programs, which rounding down shortens. Speed only (a chunk's partials are the same
# whichever program computes them). On (1) by default: on one H200 (``attention_kernel.py --exact
# --exact-settings TREE_WIDE_FLOOR=1``, 1 against 0) the 8B's trees over 32K keys took 147 / 160 / 282 us
# against 167 / 176 / 327 for 17 / 32 / 64 tokens, 4K and batch 4 at 16K within 1%.
TREE_WIDE_FLOOR = _env_count("EAGLE3_EXACT_TREE_WIDE_FLOOR", 1, "0 or 1")
if TREE_WIDE_FLOOR > 1:
    raise ValueError(f"EAGLE3_EXACT_TREE_WIDE_FLOOR={TREE_WIDE_FLOOR}: 0 or 1")
# A tree step's wide rows (``TREE_WIDE``) walk their whole chunks' key tiles in a loop a chunk inside
# a loop over the chunks, on ``NESTED_STAGES`` stages of copies (1, the default), or in one loop over
# all the tiles on the launch's stages (``EAGLE3_EXACT_TREE_NESTED=0``, read at import). One loop
# keeps the next tiles' copies in flight across a chunk's end, but stores a chunk's partials inside
# the loop while the copies' buffers are live: the store's layout conversion takes 32 KB of shared
# memory of its own. Compiled for sm_90 (Triton 3.9, ``benchmarks/kernel_resources.py --exact
# --tree-wide [--nested] --config 16,64,4,S``, the 8B geometry) the one loop holds 149.5 KB at 3
# stages (one program an SM), a loop a chunk 84.0 KB at 2 (255 registers: two an SM). Speed only
# (the same ``_tile`` steps in the same order, the same partials). Measured on one H200
# (``attention_kernel.py --exact --exact-settings TREE_NESTED=1``, dfc63b6,
# ``benchmarks/results/exact_mode/tree_nested_h200_dfc63b6/``): the 8B's trees of 16 / 32 / 64 tokens
# over 32K keys 95.7 / 162.0 / 284.5 -> 85.8 / 129.9 / 216.9 us a layer, at 16K 57.4 / 93.9 / 165.4 ->
# 50.4 / 72.4 / 120.6, at 4K 29.0 / 45.7 / 69.9 -> 30.6 / 32.6 / 45.8; at 3 stages (one program an SM)
# 100.8 / 171.8 / 307.1 at 32K: the second program is the gain.
TREE_NESTED = _env_count("EAGLE3_EXACT_TREE_NESTED", 1, "0 or 1")
if TREE_NESTED > 1:
    raise ValueError(f"EAGLE3_EXACT_TREE_NESTED={TREE_NESTED}: 0 or 1")
NESTED_STAGES = 2
# ... on ``NESTED_MANY_STAGES`` stages (``EAGLE3_EXACT_NESTED_MANY_STAGES``, read at import) where a
# sequence's tree fills more than one wide tile (the 8B: more than 16 tokens), with ``ROWSUM_COLS``
# columns of ones in the row sums' product (``_tile_seen``; ``EAGLE3_EXACT_ROWSUM_COLS``, 8 or 16): at
# 16 the ones' 2 KB took the loop's three stages 1 KB past two programs an SM (116,736 bytes of
# shared memory), at 8 they fit (115,712; sm_90 offline, ``kernel_resources.py --exact --tree-wide
# --nested``). Every column of the product is the row's sum, so the bits are the same (the start-up
# probe compares both shapes against the narrow tiles, and the tests). On one H200 (``attention_kernel.py
# --context 32768 --context 16384 --context 4396 --tokens 8 ... --tokens 64 --capacity 32768
# --tree-depth 7 --exact --exact-settings ROWSUM_COLS=8,NESTED_STAGES=3 --l2-flush 200``,
# ``benchmarks/results/exact_mode/nested_three_stages_h200/``, the same bits) the 8B's trees over 32K
# keys of 24 / 32 / 48 / 64 tokens took 112.3 / 117.7 / 155.7 / 193.6 -> 105.6 / 108.5 / 142.6 / 176.1
# us a layer, over 16K 64.7 / 66.3 / 89.4 / 108.8 -> 63.0 / 64.6 / 83.1 / 104.0; 8 and 16 tokens (one
# wide tile) lost (32K: 65.8 / 80.4 -> 72.0 / 81.1), so they keep two stages and 16 columns. The
# replayed 60-token tree's step (``switch_ab.py --script replay``, exact): 32K batch 1 12.936 -> 12.373
# ms, 16K batch 4 26.033 -> 24.500. Speed only.
NESTED_MANY_STAGES = _env_count("EAGLE3_EXACT_NESTED_MANY_STAGES", 3, "stages of copies")
# A tree's whole-chunk programs on the wide rows (``TREE_WIDE``) attend their key tiles without
# ``_tile``'s visibility and activity selects (``_tile_seen``: every row there sees every key), or with
# them (``EAGLE3_EXACT_OPEN_TILES=0``, read at import). Speed only: the same bits (tested). On one H200
# (``attention_kernel.py --context 32768 --context 16384 --context 4396 --tokens 16 --tokens 32 --tokens
# 64 --capacity 32768 --tree-depth 7 --exact --exact-settings OPEN_TILES=0 --l2-flush 200``,
# ``benchmarks/results/exact_mode/open_tiles_h200/``; the same bits) the 8B's trees of 16 / 32 / 64
# tokens took 85.6 / 128.9 / 214.6 -> 79.8 / 116.8 / 193.5 us a layer over 32K keys, 50.4 / 71.9 /
# 120.1 -> 45.9 / 66.0 / 108.2 over 16K and 30.3 / 41.8 / 61.6 -> 27.9 / 41.0 / 58.9 over 4,396. On
# the narrow tiles, two at a time, it was mixed (SmolLM2's 16-token tree over 2,048 keys 10.9 -> 12.1
# us, its 60-token tree over 4,096 29.8 -> 28.2), so they keep the selects.
OPEN_TILES = _env_count("EAGLE3_EXACT_OPEN_TILES", 1, "0 or 1")
if OPEN_TILES > 1:
    raise ValueError(f"EAGLE3_EXACT_OPEN_TILES={OPEN_TILES}: 0 or 1")
# Columns of ones in the open tiles' row-sum product for trees of more than one wide tile a sequence
# (``NESTED_MANY_STAGES`` above; ``EAGLE3_EXACT_ROWSUM_COLS``, read at import): 8, or 16 as ``_tile``.
ROWSUM_COLS = _env_count("EAGLE3_EXACT_ROWSUM_COLS", 8, "8 or 16")
if ROWSUM_COLS not in (8, 16):
    raise ValueError(f"EAGLE3_EXACT_ROWSUM_COLS={ROWSUM_COLS}: 8 or 16")
# A tree step of at most this many tokens a sequence takes a one-token step's launch shape: the
# narrow tile, whose tree launch holds two programs an SM (sm_90: 234 registers, 81.9 KB of shared
# memory; the wide rows' one, 255 and 149.5 KB), and ``SPLIT_PROGRAMS_PER_SM`` programs an SM for
# its chunks (a program a chunk or two over a long prefix). The calibrated exact forward of the 8B
# over 32K keys took 8.74 / 8.92 / 9.14 ms for trees of 1 / 4 / 8 nodes against 5.65 for one token
# (H200, fba4dd1, ``replay_gates_h200_fba4dd1_adaptive_diag.json``): a cost that does not grow with
# the tree, the wide rows' programs (33 a KV head, two chunks each, one an SM) rather than its
# tokens. ``EAGLE3_EXACT_TREE_FEW_TOKENS`` (read at import); 0, the default (mixed where measured:
# ``attention_kernel.py --exact-settings TREE_FEW_TOKENS=9``), keeps trees of more than one query
# tile on the tree launch shapes (``ONE_TILE_TREES`` below says what one tile's take). Speed only: a
# row's partials are the narrow tile's either way.
TREE_FEW_TOKENS = _env_count("EAGLE3_EXACT_TREE_FEW_TOKENS", 0, "tokens a sequence, 0 for none")
# A tree step whose sequences each fit one narrow query tile (the 8B's four query heads a KV head: up to
# four tokens; SmolLM2's three: five) takes the one-token step's launch shape (as ``TREE_FEW_TOKENS``)
# with one query tile a whole-chunk program (``TREE_TILES`` 1: two would attend every key tile for an
# empty second tile too). On an H200 (``attention_kernel.py --context 4096 --context 32768 --tokens 1
# --tokens 4 --tokens 8 --capacity 32768 --exact --exact-settings TREE_FEW_TOKENS=8,TREE_TILES=1
# --l2-flush 200``, edab1f2; ``exact_mode/one_tile_trees_h200/``) the 8B's 4-token tree took 59.6
# against 78.1 us at 32K keys and 19.7 against 20.7 at 4K (one token: 51.8 and 17.0); 8 tokens (two
# tiles) lost with one tile a program (86.4 against 81.4 at 32K), so the rule stops at one tile.
# ``EAGLE3_EXACT_ONE_TILE_TREES=0`` (read at import) keeps such trees on the tree launch shapes. Speed
# only: a row's partials are the narrow tile's bits either way.
ONE_TILE_TREES = _env_count("EAGLE3_EXACT_ONE_TILE_TREES", 1, "0 or 1")
if ONE_TILE_TREES > 1:
    raise ValueError(f"EAGLE3_EXACT_ONE_TILE_TREES={ONE_TILE_TREES}: 0 or 1")
# A step without a tree walks a program's key tiles in one loop across its chunks (``_walk_chunks``)
# where a chunk holds at least this many tiles, else a loop a chunk (the same bits either way). On an
# H200 the one loop took 8B decode attention at batch 64 and 4K from 279.0 to 252.7 us (512-key
# chunks) but SmolLM2's at batch 64 and 512 from 18.6 to 19.0 us (128-key chunks: two tiles).
FLAT_TILES = 4


def nested_tile(many: bool) -> tuple[int, int]:
    """(stages of copies, columns of ones in the row sums) of a tree's wide rows walking a loop a chunk
    (``TREE_NESTED``): ``many``, where a sequence's tree fills more than one wide tile,
    ``NESTED_MANY_STAGES`` and ``ROWSUM_COLS``, else ``NESTED_STAGES`` and 16."""
    return (NESTED_MANY_STAGES, ROWSUM_COLS) if many else (NESTED_STAGES, 16)


def walks_flat(has_mask: bool, chunk: int) -> bool:
    """Whether a launch's programs walk their chunks' key tiles in one loop (``FLAT_TILES``)."""
    return not has_mask and chunk >= FLAT_TILES * BLOCK_N


def _sms(device: torch.device) -> int:
    """The device's SMs; 8 off the GPU (Triton's interpreter: a launch shape, not bits)."""
    return _sm_count(device) if device.type == "cuda" else 8


def chunk_programs(chunks: int, pairs: int, device: torch.device, per_sm: int | None = None,
                   tree: bool = False, floor: bool = False) -> int:
    """Programs of the split launch for ``chunks`` chunks of each of ``pairs`` (query tile, KV head)
    pairs: about ``per_sm`` (default ``SPLIT_PROGRAMS_PER_SM``, or ``TREE_SPLIT_PROGRAMS_PER_SM`` for a
    ``tree`` step) an SM in all, rounded up to whole programs a pair (``floor``: down), at least 1, at
    most ``chunks`` (``per_sm`` 0: ``chunks``). Host sizes only."""
    if per_sm is None:
        per_sm = TREE_SPLIT_PROGRAMS_PER_SM if tree else SPLIT_PROGRAMS_PER_SM
    if per_sm == 0:
        return chunks
    sms, pairs = _sms(device), max(pairs, 1)
    return max(1, min(chunks, (per_sm * sms) // pairs if floor else triton.cdiv(per_sm * sms, pairs)))


def _mode(meta: AttentionMetadata, T: int, heads: int, kvh: int, head_dim: int, q_tiles: int,
          device: torch.device, chunk: int, wide_tree: bool = False) -> bool:
    """True: one program per chunk and a fold kernel; False: each program folds its chunks itself
    (``SPLIT_RULE`` says when; a tree step that takes the wide rows always splits where its
    partials fit: only the split launch's whole-chunk programs share a key tile among a wide tile's
    rows, and the fold launch's 16-row programs read each key tile once for every 16 rows). A
    choice of speed only. Host sizes only."""
    chunks = triton.cdiv(max(meta.max_seq_len, 1), chunk)
    if chunks == 1 or chunks * T * heads * head_dim * 4 > SPLIT_BYTES:
        return False
    if wide_tree:
        return True
    sms = _sms(device)
    programs = meta.num_seqs * q_tiles * kvh
    if programs < 2 * sms:
        return True
    if SPLIT_RULE == "waves":
        slots = PROGRAMS_PER_SM * sms
        return programs / (triton.cdiv(programs, slots) * slots) < WAVE_FILL
    return False


def paged_attention_exact(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float, mode: str = "auto",
                          chunk: int | None = None, tile: str = "auto") -> torch.Tensor:
    """Attention of new queries [T, heads, head_dim] over their sequences' cached KV -> [T, heads, head_dim],
    each query's bits independent of the step around it.

    ``meta.custom_mask``, if any, must be the ancestor table (``prepare_attention_exact``).
    ``mode``: ``fold`` or ``split`` force a launch shape (tests); ``auto`` picks by size. ``chunk``:
    keys per fold chunk (default ``CHUNK``), a multiple of ``BLOCK_N``; the bits depend on it, so a
    server keeps one for its model (``kernels.exact_set.fold_chunk``). ``tile``: ``narrow`` (the
    ``BLOCK_M`` tile) or ``wide`` (``WIDE_TILE``) forces one (tests, the probe); ``auto`` takes the
    wide one for a step without a tree whose longest run of new tokens is at least
    ``WIDE_QUERY_LEN``, where ``wide_tile_ok``.
    """
    assert mode in MODES, mode
    assert tile in TILES, tile
    chunk = chunk or CHUNK
    assert chunk % BLOCK_N == 0, f"a fold chunk of {chunk} keys is not a multiple of {BLOCK_N}"
    T, H, D = q.shape
    _, block_size, kvh, _ = k_cache.shape
    g = H // kvh
    has_mask = meta.custom_mask is not None
    few = has_mask and few_tree(meta, g)
    one_tile = has_mask and one_tile_tree(meta, g)
    if tile == "auto":
        if has_mask:
            tile = "tree" if not few and tree_wide_wanted(meta.max_seq_len, chunk, meta.max_query_len, g) and \
                wide_tile_ok(q, g, chunk, "tree") else "narrow"
        else:
            tile = "wide" if meta.max_query_len >= WIDE_QUERY_LEN and wide_tile_ok(q, g, chunk) else "narrow"
    # a tree step's "tree" tile: its whole-chunk programs (split launch) take the wide rows, the rest
    # of the launch the narrow tile
    wide_tree = has_mask and tile == "tree"
    rows, warps, stages = tile_shape("narrow" if wide_tree else tile)
    block_m = max(rows, triton.next_power_of_2(g))
    block_q = block_m // g
    out = torch.empty_like(q)
    if T == 0:
        return out
    q_tiles = triton.cdiv(meta.max_query_len, block_q)
    if meta.ragged:
        assert not has_mask, "a ragged step is causal"
    # The split launch: no ragged step, and a masked step's gathered tiles within two chunks (they run
    # from the tile holding mask_start to the deepest position: at most BLOCK_N - 1 + max_query_len
    # positions).
    split_ok = (not has_mask or meta.max_query_len <= chunk) and not meta.ragged
    if mode == "split" and not split_ok:
        raise ValueError(f"the split launch takes masked steps of at most {chunk} tokens a sequence and no "
                         f"ragged step, not {meta.max_query_len} tokens{' (ragged)' if meta.ragged else ''}")
    wants_rows = wide_tree and TREE_WIDE_ROWS // block_m > 1  # (a group of query heads may fill the wide rows)
    split = (_mode(meta, T, H, kvh, D, q_tiles, q.device, chunk, wants_rows) and split_ok) if mode == "auto" \
        else mode == "split"
    chunks = triton.cdiv(max(meta.max_seq_len, 1), chunk) if split else 1
    if split:
        part_m = torch.empty(chunks, T, H, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(chunks, T, H, D, dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out  # never touched
    table = meta.custom_mask if has_mask else meta.seq_lens  # any tensor: never read without a mask
    mask_start = meta.mask_start if has_mask else meta.seq_lens
    # a tree's split launch: programs of whole chunks over TREE_TILES query tiles (a group), or over the
    # wide rows of TREE_WIDE_ROWS // block_m of them in one tile, then of the tree chunks one a token of
    # the group's tiles
    wide_rows = split and wants_rows
    nested = bool(TREE_NESTED) and wide_rows
    sub = (TREE_WIDE_ROWS // block_m if wide_rows else 1 if one_tile else TREE_TILES) if split and has_mask else 1
    q_groups = triton.cdiv(q_tiles, sub)
    sum_cols = 16
    if nested:
        stages, sum_cols = nested_tile(q_groups > 1)
    per_token = sub * block_q if split and has_mask else 0
    per_sm = TREE_WIDE_PROGRAMS_PER_SM if wide_rows else SPLIT_PROGRAMS_PER_SM if few else None
    walkers = chunk_programs(chunks, meta.num_seqs * q_groups * kvh, q.device, per_sm=per_sm, tree=has_mask,
                             floor=wide_rows and bool(TREE_WIDE_FLOOR)) if split else 1
    pdl = dependent(q, PDL_ALL)  # (speed only: the bits are the same either way)
    # A ragged step (a graphed prompt step): its programs find their chunk and tile from query_start_loc,
    # the grid fixed by the step's capacity of tokens (``attention_triton._program_tile``).
    programs = q_tiles + meta.num_seqs if meta.ragged else meta.num_seqs * q_groups
    _exact_attention_kernel[(programs, kvh, walkers + per_token)](
        q, k_cache, v_cache, out, part_m, part_l, part_acc, meta.query_start_loc, meta.seq_lens, meta.positions,
        meta.block_tables, table, mask_start, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
        table.stride(0) if has_mask else 0, table.shape[1] if has_mask else 0,
        part_m.stride(0) if split else 0, part_m.stride(1) if split else 0, part_acc.stride(0) if split else 0,
        part_acc.stride(1) if split else 0, part_acc.stride(2) if split else 0, q_groups, walkers, meta.num_seqs,
        G=g, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=BLOCK_N, CHUNK=chunk, HEAD_DIM=D, SUB=sub,
        SHARED_Q=block_q * sub if wide_rows else block_q, SHARED_M=block_m * sub if wide_rows else block_m,
        SHARED_TWO=not wide_rows,
        BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_SIZE=block_size, HAS_MASK=has_mask, SPLIT=split,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_DTYPE=tl.float32 if not q.is_cuda else _DOT_DTYPES.get(k_cache.dtype, tl.float32), USE_GDC=pdl,
        RAGGED=meta.ragged, BLOCK_B=triton.next_power_of_2(meta.num_seqs) if meta.ragged else 1,
        FLAT=walks_flat(has_mask, chunk), NESTED=nested, OPEN=sum_cols if wide_rows and OPEN_TILES else 0,
        num_warps=warps, num_stages=stages, **launch_options(pdl))
    if split:
        _fold_chunks_kernel[(T, H)](part_m, part_l, part_acc, out, meta.positions,
                                    part_m.stride(0), part_m.stride(1), part_acc.stride(0), part_acc.stride(1),
                                    part_acc.stride(2), out.stride(0), out.stride(1),
                                    CHUNK=chunk, HEAD_DIM=D, BLOCK_D=max(16, triton.next_power_of_2(D)), USE_GDC=pdl,
                                    **launch_options(pdl))
    return out


@triton.jit
def _fold(m, l, acc, m_c, l_c, acc_c):
    """Fold one chunk's online-softmax state into the running one (elementwise over rows; a chunk
    that saw nothing leaves it as it was). The one formula both launch shapes use."""
    m_new = tl.maximum(m, m_c)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp2(m - m_safe)
    b = tl.exp2(m_c - m_safe)
    take = l_c > 0.0
    return (tl.where(take, m_new, m), tl.where(take, l * a + l_c * b, l),
            tl.where(take[:, None], acc * a[:, None] + acc_c * b[:, None], acc))


@triton.jit
def _tile(acc, m_i, l_i, q, k, v, visible, active, scale_log2, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
          DOT_DTYPE: tl.constexpr):
    """One key tile's online-softmax step for the rows in ``active`` (the others keep their state).
    Scores stay raw; the running max is in scaled log2 units. A row's sum of the tile's weights is
    a matrix product with ones, as its weighted values are: the matrix instructions add a row's
    terms in K order whatever the row tile, where ``tl.sum``'s order follows the tile's layout
    (``WIDE_TILE`` relies on it), and the denominator sums the very rounded weights the numerator
    multiplies."""
    s = tl.dot(q.to(DOT_DTYPE), tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION)  # (M, N)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s * scale_log2 - m_safe[:, None]).to(DOT_DTYPE)
    alpha = tl.exp2(m_i - m_safe)
    ones = tl.full([BLOCK_N, 16], 1.0, DOT_DTYPE)
    l_new = l_i * alpha + tl.max(tl.dot(p, ones, input_precision=PRECISION), 1)  # (every column the row's sum)
    acc_new = acc * alpha[:, None] + tl.dot(p, v.to(DOT_DTYPE), input_precision=PRECISION)
    return (tl.where(active[:, None], acc_new, acc), tl.where(active, m_new, m_i), tl.where(active, l_new, l_i))


@triton.jit
def _tile_seen(acc, m_i, l_i, q, k, v, scale_log2, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
               DOT_DTYPE: tl.constexpr, SUM_COLS: tl.constexpr):
    """``_tile`` for rows that see every key of the tile: no visibility or activity selects. For such
    a row ``_tile`` keeps every score and takes its own new state, and its maximum is finite (so is
    this one's: a key tile's scores are), so the arithmetic, and the bits, are the same. Rows
    outside the step compute on their zero queries and are never stored. The row sums' product takes
    ``SUM_COLS`` columns of ones (``ROWSUM_COLS``): every column is the same sum."""
    s = tl.dot(q.to(DOT_DTYPE), tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION)  # (M, N)
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
    p = tl.exp2(s * scale_log2 - m_new[:, None]).to(DOT_DTYPE)
    alpha = tl.exp2(m_i - m_new)
    ones = tl.full([BLOCK_N, SUM_COLS], 1.0, DOT_DTYPE)
    l_new = l_i * alpha + tl.max(tl.dot(p, ones, input_precision=PRECISION), 1)  # (every column the row's sum)
    acc_new = acc * alpha[:, None] + tl.dot(p, v.to(DOT_DTYPE), input_precision=PRECISION)
    return acc_new, m_new, l_new


@triton.jit
def _whole_tile(acc, m_i, l_i, q, k, v, keys, pos, ok, start, scale_log2, BLOCK_N: tl.constexpr,
                PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr, OPEN: tl.constexpr):
    """A key tile of a tree's whole chunks (every key before each row's position) for a query tile's
    rows: ``_tile_seen`` (``OPEN``: its row sums' columns of ones), or ``_tile`` with its selects (0):
    the same bits."""
    if OPEN:
        return _tile_seen(acc, m_i, l_i, q, k, v, scale_log2, BLOCK_N, PRECISION, DOT_DTYPE, OPEN)
    return _tile(acc, m_i, l_i, q, k, v, (keys[None, :] <= pos[:, None]) & ok[:, None], ok & (pos >= start),
                 scale_log2, BLOCK_N, PRECISION, DOT_DTYPE)


@triton.jit
def _load_kv(k_cache_ptr, v_cache_ptr, tables_ptr, b, kv_idx, ok, kvh, d, d_ok, stride_bt, stride_kb, stride_ks,
             stride_kh, BLOCK_SIZE: tl.constexpr):
    """Keys and values (N, D) at per-sequence KV indices ``kv_idx`` (N,); zeros where not ``ok``."""
    block = tl.load(tables_ptr + b * stride_bt + kv_idx // BLOCK_SIZE, mask=ok, other=0)
    return _kv_in_blocks(k_cache_ptr, v_cache_ptr, block, kv_idx, ok, kvh, d, d_ok, stride_kb, stride_ks, stride_kh,
                         BLOCK_SIZE)


@triton.jit
def _kv_in_blocks(k_cache_ptr, v_cache_ptr, block, kv_idx, ok, kvh, d, d_ok, stride_kb, stride_ks, stride_kh,
                  BLOCK_SIZE: tl.constexpr):
    """``_load_kv`` with each index's cache block given (``block``, from the block table)."""
    addr = block.to(tl.int64) * stride_kb + (kv_idx % BLOCK_SIZE) * stride_ks + kvh * stride_kh
    ptrs = addr[:, None] + d[None, :]
    kv_ok = ok[:, None] & d_ok[None, :]
    return tl.load(k_cache_ptr + ptrs, mask=kv_ok, other=0.0), tl.load(v_cache_ptr + ptrs, mask=kv_ok, other=0.0)


@triton.jit
def _causal_tile(acc, m_i, l_i, q, pos, row_ok, block, start, limit, k_cache_ptr, v_cache_ptr, kvh, d, d_ok,
                 stride_kb, stride_ks, stride_kh, scale_log2, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """``_tile`` over the keys at positions [start, start + BLOCK_N) below ``limit``, each at its own
    position (``block``: their cache blocks), each row seeing those at or before its position."""
    keys = start + tl.arange(0, BLOCK_N)
    k, v = _kv_in_blocks(k_cache_ptr, v_cache_ptr, block, keys, keys < limit, kvh, d, d_ok, stride_kb, stride_ks,
                         stride_kh, BLOCK_SIZE)
    visible = (keys[None, :] <= pos[:, None]) & row_ok[:, None]
    return _tile(acc, m_i, l_i, q, k, v, visible, row_ok & (pos >= start), scale_log2, BLOCK_N, PRECISION, DOT_DTYPE)


@triton.jit
def _chunk(q, pos, row_ok, row_tok, j_lo, j_hi, lo, hi, b, t0, m_start, tail_start, k_cache_ptr, v_cache_ptr, tables_ptr,
           table_ptr, scale_log2, stride_bt, stride_kb, stride_ks, stride_kh, stride_tab, tab_cols, kvh, d, d_ok,
           BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
           BLOCK_SIZE: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Online softmax over the key tiles at positions [lo, hi) (whole tiles; lo a tile boundary):
    (m, l, acc) of this chunk for the rows in ``row_ok``; tree tiles gathered for tokens [j_lo, j_hi)."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    shared_end = tl.minimum(hi, tail_start)  # tiles whose every key sits at its own position
    # Each tile's block ids come from the iteration before, in registers, so that the pipeliner keeps
    # the next tile's key and value copies in flight (``attention_triton._attend_keys`` says why). The
    # order of the arithmetic is the same: the bits are.
    ahead = lo + tl.arange(0, BLOCK_N)
    ids = tl.load(tables_ptr + b * stride_bt + ahead // BLOCK_SIZE, mask=ahead < hi, other=0)
    for start in range(lo, shared_end, BLOCK_N):
        block = ids
        ahead = start + tl.arange(0, BLOCK_N) + BLOCK_N
        ids = tl.load(tables_ptr + b * stride_bt + ahead // BLOCK_SIZE, mask=ahead < hi, other=0)
        acc, m_i, l_i = _causal_tile(acc, m_i, l_i, q, pos, row_ok, block, start, hi, k_cache_ptr, v_cache_ptr, kvh, d,
                                     d_ok, stride_kb, stride_ks, stride_kh, scale_log2, BLOCK_N, BLOCK_SIZE, PRECISION,
                                     DOT_DTYPE)
    if HAS_MASK:
        # Tiles holding tree positions: one gather per token, each column the key at that position
        # on the token's own path (a prefix key, or its ancestor at depth position - m_start).
        for start in range(tl.maximum(lo, tail_start), hi, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            depth = keys - m_start
            for j in range(j_lo, j_hi):
                tok_rows = row_ok & (row_tok == j)
                t = t0 + j
                tok_pos = tl.max(tl.where(tok_rows, pos, -1), 0)  # -1: no such token in this tile
                in_tree = (depth >= 0) & (depth < tab_cols) & (keys <= tok_pos)
                anc = tl.load(table_ptr + t * stride_tab + tl.maximum(depth, 0), mask=in_tree, other=-1)
                ok = ((depth < 0) & (keys <= tok_pos)) | (in_tree & (anc >= 0))
                kv_idx = tl.where(depth < 0, keys, m_start + anc)
                k, v = _load_kv(k_cache_ptr, v_cache_ptr, tables_ptr, b, kv_idx, ok, kvh, d, d_ok, stride_bt,
                                stride_kb, stride_ks, stride_kh, BLOCK_SIZE)
                visible = ok[None, :] & tok_rows[:, None]
                acc, m_i, l_i = _tile(acc, m_i, l_i, q, k, v, visible, tok_rows & (pos >= start), scale_log2,
                                      BLOCK_N, PRECISION, DOT_DTYPE)
    return m_i, l_i, acc


@triton.jit
def _walk_chunks(q, pos, row_ok, first, stop, step, end, b, t, head, k_cache_ptr, v_cache_ptr, tables_ptr,
                 part_m_ptr, part_l_ptr, part_acc_ptr, scale_log2, stride_bt, stride_kb, stride_ks, stride_kh,
                 stride_mc, stride_mt, stride_ac, stride_at, stride_ah, kvh, d, d_ok, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 SPLIT: tl.constexpr, PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """A step without a tree: chunks first, first + step, ... before ``stop`` (each cut at ``end``) as
    one loop over their key tiles, so that the next tile's copies stay in flight across a chunk's
    end (a loop a chunk, ``_chunk``'s, drains the pipeline at each). A chunk's state starts afresh
    and at its last tile goes to the partials (``SPLIT``) or into the running state by ``_fold``:
    the very steps of ``_chunk`` then ``_fold`` or ``_store_partials``, the same bits. Returns the
    running state (``SPLIT``: untouched)."""
    TILES: tl.constexpr = CHUNK // BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m_c, l_c, acc_c = m_i, l_i, acc
    mine = tl.cdiv(stop - first, step)  # chunks this program walks; only its last can be cut short
    last_lo = (first + (mine - 1) * step) * CHUNK
    total = ((mine - 1) * TILES + tl.cdiv(tl.minimum(last_lo + CHUNK, end) - last_lo, BLOCK_N)).to(tl.int32)
    ahead = (first * CHUNK + tl.arange(0, BLOCK_N)).to(tl.int32)  # block ids an iteration ahead, as in ``_chunk``
    ids = tl.load(tables_ptr + b * stride_bt + ahead // BLOCK_SIZE, mask=ahead < end, other=0)
    for i in range(0, total):
        start = (first + (i // TILES) * step) * CHUNK + (i % TILES) * BLOCK_N
        block = ids
        nxt = i + 1
        ahead = ((first + (nxt // TILES) * step) * CHUNK + (nxt % TILES) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int32)
        ids = tl.load(tables_ptr + b * stride_bt + ahead // BLOCK_SIZE, mask=ahead < end, other=0)
        acc_c, m_c, l_c = _causal_tile(acc_c, m_c, l_c, q, pos, row_ok, block, start, end, k_cache_ptr, v_cache_ptr,
                                       kvh, d, d_ok, stride_kb, stride_ks, stride_kh, scale_log2, BLOCK_N, BLOCK_SIZE,
                                       PRECISION, DOT_DTYPE)
        if ((i % TILES) == TILES - 1) | (nxt == total):  # the chunk's last tile
            if SPLIT:
                _store_partials(part_m_ptr, part_l_ptr, part_acc_ptr, start // CHUNK, t, head, row_ok, d, d_ok, m_c,
                                l_c, acc_c, stride_mc, stride_mt, stride_ac, stride_at, stride_ah)
            else:
                m_i, l_i, acc = _fold(m_i, l_i, acc, m_c, l_c, acc_c)
            m_c = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_c = tl.zeros([BLOCK_M], tl.float32)
            acc_c = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    return m_i, l_i, acc


@triton.jit
def _store_partials(part_m_ptr, part_l_ptr, part_acc_ptr, c, t, head, row_ok, d, d_ok, m_c, l_c, acc_c, stride_mc,
                    stride_mt, stride_ac, stride_at, stride_ah):
    """One chunk's (m, l, acc) of a tile's rows into the split launch's partials [chunks, T, H(, D)]."""
    at = c * stride_mc + t * stride_mt + head
    tl.store(part_m_ptr + at, m_c, mask=row_ok)
    tl.store(part_l_ptr + at, l_c, mask=row_ok)
    tl.store(part_acc_ptr + c * stride_ac + t[:, None] * stride_at + head[:, None] * stride_ah + d[None, :],
             acc_c, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _shared_chunks(q_ptr, k_cache_ptr, v_cache_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, pos_ptr, tables_ptr, b,
                   pair, kvh, q_start, q_len, first, walkers, tail_start, scale_log2, stride_qt, stride_qh,
                   stride_kb, stride_ks, stride_kh, stride_bt, stride_mc, stride_mt, stride_ac, stride_at, stride_ah,
                   G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr, TWO: tl.constexpr, NESTED: tl.constexpr,
                   OPEN: tl.constexpr):
    """A tree step's whole-chunk program for query tiles 2 * pair and 2 * pair + 1 (``TWO``), or for
    the one tile ``pair`` of ``BLOCK_Q`` tokens in ``BLOCK_M`` rows (the caller's wide rows): chunks
    first, first + walkers, ... before the tree's first (every key at its own position, every row
    sees them all), each key tile loaded once and attended by the tiles in turn, each with the very
    ``_tile`` steps (dots of its own rows, its own state) that ``_chunk`` gives one tile: the same
    partials, bit for bit (for the wide rows, where ``wide_tile_ok(..., "tree")``)."""
    stop = tail_start // CHUNK  # (each row's position is past the tree's first tile)
    if first >= stop:  # (before any load: in a graph, sized by the cache's capacity, most programs stop here)
        return
    if TWO:
        tile0 = 2 * pair
    else:
        tile0 = pair
    _, h0, ok0, t0, d, d_ok, q0 = _query_tile(q_ptr, q_start, q_len, tile0, kvh, stride_qt, stride_qh,
                                              G, BLOCK_Q, BLOCK_M, BLOCK_D, HEAD_DIM)
    p0 = tl.load(pos_ptr + t0, mask=ok0, other=-1)
    if TWO:
        _, h1, ok1, t1, _, _, q1 = _query_tile(q_ptr, q_start, q_len, 2 * pair + 1, kvh, stride_qt, stride_qh,
                                               G, BLOCK_Q, BLOCK_M, BLOCK_D, HEAD_DIM)
        p1 = tl.load(pos_ptr + t1, mask=ok1, other=-1)
    TILES: tl.constexpr = CHUNK // BLOCK_N
    if NESTED:  # a loop a chunk (``TREE_NESTED``): each chunk's partials stored after its loop
        limit = stop * CHUNK
        for c in range(first, stop, walkers):
            m0 = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l0 = tl.zeros([BLOCK_M], tl.float32)
            a0 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            if TWO:
                m1, l1, a1 = m0, l0, a0
            ids = tl.load(tables_ptr + b * stride_bt + (c * CHUNK + tl.arange(0, BLOCK_N)) // BLOCK_SIZE)
            for j in range(0, TILES):  # (block ids an iteration ahead, as in ``_chunk``)
                start = c * CHUNK + j * BLOCK_N
                keys = start + tl.arange(0, BLOCK_N)
                block = ids
                ahead = keys + BLOCK_N
                ids = tl.load(tables_ptr + b * stride_bt + ahead // BLOCK_SIZE, mask=ahead < limit, other=0)
                k, v = _kv_in_blocks(k_cache_ptr, v_cache_ptr, block, keys, keys < limit, kvh, d, d_ok, stride_kb,
                                     stride_ks, stride_kh, BLOCK_SIZE)
                a0, m0, l0 = _whole_tile(a0, m0, l0, q0, k, v, keys, p0, ok0, start, scale_log2, BLOCK_N, PRECISION,
                                         DOT_DTYPE, OPEN)
                if TWO:
                    a1, m1, l1 = _whole_tile(a1, m1, l1, q1, k, v, keys, p1, ok1, start, scale_log2, BLOCK_N,
                                             PRECISION, DOT_DTYPE, OPEN)
            _store_partials(part_m_ptr, part_l_ptr, part_acc_ptr, c, t0, h0, ok0, d, d_ok, m0, l0, a0, stride_mc,
                            stride_mt, stride_ac, stride_at, stride_ah)
            if TWO:
                _store_partials(part_m_ptr, part_l_ptr, part_acc_ptr, c, t1, h1, ok1, d, d_ok, m1, l1, a1, stride_mc,
                                stride_mt, stride_ac, stride_at, stride_ah)
    else:  # one loop over the key tiles of all its chunks, as ``_walk_chunks`` (every chunk here whole)
        m0 = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l0 = tl.zeros([BLOCK_M], tl.float32)
        a0 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        if TWO:
            m1, l1, a1 = m0, l0, a0
        total = (tl.cdiv(stop - first, walkers) * TILES).to(tl.int32)
        limit = stop * CHUNK
        ahead = (first * CHUNK + tl.arange(0, BLOCK_N)).to(tl.int32)  # block ids an iteration ahead (``_chunk``)
        ids = tl.load(tables_ptr + b * stride_bt + ahead // BLOCK_SIZE)
        for i in range(0, total):
            start = (first + (i // TILES) * walkers) * CHUNK + (i % TILES) * BLOCK_N
            keys = start + tl.arange(0, BLOCK_N)
            block = ids
            nxt = i + 1
            ahead = (first + (nxt // TILES) * walkers) * CHUNK + (nxt % TILES) * BLOCK_N + tl.arange(0, BLOCK_N)
            ahead = ahead.to(tl.int32)
            ids = tl.load(tables_ptr + b * stride_bt + ahead // BLOCK_SIZE, mask=ahead < limit, other=0)
            k, v = _kv_in_blocks(k_cache_ptr, v_cache_ptr, block, keys, keys < limit, kvh, d, d_ok, stride_kb,
                                 stride_ks, stride_kh, BLOCK_SIZE)
            a0, m0, l0 = _whole_tile(a0, m0, l0, q0, k, v, keys, p0, ok0, start, scale_log2, BLOCK_N, PRECISION,
                                     DOT_DTYPE, OPEN)
            if TWO:
                a1, m1, l1 = _whole_tile(a1, m1, l1, q1, k, v, keys, p1, ok1, start, scale_log2, BLOCK_N, PRECISION,
                                         DOT_DTYPE, OPEN)
            if (i % TILES) == TILES - 1:  # the chunk's last tile
                c = start // CHUNK
                _store_partials(part_m_ptr, part_l_ptr, part_acc_ptr, c, t0, h0, ok0, d, d_ok, m0, l0, a0, stride_mc,
                                stride_mt, stride_ac, stride_at, stride_ah)
                m0 = tl.full([BLOCK_M], float("-inf"), tl.float32)
                l0 = tl.zeros([BLOCK_M], tl.float32)
                a0 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
                if TWO:
                    _store_partials(part_m_ptr, part_l_ptr, part_acc_ptr, c, t1, h1, ok1, d, d_ok, m1, l1, a1,
                                    stride_mc, stride_mt, stride_ac, stride_at, stride_ah)
                    m1, l1, a1 = m0, l0, a0


@triton.jit(do_not_specialize=["stride_bt", "stride_tab", "tab_cols", "stride_mc", "stride_mt", "stride_ac",
                               "stride_at", "q_tiles", "walkers", "num_seqs"])  # step-dependent (attention_triton.py)
def _exact_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
                            qsl_ptr, seq_lens_ptr, pos_ptr, tables_ptr, table_ptr, mask_start_ptr, scale_log2,
                            stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_tab, tab_cols,
                            stride_mc, stride_mt, stride_ac, stride_at, stride_ah, q_tiles, walkers, num_seqs,
                            G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr, SUB: tl.constexpr,
                            SHARED_Q: tl.constexpr, SHARED_M: tl.constexpr, SHARED_TWO: tl.constexpr,
                            BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_MASK: tl.constexpr,
                            SPLIT: tl.constexpr, PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr,
                            USE_GDC: tl.constexpr, RAGGED: tl.constexpr, BLOCK_B: tl.constexpr,
                            FLAT: tl.constexpr, NESTED: tl.constexpr, OPEN: tl.constexpr):
    if USE_GDC:  # launched dependent (kernels/pdl.py): wait before any load and any early return
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # (q_tiles: the grid's tiles of SUB query tiles each)
    b, group, past = _program_tile(qsl_ptr, num_seqs, q_tiles, BLOCK_Q * SUB, RAGGED, BLOCK_B)
    if past:
        return
    kvh = tl.program_id(1)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if group * SUB * BLOCK_Q >= q_len:
        return
    tile = group
    if SUB > 1:  # a tree's split launch (SPLIT and HAS_MASK)
        pid = tl.program_id(2)
        if pid < walkers:  # whole chunks, before the tree's, for the group's tiles at once
            m_start = tl.load(mask_start_ptr + b)
            _shared_chunks(q_ptr, k_cache_ptr, v_cache_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, pos_ptr, tables_ptr,
                            b, group, kvh, q_start, q_len, pid, walkers, (m_start // BLOCK_N) * BLOCK_N, scale_log2,
                            stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_mc, stride_mt,
                            stride_ac, stride_at, stride_ah, G, SHARED_Q, SHARED_M, BLOCK_N, CHUNK, HEAD_DIM, BLOCK_D,
                            BLOCK_SIZE, PRECISION, DOT_DTYPE, SHARED_TWO, NESTED, OPEN)
            return
        tile = group * SUB + (pid - walkers) // BLOCK_Q
        if tile * BLOCK_Q >= q_len:
            return
    qi, head, row_ok, t, d, d_ok, q = _query_tile(q_ptr, q_start, q_len, tile, kvh, stride_qt, stride_qh,
                                                  G, BLOCK_Q, BLOCK_M, BLOCK_D, HEAD_DIM)
    row_tok = qi - tile * BLOCK_Q  # token within the tile
    pos = tl.load(pos_ptr + t, mask=row_ok, other=-1)
    end = tl.max(pos, 0) + 1  # keys at positions [0, end) matter to some row
    if HAS_MASK:
        m_start = tl.load(mask_start_ptr + b)
        tail_start = (m_start // BLOCK_N) * BLOCK_N
    else:
        m_start = tl.load(seq_lens_ptr + b)  # unused without a mask
        tail_start = end + BLOCK_N  # no gathered tiles
    t0 = (q_start + tile * BLOCK_Q).to(tl.int64)
    n_tok = tl.minimum(q_len - tile * BLOCK_Q, BLOCK_Q)
    if SPLIT:
        pid = tl.program_id(2)
        # Programs [0, walkers): chunks pid, pid + walkers, ..., all tokens; then, with a tree, one
        # program a token for the (one or two) chunks holding tree tiles, which the first ones skip.
        per_token = pid >= walkers
        whole = pid < walkers
        j_lo = tl.where(per_token, (pid - walkers) % BLOCK_Q, 0)
        j_hi = tl.where(per_token, j_lo + 1, n_tok)
        if HAS_MASK:
            if per_token & (j_lo >= n_tok):
                return
            row_ok = row_ok & (row_tok >= j_lo) & (row_tok < j_hi)
            pos = tl.where(row_ok, pos, -1)
            end = tl.max(pos, 0) + 1
        first = tl.where(per_token, tail_start // CHUNK, pid)
        stop = tl.cdiv(end, CHUNK)  # (a chunk from the end on holds no key any row sees)
        if HAS_MASK:  # the programs of whole chunks stop before the first chunk holding tree tiles
            stop = tl.where(whole, tl.minimum(stop, tail_start // CHUNK), stop)
        if FLAT:
            if first < stop:
                _walk_chunks(q, pos, row_ok, first, stop, walkers, end, b, t, head, k_cache_ptr, v_cache_ptr,
                             tables_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, scale_log2, stride_bt, stride_kb,
                             stride_ks, stride_kh, stride_mc, stride_mt, stride_ac, stride_at, stride_ah, kvh, d, d_ok,
                             BLOCK_M, BLOCK_N, BLOCK_D, CHUNK, BLOCK_SIZE, True, PRECISION, DOT_DTYPE)
            return
        for c in range(first, stop, tl.where(per_token, 1, walkers)):
            lo = c * CHUNK
            m_c, l_c, acc_c = _chunk(q, pos, row_ok, row_tok, j_lo, j_hi, lo, tl.minimum(lo + CHUNK, end), b, t0,
                                     m_start, tail_start, k_cache_ptr, v_cache_ptr, tables_ptr, table_ptr, scale_log2,
                                     stride_bt, stride_kb, stride_ks, stride_kh, stride_tab, tab_cols, kvh, d, d_ok,
                                     BLOCK_Q, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_SIZE, HAS_MASK, PRECISION, DOT_DTYPE)
            _store_partials(part_m_ptr, part_l_ptr, part_acc_ptr, c, t, head, row_ok, d, d_ok, m_c, l_c, acc_c,
                            stride_mc, stride_mt, stride_ac, stride_at, stride_ah)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        if not FLAT:
            for lo in range(0, end, CHUNK):
                m_c, l_c, acc_c = _chunk(q, pos, row_ok, row_tok, 0, n_tok, lo, tl.minimum(lo + CHUNK, end), b, t0,
                                         m_start, tail_start, k_cache_ptr, v_cache_ptr, tables_ptr, table_ptr,
                                         scale_log2, stride_bt, stride_kb, stride_ks, stride_kh, stride_tab, tab_cols,
                                         kvh, d, d_ok, BLOCK_Q, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_SIZE, HAS_MASK,
                                         PRECISION, DOT_DTYPE)
                m_i, l_i, acc = _fold(m_i, l_i, acc, m_c, l_c, acc_c)
        elif end > 0:
            m_i, l_i, acc = _walk_chunks(q, pos, row_ok, 0, tl.cdiv(end, CHUNK), 1, end, b, t, head, k_cache_ptr,
                                         v_cache_ptr, tables_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, scale_log2,
                                         stride_bt, stride_kb, stride_ks, stride_kh, stride_mc, stride_mt, stride_ac,
                                         stride_at, stride_ah, kvh, d, d_ok, BLOCK_M, BLOCK_N, BLOCK_D, CHUNK,
                                         BLOCK_SIZE, False, PRECISION, DOT_DTYPE)
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["stride_mc", "stride_mt", "stride_ac", "stride_at"])
def _fold_chunks_kernel(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, pos_ptr, stride_mc, stride_mt,
                        stride_ac, stride_at, stride_ah, stride_ot, stride_oh,
                        CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, USE_GDC: tl.constexpr):
    """The split mode's second kernel: fold the chunks of one (token, head) left to right."""
    if USE_GDC:  # launched dependent (kernels/pdl.py): the chunks' partials written first
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    one = tl.arange(0, 1)  # a row axis of one, so _fold sees the shapes the fold mode gives it
    m_i = tl.full([1], float("-inf"), tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([1, BLOCK_D], tl.float32)
    chunks = tl.load(pos_ptr + t) // CHUNK + 1
    for c in range(0, chunks):
        m_c = tl.load(part_m_ptr + c * stride_mc + t * stride_mt + h + one)
        l_c = tl.load(part_l_ptr + c * stride_mc + t * stride_mt + h + one)
        acc_c = tl.load(part_acc_ptr + c * stride_ac + t * stride_at + h * stride_ah + one[:, None] * 0 + d[None, :],
                        mask=d_ok[None, :], other=0.0)
        m_i, l_i, acc = _fold(m_i, l_i, acc, m_c, l_c, acc_c)
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + t * stride_ot + h * stride_oh + one[:, None] * 0 + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=d_ok[None, :])
