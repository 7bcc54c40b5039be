"""Candidate-tree kernels: ancestor masks, RoPE positions and the draft's top-k.

Trees are batched over B sequences and padded to N nodes; ``num_nodes[b]`` says how many of
sequence b's nodes are real. Slot 0 of every [N+1] axis is the root (the sequence's newest
committed token), slot i + 1 is node i::

    slot:     0      1     2     3    ...   n    n+1 .. N
            root  node0 node1 node2      node n-1  padding

Parents follow ``CandidateTree``: -1 for children of the root, else an earlier node index.
"""

from __future__ import annotations

import torch

from kernels.attention import pack_mask


def tree_mask_ref(parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """bool [B, N+1, N+1]: row i sees column j iff j == i, j is the root, or j is an ancestor of i.

    Padding nodes (index >= num_nodes) see only themselves and the root, whatever their parents.
    Pointer doubling: after r rounds every row holds its ancestors up to distance 2**r. A node's
    farthest ancestor below the root is at most N - 1 away, so ceil(log2(N - 1)) rounds (no host
    sync, no loop over nodes, a count fixed by the shape) cover any tree of N nodes.
    """
    b, n = parents.shape
    jump = _parent_slots(parents, num_nodes)  # (B, N+1): slot of each slot's parent, root -> root
    slots = torch.arange(n + 1, device=parents.device)
    # Distance <= 1: itself, its parent and the root.
    mask = (slots[None, None, :] == jump[:, :, None]) | (slots[None, :, None] == slots[None, None, :])
    mask[:, :, 0] = True
    for _ in range(max(0, n - 2).bit_length()):
        # ancestors within 2d = ancestors within d  U  those of the d-th ancestor
        mask |= torch.gather(mask, 1, jump[:, :, None].expand(b, n + 1, n + 1))
        jump = torch.gather(jump, 1, jump)  # d-th ancestor -> 2d-th ancestor
    return mask


def sanitize_trees_ref(packed: torch.Tensor, vocab_size: int, max_depth: int) -> torch.Tensor:
    """Trees another process wrote, made safe to lay out and verify, on their device with no sync:
    ``packed`` int64 [4, B, n] (tokens | parents | depths | score bits, every tree of n nodes) ->
    one int64 tensor [4 * B * n + B]: the trees in the same layout, then each tree's valid flag (1 or
    0), so the host learns both with one copy (``split_sanitized`` views the two). A tree that breaks an invariant
    ``runtime.tree.invalid_trees`` checks (tokens in the vocabulary, parents before children, depths
    one below the parent's, none deeper than ``max_depth``, distinct siblings) is replaced by n
    children of the root with the distinct tokens 0, 1, ... (depth 1): whatever was written, the
    step's layout stays within its buffers and tables, and its acceptance exact (any well-formed tree
    verifies exactly). ``valid`` tells the host which trees were replaced. ``packed`` is read once (a
    snapshot first): the checks and every later read see the same bytes, whatever the peer writes."""
    packed = packed.clone()
    tokens, parents, depths = packed[0], packed[1], packed[2]
    _, B, n = packed.shape
    idx = torch.arange(n, device=packed.device)
    ok = ((tokens >= 0) & (tokens < vocab_size) & (parents >= -1) & (parents < idx)).all(dim=1)
    parent_depth = torch.gather(depths, 1, torch.where((parents >= 0) & (parents < idx), parents, 0))
    # Each depth its parent's + 1 (1 below the root): by induction from the root, every depth is true.
    ok &= (torch.where(parents >= 0, parent_depth + 1, 1) == depths).all(dim=1)
    ok &= depths.amax(dim=1) <= max_depth
    # Siblings distinct: equal neighbours among each tree's sorted (parent, token) keys (a tree whose
    # tokens or parents are out of range is refused already, whatever its keys).
    keys = torch.where(ok[:, None], (parents + 1) * (vocab_size + 1) + tokens, idx).sort(dim=1).values
    ok &= ~(keys[:, 1:] == keys[:, :-1]).any(dim=1)
    fallback = torch.stack([(idx % vocab_size).expand(B, n), torch.full_like(tokens, -1), torch.ones_like(tokens),
                            torch.zeros_like(tokens)])
    return torch.cat([torch.where(ok[None, :, None], packed, fallback).flatten(), ok.to(torch.int64)])


def split_sanitized(flat: torch.Tensor, num_trees: int, num_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``sanitize_trees``' result as (trees int64 [4, B, n], valid bool [B]); the trees are a view."""
    cut = 4 * num_trees * num_nodes
    return flat[:cut].view(4, num_trees, num_nodes), flat[cut:cut + num_trees] != 0


def packed_tree_mask_ref(parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """``tree_mask_ref`` packed for the attention kernels, int32 [B * (N + 1), ceil((N + 1) / 32)]:
    bit j of word w of row b * (N + 1) + i is column 32 w + j of tree b's row i (``pack_mask``)."""
    b, n = parents.shape
    return pack_mask(tree_mask_ref(parents, num_nodes).reshape(b * (n + 1), n + 1))


def _parent_slots(parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """int64 [B, N+1]: slot of every slot's parent; the root and padding nodes point at the root."""
    b, n = parents.shape
    real = torch.arange(n, device=parents.device)[None, :] < num_nodes[:, None]  # (B, N)
    node_parent = torch.where(real, parents.clamp(-1, n - 1) + 1, 0)  # node i -> slot parents[i] + 1
    return torch.cat([parents.new_zeros(b, 1), node_parent], dim=1)


def tree_positions_ref(depths: torch.Tensor, num_nodes: torch.Tensor,
                       root_positions: torch.Tensor) -> torch.Tensor:
    """int64 [B, N+1]: root at root_position, node i at root_position + depths[i].

    Padding nodes get the root's position (any in-range value would do: nothing sees them).
    """
    n = depths.shape[1]
    real = torch.arange(n, device=depths.device)[None, :] < num_nodes[:, None]  # (B, N)
    offsets = torch.cat([depths.new_zeros(depths.shape[0], 1), torch.where(real, depths, 0)], dim=1)
    return root_positions.to(torch.int64)[:, None] + offsets


def draft_topk_ref(logits: torch.Tensor, k: int, d2t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the draft distribution: (target_ids int64 [M, k], log_probs float32 [M, k]).

    log_probs = log_softmax over the draft vocabulary, in descending order, clamped to at most 0
    (so in exact maths: keeping them so in float keeps a tree's scores monotone along its paths,
    which makes the best-by-score set closed under ancestors); draft id d maps to target id
    d + d2t[d] (d2t holds OFFSETS, as in EAGLE-3 checkpoints). Already-normalised log-probs pass
    through unchanged (log_softmax is idempotent), so callers may feed either. Equal log-probs are
    ordered as torch.topk orders them (unspecified).
    """
    assert 0 < k <= logits.shape[-1], f"top-k {k} over a draft vocabulary of {logits.shape[-1]}"
    log_probs, draft_ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return draft_ids + d2t[draft_ids], log_probs.clamp(max=0.0)


def expand_frontier_ref(frontier_scores: torch.Tensor, log_probs: torch.Tensor, tokens: torch.Tensor,
                        frontier_idx: torch.Tensor, pool_tokens: torch.Tensor, pool_parents: torch.Tensor,
                        pool_scores: torch.Tensor, lo: int, keep: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One level of an EAGLE-2 dynamic tree: every frontier node's top-k children become candidates.

    ``frontier_scores`` [B, F] (cumulative log-probs), the children's ``log_probs`` and target
    ``tokens`` [B, F, k], the frontier's pool indices ``frontier_idx`` [B, F]. Candidate c (child
    c % k of frontier node c // k) scores frontier_scores + log_prob and is written to the pool
    (tokens, parents, scores [B, capacity], mutated) at index ``lo + c``. Returns the ``keep``
    best candidates, best first (equal scores: the earlier candidate first): their pool indices,
    tokens, frontier slots (c // k) and scores, each [B, keep]: the next frontier.
    """
    b, nf, k = log_probs.shape
    n = nf * k
    scores = pool_scores[:, lo:lo + n].view(b, nf, k)
    torch.add(frontier_scores[:, :, None], log_probs, out=scores)
    pool_tokens[:, lo:lo + n].view(b, nf, k).copy_(tokens)
    pool_parents[:, lo:lo + n].view(b, nf, k).copy_(frontier_idx[:, :, None].expand(b, nf, k))
    order = scores.view(b, n).sort(dim=1, descending=True, stable=True)
    best = order.indices[:, :keep]
    return best + lo, tokens.reshape(b, n).gather(1, best), best // k, order.values[:, :keep]


def static_level_ref(ids: torch.Tensor, log_probs: torch.Tensor, pick: torch.Tensor, parent: torch.Tensor,
                     pool_tokens: torch.Tensor, pool_parents: torch.Tensor, pool_scores: torch.Tensor, lo: int,
                     frontier_pick: torch.Tensor) -> torch.Tensor:
    """One level of a static tree (``StaticTreeBuilder``): its node j is candidate ``pick[j]`` of the
    fed nodes' top-k (``ids``, target ids, and ``log_probs`` [B, F, k]; candidate c is child c % k of
    fed node c // k) under the pool node ``parent[j]`` (-1: the root). Node j is written to the pool
    (tokens, parents, scores [B, P], mutated) at index ``lo + j``: its token, its parent and its score,
    its log-prob plus its parent's score (a child of the root: its log-prob alone). Returns the
    target ids of the candidates ``frontier_pick`` [F'], int64 [B, F']: the next frontier's tokens."""
    b, n = ids.shape[0], pick.shape[0]
    flat_ids, flat_lp = ids.reshape(b, -1), log_probs.reshape(b, -1)
    scores = flat_lp[:, pick]
    scores = torch.where(parent >= 0, scores + pool_scores.gather(1, parent.clamp(min=0).expand(b, n)), scores)
    pool_tokens[:, lo:lo + n] = flat_ids[:, pick]
    pool_parents[:, lo:lo + n] = parent
    pool_scores[:, lo:lo + n] = scores
    return flat_ids[:, frontier_pick]


def best_nodes_ref(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, scores: torch.Tensor,
                   n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A dynamic tree's final nodes: the ``n`` best of a pool of candidates [B, P] (tokens, parents as
    pool indices or -1, depths, float32 cumulative scores) by score, equal scores to the earlier pool
    index (a NaN score ranks as +inf), ordered by depth, then score: tokens, parents (remapped to
    positions among the n, -1 for the root's children and for a parent not kept), depths, scores,
    each [B, n]. With scores that never grow along a path and pool order parents first, the best n
    hold every kept node's parent."""
    B, P = scores.shape
    assert 0 < n <= P, f"{n} best nodes of a pool of {P}"
    keep = torch.nan_to_num(scores, nan=float("inf")).sort(dim=1, descending=True, stable=True).indices[:, :n]
    # Parents first: a stable sort by depth keeps score order (and its ties) inside a level.
    keep = keep.gather(1, depths.gather(1, keep).sort(dim=1, stable=True).indices)
    new_index = keep.new_full((B, P + 1), -1)  # pool index -> position; column P stands for the root
    new_index.scatter_(1, keep, torch.arange(n, device=keep.device).expand(B, n))
    pool_parent = parents.gather(1, keep)
    out_parents = new_index.gather(1, torch.where((pool_parent >= 0) & (pool_parent < P), pool_parent, P))
    return tokens.gather(1, keep), out_parents, depths.gather(1, keep), scores.gather(1, keep)
