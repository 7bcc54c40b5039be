"""Tree verification: which draft nodes the target accepts, and the bonus token after them.

Inputs are batched over B sequences and padded to N+1 columns; column 0 is the ROOT (the
sequence's newest committed token), column i+1 is tree node i::

    column         0     1     2     3     4     5    | 6 (padding, ignored)
    node_tokens    -     5     6     7     8     9    |  .
    parents       -1     0     0     1     1     2    |  .      num_nodes = 6
    accepted path: [0, 2, 5, -1]  ->  num_accepted = 2, bonus drawn at column 5

Children of a node are tried in column order (the draft's rank order). A walk never goes
deeper than ``max_depth``: nodes below it are never accepted, and ``path`` is [B, max_depth+1].

The references here are batched torch code without host syncs; on the GPU sets the greedy walk is
one Triton kernel, one program per sequence (``acceptance_triton.py``); the sampling walks run
as these references.

Why sampled verification is lossless (deterministic draft, target p at the current node)
---------------------------------------------------------------------------------------
Let the children carry distinct tokens t_1..t_k, tried in order. Before trial i the residual
is p with t_1..t_{i-1} zeroed, of mass R_i = 1 - sum_{j<i} p(t_j) (R_1 = 1). Trial i accepts
with probability p(t_i) / R_i, so

    P(reach trial i)   = prod_{j<i} (1 - p(t_j) / R_j) = prod_{j<i} R_{j+1} / R_j = R_i
    P(accept t_i)      = R_i * p(t_i) / R_i = p(t_i)
    P(bonus = x)       = R_{k+1} * p(x) / R_{k+1} = p(x)      for x not among the children

so the committed token x is distributed exactly as p(x). If x is an accepted child, the walk
continues from it with the target's distribution at that node, p(. | prefix, x), and the same
argument applies level by level: every committed token is an exact target sample. No draft
probability appears because the tree is fixed before the uniforms are drawn.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AcceptResult:
    path: torch.Tensor  # int64 [B, D+1], accepted columns root first (path[:, 0] == 0), -1 padded
    num_accepted: torch.Tensor  # int64 [B], accepted draft nodes (root excluded)
    bonus: torch.Tensor  # int64 [B], the token drawn at the last accepted node


def _candidate_columns(parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """bool [B, N+1]: real tree nodes (not the root, not padding)."""
    col = torch.arange(parents.shape[1], device=parents.device)[None, :]  # (1, N+1)
    return (col >= 1) & (col < num_nodes[:, None])


def _start_path(batch: int, max_depth: int, device) -> torch.Tensor:
    path = torch.full((batch, max_depth + 1), -1, dtype=torch.int64, device=device)
    path[:, 0] = 0
    return path


def greedy_accept_ref(target_argmax: torch.Tensor, node_tokens: torch.Tensor, parents: torch.Tensor,
                      num_nodes: torch.Tensor, max_depth: int) -> AcceptResult:
    """Greedy verification: child j of the current node is accepted iff
    node_tokens[j] == target_argmax[parent(j)]; bonus = target_argmax at the last accepted node.

    One batched pass per tree level. Siblings carry distinct tokens, so at most one child
    matches; should several match, the first in column order wins (as in sampling).
    """
    batch = parents.shape[0]
    candidate = _candidate_columns(parents, num_nodes)  # (B, N+1)
    path = _start_path(batch, max_depth, parents.device)
    cur = torch.zeros(batch, dtype=torch.int64, device=parents.device)  # current node, (B,)
    for depth in range(1, max_depth + 1):
        want = target_argmax.gather(1, cur[:, None])  # token the target emits after cur, (B, 1)
        match = candidate & (parents == cur[:, None]) & (node_tokens == want)  # (B, N+1)
        found = match.any(dim=1)
        first = match.to(torch.int8).argmax(dim=1)  # first matching column (argmax ties -> first)
        # A row that found nothing keeps cur, and finds nothing at every later level either.
        cur = torch.where(found, first, cur)
        path[:, depth] = torch.where(found, first, -1)
    num_accepted = (path[:, 1:] >= 0).sum(dim=1)
    bonus = target_argmax.gather(1, cur[:, None])[:, 0]
    return AcceptResult(path, num_accepted, bonus)


def sampling_accept_ref(target_probs: torch.Tensor, node_tokens: torch.Tensor, parents: torch.Tensor,
                        num_nodes: torch.Tensor, max_depth: int, uniforms: torch.Tensor,
                        noise: torch.Tensor) -> AcceptResult:
    """Lossless multi-candidate verification (SpecInfer / EAGLE rule, deterministic draft).

    target_probs [B, N+1, V] (rows may be unnormalised), uniforms [B, N+1] in [0, 1) (one per
    tried column), noise [B, V] ~ Exp(1) for the bonus (exponential race). With a one-hot
    ``target_probs`` this equals ``greedy_accept_ref`` on its argmax.

    Walk: p_res = p(root); try the current node's children in column order; accept child c
    (token t) iff u[c] * sum(p_res) < p_res[t], then move to c and reset p_res = p(c); on
    rejection zero p_res[t]. If no child is accepted, bonus = argmax(p_res / noise).

    One batched step per column suffices: a node's children sit at later columns than the
    node (parents precede children), so by the time the walk reaches node c, every column
    still to visit includes all of c's children, in rank order.
    """
    batch, width, vocab = target_probs.shape
    candidate = _candidate_columns(parents, num_nodes)  # (B, N+1)
    tokens = node_tokens.clamp(0, vocab - 1)  # padding may hold anything; it is masked below
    path = _start_path(batch, max_depth, parents.device)
    slot = torch.arange(max_depth + 1, device=parents.device)[None, :]  # (1, D+1)
    cur = torch.zeros(batch, dtype=torch.int64, device=parents.device)  # (B,)
    depth = torch.zeros_like(cur)  # depth of cur, (B,)
    p_res = target_probs[:, 0]  # (B, V), replaced, never written in place
    for c in range(1, width):
        tried = candidate[:, c] & (parents[:, c] == cur) & (depth < max_depth)  # (B,)
        t = tokens[:, c, None]  # (B, 1)
        p_t = p_res.gather(1, t)[:, 0]  # (B,)
        # Sum recomputed, not kept running: when only t is left, sum == p_res[t] exactly, so
        # u < 1 always accepts (a drifting running sum could reject and leave p_res all zero).
        accept = tried & (uniforms[:, c] * p_res.sum(dim=1) < p_t)
        reject = tried & ~accept
        p_res = p_res.scatter(1, t, torch.where(reject, 0.0, p_t)[:, None].to(p_res.dtype))
        p_res = torch.where(accept[:, None], target_probs[:, c], p_res)
        cur = torch.where(accept, c, cur)
        depth = depth + accept.long()
        path = torch.where(accept[:, None] & (slot == depth[:, None]), c, path)
    bonus = (p_res / noise).argmax(dim=1)  # exponential race on the unnormalised residual
    return AcceptResult(path, depth, bonus)


def seeded_accept_ref(target_probs: torch.Tensor, node_tokens: torch.Tensor, parents: torch.Tensor,
                      num_nodes: torch.Tensor, max_depth: int, depths: torch.Tensor,
                      noise: torch.Tensor) -> AcceptResult:
    """Seeded verification: a node is accepted iff it is the target's own sample at its parent.

    ``noise`` [B, D+1, V] ~ Exp(1): row d is the noise plain decoding draws the token at depth d + 1
    with (keyed by the request's seed and that token's index); ``depths`` [B, N+1] is each
    column's depth (root 0). The target's sample after column c is the exponential race
    ``argmax(p[c] / noise[depth(c)])``, the very formula plain decoding applies to the same row,
    and the walk is the greedy one on those samples::

        sample[b, c] = argmax_v target_probs[b, c, v] / noise[b, depths[b, c], v]
        accept child j of the current node  iff  node_tokens[j] == sample[parent(j)]
        bonus = sample at the last accepted node

    Lossless by construction: every committed token is the sample plain decoding would have drawn
    at its position, so for a fixed seed the output is the same text with or without a draft
    (given the same target logits), and for random seeds it is distributed as the target's. A
    child t is accepted with probability p(t), as under the residual rule: the expected
    acceptance of a tree is the same, sample by sample it differs.
    """
    d = depths.clamp(0, noise.shape[1] - 1)
    per_column = noise.gather(1, d[:, :, None].expand(-1, -1, noise.shape[2]))  # (B, N+1, V)
    samples = (target_probs / per_column).argmax(dim=-1)  # (B, N+1)
    return greedy_accept_ref(samples, node_tokens, parents, num_nodes, max_depth)
