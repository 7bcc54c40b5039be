"""Greedy tree verification and the KV compaction moves as one Triton kernel each (the references:
``acceptance.greedy_accept_ref``, ``kv_compaction.compaction_slots_ref``).

The reference walks the tree one batched level at a time: about eight small kernels a level,
so a depth-7 tree costs some sixty launches a step. Here one program walks one sequence's tree,
its columns in registers::

    cur = root (column 0)
    per level:  want  = argmax[cur]                      the token the target emits after cur
                first = the first column c with parents[c] == cur, tokens[c] == want (a real node)
                path[level] = first, cur = first          (-1 and no move where none matches)
    bonus = argmax[cur], accepted = levels that matched
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.acceptance import AcceptResult
from kernels.pdl import small_launch
from kernels.triton_jit import jit_unspecialized

# One compiled variant serves every step: tree widths up to 64 columns share one tile, and neither
# the integer sizes nor the arrays' alignment (rows sliced out of larger tensors) select another.
MIN_BLOCK = 64


def greedy_accept_triton(target_argmax: torch.Tensor, node_tokens: torch.Tensor, parents: torch.Tensor,
                         num_nodes: torch.Tensor, max_depth: int) -> AcceptResult:
    """``greedy_accept_ref``'s signature and results, in one launch."""
    batch, width = parents.shape
    path = torch.empty(batch, max_depth + 1, dtype=torch.int64, device=parents.device)
    num_accepted = torch.empty(batch, dtype=torch.int64, device=parents.device)
    bonus = torch.empty(batch, dtype=torch.int64, device=parents.device)
    if batch:
        argmax, tokens, par = (t.contiguous() for t in (target_argmax, node_tokens, parents))
        _greedy_accept_kernel[(batch,)](argmax, tokens, par, num_nodes.contiguous(), path, num_accepted, bonus,
                                        width, max_depth, BLOCK=max(MIN_BLOCK, triton.next_power_of_2(width)),
                                        **small_launch(argmax))
    return AcceptResult(path, num_accepted, bonus)


@jit_unspecialized("argmax_ptr", "tokens_ptr", "parents_ptr", "num_nodes_ptr", "path_ptr", "accepted_ptr",
                   "bonus_ptr", "width", "max_depth")
def _greedy_accept_kernel(argmax_ptr, tokens_ptr, parents_ptr, num_nodes_ptr, path_ptr, accepted_ptr, bonus_ptr,
                          width, max_depth, BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    if USE_GDC:  # launched dependent (kernels/pdl.py): wait before any load, store or return
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    n = tl.load(num_nodes_ptr + b)
    real = (cols >= 1) & (cols < n) & (cols < width)
    row = b * width
    argmax = tl.load(argmax_ptr + row + cols, mask=cols < width, other=-1)
    tokens = tl.load(tokens_ptr + row + cols, mask=cols < width, other=-1)
    parents = tl.load(parents_ptr + row + cols, mask=cols < width, other=-2)
    cur = tl.zeros([], tl.int64)
    accepted = tl.zeros([], tl.int64)
    tl.store(path_ptr + b * (max_depth + 1), cur)
    for level in range(1, max_depth + 1):
        want = tl.sum(tl.where(cols == cur, argmax, 0), 0)
        match = real & (parents == cur) & (tokens == want)
        first = tl.min(tl.where(match, cols, BLOCK), 0)
        found = first < BLOCK
        tl.store(path_ptr + b * (max_depth + 1) + level, tl.where(found, first, -1).to(tl.int64))
        cur = tl.where(found, first, cur).to(tl.int64)
        accepted += found.to(tl.int64)
    tl.store(accepted_ptr + b, accepted)
    tl.store(bonus_ptr + b, tl.sum(tl.where(cols == cur, argmax, 0), 0))


def compaction_slots_triton(path: torch.Tensor, num_accepted: torch.Tensor, prefix_lens: torch.Tensor,
                            block_tables: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_compaction.compaction_slots_ref``'s moves in one launch (one program a sequence)."""
    batch, width = path.shape
    src = torch.empty(batch * width, dtype=torch.int64, device=path.device)
    dst = torch.empty_like(src)
    if batch:
        tables = block_tables.contiguous()
        _compaction_slots_kernel[(batch,)](path.contiguous(), num_accepted.contiguous(), prefix_lens.contiguous(),
                                           tables, src, dst, width, tables.shape[1], block_size,
                                           BLOCK=max(MIN_BLOCK, triton.next_power_of_2(width)), **small_launch(path))
    return src, dst


@jit_unspecialized("path_ptr", "accepted_ptr", "prefix_ptr", "tables_ptr", "src_ptr", "dst_ptr", "width",
                   "table_width", "block_size")
def _compaction_slots_kernel(path_ptr, accepted_ptr, prefix_ptr, tables_ptr, src_ptr, dst_ptr, width, table_width,
                             block_size, BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    if USE_GDC:  # launched dependent (kernels/pdl.py): wait before any load, store or return
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    ok = j < width
    path = tl.load(path_ptr + b * width + j, mask=ok, other=0)
    accepted = tl.load(accepted_ptr + b)
    prefix = tl.load(prefix_ptr + b)
    last = table_width * block_size - 1  # clamp keeps masked-out padding in range
    move = (j <= accepted) & (path != j)
    src_idx = tl.minimum(prefix + tl.maximum(path, 0), last)
    dst_idx = tl.minimum(prefix + j, last)
    root_idx = tl.minimum(prefix, last)
    row = tables_ptr + b * table_width
    src = tl.load(row + src_idx // block_size, mask=ok, other=0) * block_size + src_idx % block_size
    dst = tl.load(row + dst_idx // block_size, mask=ok, other=0) * block_size + dst_idx % block_size
    root = tl.load(row + root_idx // block_size) * block_size + root_idx % block_size
    tl.store(src_ptr + b * width + j, tl.where(move, src, root), mask=ok)
    tl.store(dst_ptr + b * width + j, tl.where(move, dst, root), mask=ok)
