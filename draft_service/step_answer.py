"""One step on the draft side: the drafter's work on a ``StepCall``, its trees written to the
shared tree buffers (slot i for proposal i), answered by a ``StepReply``. The same for both step
transports (the unix step socket and the Session stream). A chained step (``ChainCall``, the step
socket only) is the drafter's ``step_on_device`` behind the verify side's ready event, its trees
copied into ``chain_trees`` on the device, the done event recorded, answered by a ``ChainReply``
before that work has run (verify_service/draft_link.py)."""

from __future__ import annotations

import time

import torch

from common.errors import LinkProtocolError
from link.protocol import ChainCall, ChainReply, DraftFeed, DraftProvider, StepCall, StepReply, TreeRef
from runtime.tree import pack_trees

TREE_BUFFERS = ("tree_tokens", "tree_parents", "tree_log_probs")


class StepAnswerer:
    """Answers one session's steps. The tree buffers are shared host memory: each tree is written
    straight into its slot, with no device copy and no sync."""

    def __init__(self, bufs: dict[str, torch.Tensor], drafter: DraftProvider, chain_events: tuple | None = None):
        """``chain_events``: the chained steps' (ready, done) IPC events, opened; () off CUDA, where
        nothing needs them; None: this session takes no chained steps."""
        self.bufs, self.drafter, self.chain_events = bufs, drafter, chain_events
        self.width = bufs["tree_tokens"].shape[1]
        self._host = {name: bufs[name].numpy() for name in TREE_BUFFERS}  # views of the shared memory

    def answer(self, call: StepCall) -> StepReply:
        """Release finished sequences, extend the draft with the fed rows, grow the trees asked for.
        ``draft_compute_ns`` is this method's time: the rest of the verify side's wait is the link."""
        start = time.perf_counter_ns()
        self._apply(call)
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

    def chain(self, call: ChainCall) -> ChainReply:
        """A chained step: its work queued behind the verify side's ready event, the trees' copy into
        ``chain_trees`` and the done event behind it; answered before any of it has run. The rows in
        ``chain_feeds`` come from another process: counts and tokens are clamped into range on the
        device, so a wrong value there spoils proposals, never the draft's memory."""
        start = time.perf_counter_ns()
        self._apply(call)
        if self.chain_events is None or not hasattr(self.drafter, "step_on_device"):
            raise LinkProtocolError("a chained step on a session that takes none")
        B, W = len(call.seqs), call.width
        feeds, rows, out = (self.bufs[k] for k in ("chain_feeds", "features", "chain_trees"))
        if not 1 <= B <= out.shape[1] or W + 1 > feeds.shape[1] or B * W > rows.shape[0]:
            raise LinkProtocolError(f"chained step {call.step_id}: {B} sequences of {W} rows exceed the buffers")
        held = getattr(self.drafter, "rows", {})
        for q in call.seqs:
            if held.get(q.seq_id, 0) != q.start or q.most < 1:
                raise LinkProtocolError(f"chained step {call.step_id}: sequence {q.seq_id} fed from row {q.start}, "
                                        f"the draft holds {held.get(q.seq_id, 0)}")
        if self.chain_events:
            torch.cuda.current_stream(rows.device).wait_event(self.chain_events[0])
        # The counts and tokens come from another process: the drafter clamps them into range on the device.
        pending = self.drafter.step_on_device([q.seq_id for q in call.seqs], [q.start for q in call.seqs],
                                              [q.most for q in call.seqs], feeds[:B, 0], feeds[:B, 1:W + 1],
                                              rows[:B * W].view(B, W, rows.shape[1]), call.settings, to_host=False)
        trees = pending.on_device
        if trees is None:  # grown eagerly (a CPU): the trees are on the host already
            got = pending.collect()
            trees = torch.from_numpy(pack_trees([got[q.seq_id] for q in call.seqs]))
        n = trees.shape[2]
        if n > out.shape[2]:
            raise LinkProtocolError(f"chained step {call.step_id}: trees of {n} nodes, the buffer holds {out.shape[2]}")
        out[:, :B, :n].copy_(trees)
        if self.chain_events:
            self.chain_events[1].record()
        return ChainReply(call.step_id, B, n, time.perf_counter_ns() - start)

    def _apply(self, call: StepCall | ChainCall) -> None:
        """What a frame says before its step: settled rows (chained sequences' commits), refused
        trees, finished sequences, in that order."""
        if call.settled:
            if not hasattr(self.drafter, "settle"):
                raise LinkProtocolError("settled rows for a draft that takes no chained steps")
            self.drafter.settle({seq_id: rows for seq_id, rows in call.settled})
        for seq_id, reason in call.rejections:
            self.drafter.tree_rejected(seq_id, reason)
        for seq_id in call.finished:
            self.drafter.release(seq_id)
