"""One step on the draft side: the drafter's work on a ``StepCall``, its trees written to the
shared tree buffers (slot i for proposal i), answered by a ``StepReply``. The same for both step
transports (the unix step socket and the Session stream)."""

from __future__ import annotations

import time

import torch

from link.protocol import DraftFeed, DraftProvider, StepCall, StepReply, TreeRef

TREE_BUFFERS = ("tree_tokens", "tree_parents", "tree_log_probs")


class StepAnswerer:
    """Answers one session's steps. The tree buffers are shared host memory: each tree is written
    straight into its slot, with no device copy and no sync."""

    def __init__(self, bufs: dict[str, torch.Tensor], drafter: DraftProvider):
        self.bufs, self.drafter = bufs, drafter
        self.width = bufs["tree_tokens"].shape[1]
        self._host = {name: bufs[name].numpy() for name in TREE_BUFFERS}  # views of the shared memory

    def answer(self, call: StepCall) -> StepReply:
        """Release finished sequences, extend the draft with the fed rows, grow the trees asked for.
        ``draft_compute_ns`` is this method's time: the rest of the verify side's wait is the link."""
        start = time.perf_counter_ns()
        for seq_id, reason in call.rejections:
            self.drafter.tree_rejected(seq_id, reason)
        for seq_id in call.finished:
            self.drafter.release(seq_id)
        features = self.bufs["features"]
        feeds = [DraftFeed(f.seq_id, f.start, features[f.buffer_row:f.buffer_row + len(f.next_tokens)],
                           f.next_tokens) for f in call.feeds]
        trees = self.drafter.step(feeds, call.proposals)
        refs = []
        tokens, parents, log_probs = (self._host[name] for name in TREE_BUFFERS)
        for slot, p in enumerate(call.proposals):  # slots without a tree keep stale values: unread
            tree = trees.get(p.seq_id)
            if tree is None or not tree.num_nodes:
                continue
            n = min(tree.num_nodes, self.width)  # a larger tree is refused by the verifier
            tokens[slot, :n], parents[slot, :n], log_probs[slot, :n] = tree.tokens[:n], tree.parents[:n], \
                tree.log_probs[:n]
            refs.append(TreeRef(p.seq_id, slot, tree.num_nodes))
        return StepReply(call.step_id, refs, time.perf_counter_ns() - start)
