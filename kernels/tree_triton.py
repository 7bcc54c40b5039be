"""Triton tree layout on the device: ``kernels.tree.sanitize_trees_ref`` and
``kernels.tree.packed_tree_mask_ref``'s signatures and results, one launch each.

The references are some twenty small torch kernels each (pointer doubling, gathers, a sort for
the duplicate siblings, the mask's packing), and a chained step issues them from Python on its
critical path: about 0.9 ms of host time per step at one sequence on an H100, while the device
waits. Here one program holds one tree in registers::

    sanitize:  tokens | parents | depths | scores of n nodes, read once (the snapshot every later
               read sees); each node's parent depth by a one-hot [n, n] gather; the duplicate
               siblings by an [n, n] compare of (parent, token) among earlier nodes; the tree or
               its stand-in written out
    mask:      every slot walks up its parent slots (slot i's parent: parents[i - 1] + 1, the root
               its own), setting the bit of each slot it meets: itself, its ancestors, the root.
               n + 1 steps reach the root from any slot of a tree (a parent precedes its child)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import small_launch
from kernels.tree import expand_frontier_ref
from kernels.triton_jit import jit_unspecialized

MIN_BLOCK = 16  # one compiled variant for every tree of up to 16 nodes (slots), the next for 32, ...
MAX_EXPAND = 128  # candidates a level's kernel ranks at most ([n, n] comparisons in one program's registers)


def sanitize_trees_triton(packed: torch.Tensor, vocab_size: int, max_depth: int) -> torch.Tensor:
    """``sanitize_trees_ref``'s signature and result, in one launch and one allocation: int64
    [4 * B * n + B], the trees then their valid flags. ``packed`` [4, B, n] int64, nodes contiguous
    (a slice of a larger buffer is fine)."""
    _, B, n = packed.shape
    assert packed.dtype == torch.int64 and packed.stride(2) == 1, "int64 trees, nodes contiguous"
    out = torch.empty(4 * B * n + B, dtype=torch.int64, device=packed.device)
    if B and n:
        _sanitize_kernel[(B,)](packed, packed.stride(0), packed.stride(1), out, B, n, vocab_size, max_depth,
                               BLOCK=max(MIN_BLOCK, triton.next_power_of_2(n)))
    return out


@jit_unspecialized("in_ptr", "stride_plane", "stride_tree", "out_ptr", "B", "n", "vocab", "max_depth")
def _sanitize_kernel(in_ptr, stride_plane, stride_tree, out_ptr, B, n, vocab, max_depth, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    real = i < n
    src = in_ptr + b * stride_tree + i
    tokens = tl.load(src, mask=real, other=0)
    parents = tl.load(src + stride_plane, mask=real, other=-1)
    depths = tl.load(src + 2 * stride_plane, mask=real, other=1)
    scores = tl.load(src + 3 * stride_plane, mask=real, other=0)
    node_ok = (tokens >= 0) & (tokens < vocab) & (parents >= -1) & (parents < i) & (depths <= max_depth)
    # parent_depth[r] = depths[parents[r]] (rows r, columns c): a one-hot gather in registers.
    pick = (parents[:, None] == i[None, :]) & real[None, :]  # (BLOCK, BLOCK)
    parent_depth = tl.sum(tl.where(pick, depths[None, :], 0), 1)
    node_ok &= tl.where(parents >= 0, parent_depth + 1, 1) == depths
    node_ok |= ~real
    # A later node repeating an earlier sibling's token: (parent, token) equal, column before row.
    same = (parents[:, None] == parents[None, :]) & (tokens[:, None] == tokens[None, :]) & (i[None, :] < i[:, None])
    dup = tl.max(tl.where(same & real[:, None], 1, 0), 1)
    ok = (tl.min(node_ok.to(tl.int32), 0) > 0) & (tl.max(dup, 0) == 0)
    dst = out_ptr + b * n + i
    plane = B * n
    tl.store(dst, tl.where(ok, tokens, i % vocab), mask=real)
    tl.store(dst + plane, tl.where(ok, parents, -1), mask=real)
    tl.store(dst + 2 * plane, tl.where(ok, depths, 1), mask=real)
    tl.store(dst + 3 * plane, tl.where(ok, scores, 0), mask=real)
    tl.store(out_ptr + 4 * plane + b, ok.to(tl.int64))  # the valid flags follow the four planes


def packed_tree_mask_triton(parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """``packed_tree_mask_ref``'s signature and result, in one launch: int32 [B * (N + 1), words]."""
    B, N = parents.shape
    words = -(-(N + 1) // 32)
    out = torch.empty(B * (N + 1), words, dtype=torch.int32, device=parents.device)
    if B:
        _tree_mask_kernel[(B,)](parents.contiguous(), num_nodes.contiguous(), out, N, words,
                                BLOCK=max(MIN_BLOCK, triton.next_power_of_2(N + 1)),
                                WORDS=triton.next_power_of_2(words), **small_launch(out))
    return out


@jit_unspecialized("parents_ptr", "num_nodes_ptr", "out_ptr", "N", "words")
def _tree_mask_kernel(parents_ptr, num_nodes_ptr, out_ptr, N, words, BLOCK: tl.constexpr, WORDS: tl.constexpr,
                      USE_GDC: tl.constexpr):
    if USE_GDC:  # launched dependent (kernels/pdl.py): wait before any load, store or return
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK)  # slots: 0 the root, i + 1 node i
    w = tl.arange(0, WORDS)
    node = s - 1
    real = (s >= 1) & (node < tl.load(num_nodes_ptr + b)) & (s <= N)
    parent = tl.load(parents_ptr + b * N + node, mask=real, other=-1)
    jump = tl.where(real, tl.minimum(tl.maximum(parent, -1), N - 1) + 1, 0)  # slot -> its parent's slot
    cur = s.to(tl.int64)
    bits = tl.zeros([BLOCK, WORDS], dtype=tl.int32)
    # A slot's ancestors, one level an iteration, until every walk has reached the root: the tree's
    # depth iterations, not its width (parents come before children: at most N steps in any case).
    steps = 0
    while (tl.max(cur, 0) > 0) & (steps <= N):
        bit = tl.full([BLOCK, WORDS], 1, tl.int32) << (cur % 32).to(tl.int32)[:, None]
        bits |= tl.where((cur // 32)[:, None] == w[None, :], bit, 0)
        cur = tl.sum(tl.where(cur[:, None] == s[None, :], jump[None, :], 0), 1)  # (BLOCK,): cur's parent slot
        steps += 1
    bits |= tl.where(w[None, :] == 0, 1, 0)  # the root: every slot's last ancestor
    rows = b * (N + 1) + s
    tl.store(out_ptr + rows[:, None] * words + w[None, :], bits, mask=(s[:, None] <= N) & (w[None, :] < words))


def static_level_triton(ids: torch.Tensor, log_probs: torch.Tensor, pick: torch.Tensor, parent: torch.Tensor,
                        pool_tokens: torch.Tensor, pool_parents: torch.Tensor, pool_scores: torch.Tensor, lo: int,
                        frontier_pick: torch.Tensor) -> torch.Tensor:
    """``static_level_ref``'s signature and result in one launch (the reference's gathers, add, pool
    writes and the frontier's gather are eight kernels a level on the GPU): a program a sequence
    reads its level's candidates, their parents' scores (earlier levels' nodes: no program writes
    them here), writes the level's nodes and the next frontier's tokens."""
    B, n, nf = ids.shape[0], pick.shape[0], frontier_pick.shape[0]
    out = torch.empty(B, nf, dtype=torch.int64, device=ids.device)
    if B and n:
        assert all(t.is_contiguous() for t in (pool_tokens, pool_parents, pool_scores)), "pool buffers: contiguous"
        ids, log_probs = ids.reshape(B, -1).contiguous(), log_probs.reshape(B, -1).contiguous()
        _static_level_kernel[(B,)](ids, log_probs, pick.contiguous(), parent.contiguous(), frontier_pick.contiguous(),
                                   pool_tokens, pool_parents, pool_scores, out, ids.shape[1], n, nf,
                                   pool_tokens.shape[1], lo, BLOCK=max(MIN_BLOCK, triton.next_power_of_2(max(n, nf))))
    return out


@jit_unspecialized("ids_ptr", "lp_ptr", "pick_ptr", "par_ptr", "fpick_ptr", "pool_tok_ptr", "pool_par_ptr",
                   "pool_sc_ptr", "out_ptr", "C", "n", "nf", "P", "lo")
def _static_level_kernel(ids_ptr, lp_ptr, pick_ptr, par_ptr, fpick_ptr, pool_tok_ptr, pool_par_ptr, pool_sc_ptr,
                         out_ptr, C, n, nf, P, lo, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    ok = j < n
    c = tl.load(pick_ptr + j, mask=ok, other=0)
    par = tl.load(par_ptr + j, mask=ok, other=-1)
    lp = tl.load(lp_ptr + b * C + c, mask=ok, other=0.0)
    below = par >= 0
    score = tl.where(below, lp + tl.load(pool_sc_ptr + b * P + par, mask=ok & below, other=0.0), lp)
    dst = b * P + lo + j
    tl.store(pool_tok_ptr + dst, tl.load(ids_ptr + b * C + c, mask=ok, other=0), mask=ok)
    tl.store(pool_par_ptr + dst, par, mask=ok)
    tl.store(pool_sc_ptr + dst, score, mask=ok)
    f_ok = j < nf
    fc = tl.load(fpick_ptr + j, mask=f_ok, other=0)
    tl.store(out_ptr + b * nf + j, tl.load(ids_ptr + b * C + fc, mask=f_ok, other=0), mask=f_ok)


def expand_frontier_triton(frontier_scores: torch.Tensor, log_probs: torch.Tensor, tokens: torch.Tensor,
                           frontier_idx: torch.Tensor, pool_tokens: torch.Tensor, pool_parents: torch.Tensor,
                           pool_scores: torch.Tensor, lo: int, keep: int
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``expand_frontier_ref``'s signature and results, in one launch: a program a sequence scores
    its candidates, writes them to the pool, ranks them all at once as a stable descending sort
    would ([n, n] comparisons) and writes the best ``keep`` in rank order. Levels of more than
    ``MAX_EXPAND`` candidates (top-k above 11) take the reference: the same results, by a sort."""
    B, F, k = log_probs.shape
    if F * k > MAX_EXPAND:
        return expand_frontier_ref(frontier_scores, log_probs, tokens, frontier_idx, pool_tokens, pool_parents,
                                   pool_scores, lo, keep)
    dev = log_probs.device
    idx = torch.empty(B, keep, dtype=torch.int64, device=dev)
    toks = torch.empty(B, keep, dtype=torch.int64, device=dev)
    slots = torch.empty(B, keep, dtype=torch.int64, device=dev)
    best = torch.empty(B, keep, dtype=torch.float32, device=dev)
    if B:
        assert all(t.is_contiguous() for t in (pool_tokens, pool_parents, pool_scores)), "pool buffers: contiguous"
        _expand_kernel[(B,)](frontier_scores.contiguous(), log_probs.contiguous(), tokens.contiguous(),
                             frontier_idx.contiguous(), pool_tokens, pool_parents, pool_scores, idx, toks, slots, best,
                             F, k, pool_tokens.shape[1], lo, keep,
                             BLOCK=max(MIN_BLOCK, triton.next_power_of_2(F * k)), **small_launch(idx))
    return idx, toks, slots, best


@jit_unspecialized("fs_ptr", "lp_ptr", "tok_ptr", "fidx_ptr", "pool_tok_ptr", "pool_par_ptr", "pool_sc_ptr",
                   "out_idx_ptr", "out_tok_ptr", "out_slot_ptr", "out_sc_ptr", "F", "K", "P", "lo", "keep")
def _expand_kernel(fs_ptr, lp_ptr, tok_ptr, fidx_ptr, pool_tok_ptr, pool_par_ptr, pool_sc_ptr, out_idx_ptr,
                   out_tok_ptr, out_slot_ptr, out_sc_ptr, F, K, P, lo, keep, BLOCK: tl.constexpr,
                   USE_GDC: tl.constexpr):
    if USE_GDC:  # launched dependent (kernels/pdl.py): wait before any load, store or return
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)  # candidate: child c % K of frontier node c // K
    n = F * K
    ok = c < n
    parent = c // K
    scores = tl.load(fs_ptr + b * F + parent, mask=ok, other=0.0) + tl.load(lp_ptr + b * n + c, mask=ok, other=0.0)
    tokens = tl.load(tok_ptr + b * n + c, mask=ok, other=0)
    pool = b * P + lo + c
    tl.store(pool_sc_ptr + pool, scores, mask=ok)
    tl.store(pool_tok_ptr + pool, tokens, mask=ok)
    tl.store(pool_par_ptr + pool, tl.load(fidx_ptr + b * F + parent, mask=ok, other=-1), mask=ok)
    # A candidate's rank: the candidates ahead of it in a stable descending sort (a higher score, or
    # the same score at a lower index). The first ``keep`` ranks are the next frontier, in rank order.
    other = tl.arange(0, BLOCK)[None, :]
    ahead = (scores[None, :] > scores[:, None]) | ((scores[None, :] == scores[:, None]) & (other < c[:, None]))
    rank = tl.sum((ahead & (other < n)).to(tl.int32), 1)
    kept = ok & (rank < keep)
    out = b * keep + rank
    tl.store(out_idx_ptr + out, (c + lo).to(tl.int64), mask=kept)
    tl.store(out_tok_ptr + out, tokens, mask=kept)
    tl.store(out_slot_ptr + out, (c // K).to(tl.int64), mask=kept)
    tl.store(out_sc_ptr + out, scores, mask=kept)


def best_nodes_triton(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, scores: torch.Tensor,
                      n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``best_nodes_ref``'s signature and results in two launches (no sort): each candidate's rank by
    score, counted against every other; then each kept candidate's place, and its parent's, counted
    among the kept ones by (depth, rank). Pools may be column slices of larger buffers (rows strided);
    depths are tree depths (compared as int32)."""
    B, P = scores.shape
    assert 0 < n <= P, f"{n} best nodes of a pool of {P}"
    dev = scores.device
    out = [torch.empty(B, n, dtype=dt, device=dev) for dt in (torch.int64, torch.int64, torch.int64, torch.float32)]
    if B and n:
        assert scores.dtype == torch.float32 and all(t.stride(1) == 1 for t in (tokens, parents, depths, scores))
        rank = torch.empty(B, P, dtype=torch.int32, device=dev)
        grid = (B, triton.cdiv(P, RANK_BLOCK))
        against = min(RANK_AGAINST, triton.next_power_of_2(P))
        _rank_kernel[grid](scores, scores.stride(0), rank, P, BLOCK=RANK_BLOCK, BLOCK_J=against, **small_launch(scores))
        _place_kernel[grid](tokens, parents, depths, scores, tokens.stride(0), parents.stride(0), depths.stride(0),
                            scores.stride(0), rank, *out, P, n, BLOCK=RANK_BLOCK, BLOCK_J=against,
                            **small_launch(scores))
    return tuple(out)


# Candidates a program ranks, against blocks of up to 256 others a loop: few loop turns (each waits on its
# loads), many programs (a 610-candidate pool: 39 a sequence, 3 turns each).
RANK_BLOCK, RANK_AGAINST = 16, 256


@jit_unspecialized("scores_ptr", "stride", "rank_ptr", "P")
def _rank_kernel(scores_ptr, stride, rank_ptr, P, BLOCK: tl.constexpr, BLOCK_J: tl.constexpr, USE_GDC: tl.constexpr):
    if USE_GDC:  # launched dependent (kernels/pdl.py): wait before any load, store or return
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    s_i = tl.load(scores_ptr + b * stride + i, mask=i < P, other=0.0)
    s_i = tl.where(s_i != s_i, float("inf"), s_i)  # NaN ranks as +inf: ranks stay a permutation
    rank = tl.zeros([BLOCK], dtype=tl.int32)
    for j0 in range(0, P, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        s_j = tl.load(scores_ptr + b * stride + j, mask=j < P, other=0.0)
        s_j = tl.where(s_j != s_j, float("inf"), s_j)
        ahead = (s_j[None, :] > s_i[:, None]) | ((s_j[None, :] == s_i[:, None]) & (j[None, :] < i[:, None]))
        rank += tl.sum((ahead & (j < P)[None, :]).to(tl.int32), 1)
    tl.store(rank_ptr + b * P + i, rank, mask=i < P)


@jit_unspecialized("tokens_ptr", "parents_ptr", "depths_ptr", "scores_ptr", "st_tokens", "st_parents", "st_depths",
                   "st_scores", "rank_ptr", "out_tokens", "out_parents", "out_depths", "out_scores", "P", "n")
def _place_kernel(tokens_ptr, parents_ptr, depths_ptr, scores_ptr, st_tokens, st_parents, st_depths, st_scores,
                  rank_ptr, out_tokens, out_parents, out_depths, out_scores, P, n, BLOCK: tl.constexpr,
                  BLOCK_J: tl.constexpr, USE_GDC: tl.constexpr):
    if USE_GDC:  # launched dependent (kernels/pdl.py): wait before any load, store or return
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_pool = i < P
    rank_i = tl.load(rank_ptr + b * P + i, mask=in_pool, other=P)
    kept = in_pool & (rank_i < n)
    depth_i = tl.load(depths_ptr + b * st_depths + i, mask=in_pool, other=0).to(tl.int32)
    parent = tl.load(parents_ptr + b * st_parents + i, mask=in_pool, other=-1)
    has_parent = (parent >= 0) & (parent < P)
    p = tl.where(has_parent, parent, 0)
    rank_p = tl.load(rank_ptr + b * P + p, mask=in_pool, other=P)
    depth_p = tl.load(depths_ptr + b * st_depths + p, mask=in_pool, other=0).to(tl.int32)
    has_parent &= rank_p < n
    place_i = tl.zeros([BLOCK], dtype=tl.int32)
    place_p = tl.zeros([BLOCK], dtype=tl.int32)
    for j0 in range(0, P, BLOCK_J):  # kept candidates before i (and before its parent) by (depth, rank)
        j = j0 + tl.arange(0, BLOCK_J)
        rank_j = tl.load(rank_ptr + b * P + j, mask=j < P, other=P)
        depth_j = tl.load(depths_ptr + b * st_depths + j, mask=j < P, other=0).to(tl.int32)
        kept_j = ((j < P) & (rank_j < n))[None, :]
        before_i = (depth_j[None, :] < depth_i[:, None]) | (
            (depth_j[None, :] == depth_i[:, None]) & (rank_j[None, :] < rank_i[:, None]))
        before_p = (depth_j[None, :] < depth_p[:, None]) | (
            (depth_j[None, :] == depth_p[:, None]) & (rank_j[None, :] < rank_p[:, None]))
        place_i += tl.sum((before_i & kept_j).to(tl.int32), 1)
        place_p += tl.sum((before_p & kept_j).to(tl.int32), 1)
    dst = b * n + place_i
    tl.store(out_tokens + dst, tl.load(tokens_ptr + b * st_tokens + i, mask=kept, other=0), mask=kept)
    tl.store(out_parents + dst, tl.where(has_parent, place_p, -1).to(tl.int64), mask=kept)
    tl.store(out_depths + dst, depth_i.to(tl.int64), mask=kept)
    tl.store(out_scores + dst, tl.load(scores_ptr + b * st_scores + i, mask=kept, other=0.0), mask=kept)
