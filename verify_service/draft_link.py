"""Verify side of the internal channel: the remote draft as a ``DraftProvider``.

The draft service dials in, handshakes (compatibility + shared buffers), then holds one
``Session`` stream (its lifecycle: ``draft_sessions.py``). Each engine step with something for
the draft becomes one ``StepCall``; the engine waits for the matching ``StepReply`` (bounded by a
timeout) and reads the trees from the shared tree buffers. A step travels one of two ways, chosen per session:

- the unix step socket (link/step_socket.py), when the internal link is a unix socket: the
  engine thread writes the step's frame and reads the answer itself, no other thread involved;
- the Session stream (a TCP link, or a draft that asks for it): ``VerifyMessage`` out through
  the stream's generator, ``StepResult`` back through the session's reader thread.

Shared buffers, exported once::

    features        [max_feature_rows, k * hidden]   target features of committed rows
    embedding       [vocab, hidden]                  the target's table (the model uses it too)
    tree_tokens     [max_trees, max_nodes] int64      written by the draft, slot per proposal
    tree_parents    [max_trees, max_nodes] int64      (the three tree buffers: host memory on
    tree_log_probs  [max_trees, max_nodes] float32     every device, built and read on the host)

    chain_feeds     [max_trees, depth + 2] int64      chained steps (below), on the device:
    chain_trees     [4, max_trees, max_nodes] int64    counts and tokens in, trees out

Chained steps (a draft that takes them on its step socket; ``DraftCoordinator.chains``): after
a step of trees alone the engine hands over what acceptance chose while it is still on the
device (``step_on_device``): the rows go into ``chain_feeds`` and ``features`` on this side's
stream, an IPC event marks them ready, and the step's frame goes out without a wait. The
draft's stream waits for that event, extends its cache and grows every next tree there, copies
them into ``chain_trees`` and records its own event; its answer only says so. The next step
waits for the answer (long there by then), makes its stream wait for the draft's event, and
verifies the trees from the device (``RemotePendingTrees``): neither host waits for the other's
device work, and the host commits while the draft runs. Those trees come from another process:
on the device each is checked and, if broken, replaced by a well-formed stand-in before
anything reads it (the kernel set's ``sanitize_trees``, one launch on CUDA; the host learns which with the copy of the
trees), so a faulty draft costs speculation, never an exact token or a read out of bounds.
Chained rows' committed counts reach the draft with the next frame (``settle``).

Without a session (no draft, or it died) ``step`` returns no trees: sequences decode one
token per step with exactly the same output. A new session only speculates for sequences
it has seen from their first row (the draft's cache must hold every committed row).
"""

from __future__ import annotations

import itertools
import logging
import queue
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch

from common.errors import LinkProtocolError
from common.tree_settings import TreeSettings
from kernels import REFERENCE, KernelSet
from link.convert import step_call_to_proto, step_reply_from_proto
from link.protocol import ChainCall, ChainedSeq, DraftFeed, FeedRows, ProposeRequest, StepCall, StepReply
from link.shared_buffers import BufferExporter
from link.step_frames import FrameLimits, StepFrames
from runtime.step_layout import Readback
from runtime.tree import CandidateTree, depths_of_rows, unpack_trees
from verify_service.draft_sessions import DraftSessions, Session

log = logging.getLogger(__name__)


class RemoteDraft(DraftSessions):
    def __init__(self, exporter: BufferExporter, buffers: dict[str, torch.Tensor], capture_layers: tuple[int, ...],
                 timeout_s: float, on_change=lambda connected: None, on_overhead=lambda seconds: None,
                 step_socket_folder: Path | None = None, chain_min_seqs: int = 1, kernels: KernelSet = REFERENCE):
        """``on_change(connected)``: a session came or went. ``on_overhead(seconds)``: each step's
        control-plane overhead (round trip minus the draft's compute), on the engine thread.
        ``step_socket_folder``: where to offer step sockets (the internal unix socket's folder;
        None: every session steps on its stream). ``chain_min_seqs``: the fewest sequences a chained step
        holds (smaller steps pass through the hosts). ``kernels``: the target's (the chained trees' check
        runs on its device)."""
        super().__init__(FrameLimits(buffers["tree_tokens"].shape[0], buffers["features"].shape[0]), timeout_s,
                         on_change, step_socket_folder)
        self.exporter, self.buffers = exporter, buffers
        self.kernels = kernels
        self.capture_layers = capture_layers
        self.chain_min_seqs = chain_min_seqs
        self._on_overhead = on_overhead
        self._frames = StepFrames(self.limits)  # the engine thread's, reused every step
        self._steps = itertools.count(1)
        self._finished: list[int] = []
        self.last_nodes: dict[TreeSettings, int] = {}  # nodes a chained tree of each shape held last
        self._rejected: list[tuple[int, str]] = []
        self._settled: list[tuple[int, int]] = []  # chained sequences' committed rows, for the next frame
        # Chained steps' IPC events (ready: rows written here; done: trees written there), made once and
        # kept while the server lives (a peer's opened handle must not outlive them); none off CUDA.
        cuda = buffers["features"].is_cuda
        self._events = tuple(torch.cuda.Event(interprocess=True) for _ in range(2)) if cuda else None
        self._chain_readback = Readback(buffers["features"].device)
        self.overhead_ns: deque[int] = deque(maxlen=1024)  # round trip minus the draft's compute
        self.draft_compute_ns: deque[int] = deque(maxlen=1024)  # the draft's own time per step, as it reports it

    def _forget(self) -> None:
        self._settled = []  # a new session knows none of the chained sequences

    # --- DraftProvider (engine thread) ------------------------------------------------------

    def release(self, seq_id: int) -> None:
        s = self._session
        if s is not None:  # without a session there is nothing to free (a new draft knows no old sequence)
            self._finished.append(seq_id)
            s.known.discard(seq_id)

    def tree_rejected(self, seq_id: int, reason: str) -> None:
        self._rejected.append((seq_id, reason))

    def step(self, feeds: list[DraftFeed], proposals: list[ProposeRequest]) -> dict[int, CandidateTree]:
        s = self._session
        if s is None or not s.alive:
            return {}
        finished, rejected, settled = self._backlog()
        fed = self._write_feeds(s, feeds)  # first: a sequence fed from its first row becomes known
        asked = [p for p in proposals if p.seq_id in s.known][:self.limits.max_seqs]
        call = StepCall(next(self._steps), fed, asked, finished, rejected, settled)
        start = time.perf_counter_ns()
        if self.buffers["features"].is_cuda:
            torch.cuda.synchronize()  # the draft reads the features from another process
        try:
            reply = self._exchange_stream(s, call) if s.step_socket is None else self._exchange_socket(s, call)
        except (LinkProtocolError, OSError) as exc:  # OSError: TimeoutError, a broken or closed socket
            self.drop(s, "no answer in time" if isinstance(exc, TimeoutError) else str(exc))
            return {}
        trees = self._read_trees(reply, asked)
        # The draft reports its own compute time: a bogus figure may not make the overhead negative.
        round_trip = time.perf_counter_ns() - start
        compute_ns = min(reply.draft_compute_ns, round_trip)  # no more than the round trip, whatever it says
        self.draft_compute_ns.append(compute_ns)
        overhead_ns = round_trip - compute_ns
        self.overhead_ns.append(overhead_ns)
        self._on_overhead(overhead_ns / 1e9)
        return trees

    def _backlog(self) -> tuple[list, list, list]:
        """What waits for the next frame: finished sequences, refused trees, settled rows (as many of each
        as one frame carries; the rest goes with the one after)."""
        cap = self.limits.max_seqs
        finished, self._finished = self._finished[:cap], self._finished[cap:]
        rejected, self._rejected = self._rejected[:cap], self._rejected[cap:]
        settled, self._settled = self._settled[:cap], self._settled[cap:]
        return finished, rejected, settled

    # --- chained steps (engine thread) ------------------------------------------------------

    def chain_event_handles(self) -> tuple[bytes, bytes]:
        """The IPC handles of the chained steps' events (ready, done) for a handshake; empty off CUDA."""
        return (b"", b"") if self._events is None else tuple(bytes(e.ipc_handle()) for e in self._events)

    def chainable(self, seq_ids: list[int]) -> bool:
        """Whether a chained step of these sequences can go to the live session: one that takes them,
        knows every sequence, and has room for them in one frame; at least ``chain_min_seqs`` of them."""
        s = self._session
        return s is not None and s.alive and s.chained and self.chain_min_seqs <= len(seq_ids) \
            and len(seq_ids) <= self.limits.max_seqs and all(i in s.known for i in seq_ids)

    def step_on_device(self, seq_ids: list[int], starts: list[int], most: list[int], counts: torch.Tensor,
                       tokens: torch.Tensor, features: torch.Tensor, settings: TreeSettings) -> "RemotePendingTrees":
        """``EagleDrafter.step_on_device`` across the link: the rows into the chain buffers (queued on this
        side's stream), the ready event, the frame; nothing waits. ``counts`` [B], ``tokens`` [B, W],
        ``features`` [B, W, width], on the device. The trees come with the next step
        (``RemotePendingTrees``); ``settle`` follows once the counts are known on the host."""
        s = self._session
        B, W = tokens.shape
        feeds, rows = self.buffers["chain_feeds"], self.buffers["features"]
        if not self.chainable(seq_ids) or W + 1 > feeds.shape[1] or B * W > rows.shape[0]:
            return RemotePendingTrees(self, None, None, settings)
        feeds[:B, 0].copy_(counts)
        feeds[:B, 1:W + 1].copy_(tokens)
        rows[:B * W].copy_(features.reshape(B * W, -1))
        if self._events is not None:
            self._events[0].record()
        finished, rejected, settled = self._backlog()
        call = ChainCall(next(self._steps), [ChainedSeq(*q) for q in zip(seq_ids, starts, most)], W, settings,
                         finished, rejected, settled)
        sock = s.step_socket
        try:
            if sock.waiting():  # before we asked: a frame nobody asked for, or the draft's close
                sock.recv()
                raise LinkProtocolError("the draft sent results nobody asked for")
            sock.send(self._frames.encode_chain(call))
        except (LinkProtocolError, OSError) as exc:
            self.drop(s, str(exc))
            return RemotePendingTrees(self, None, None, settings)
        return RemotePendingTrees(self, s, call, settings, time.perf_counter_ns())

    def settle(self, rows: dict[int, int]) -> None:
        """The committed rows of a chained step's sequences, for the draft with the next frame."""
        s = self._session
        if s is not None and s.alive:
            self._settled.extend(rows.items())

    def _chain_answer(self, s: Session, call: ChainCall, settings: TreeSettings,
                      sent_ns: int) -> tuple[torch.Tensor, int] | None:
        """Wait for chained step ``call``'s answer, queue this side's wait for the draft's trees and their
        check on the device, and start their copy to the host. Returns the checked trees [4, B, n] and
        the copy's ticket; None when the session failed (then ended). ``sent_ns``: when the call went."""
        start = time.perf_counter_ns()
        B = len(call.seqs)
        try:
            reply = self._frames.decode_chain_reply(s.step_socket.recv(), call.step_id)
            n = reply.num_nodes
            if reply.num_trees != B or not 1 <= n <= min(settings.node_budget, self.buffers["chain_trees"].shape[2]):
                raise LinkProtocolError(f"chained step {call.step_id}: {reply.num_trees} trees of {n} nodes for "
                                        f"{B} sequences of at most {settings.node_budget}")
        except (LinkProtocolError, OSError) as exc:
            self.drop(s, "no answer in time" if isinstance(exc, TimeoutError) else str(exc))
            return None
        self.last_nodes[settings] = n
        now = time.perf_counter_ns()
        waited = now - start  # the link's cost on this step: any wait for the answer
        self.overhead_ns.append(waited)
        self.draft_compute_ns.append(min(reply.draft_compute_ns, now - sent_ns))  # its host's time to queue the step
        self._on_overhead(waited / 1e9)
        if self._events is not None:
            torch.cuda.current_stream(self.buffers["features"].device).wait_event(self._events[1])
        # Read once, checked, copied: every later read sees the same bytes, whatever the peer writes.
        checked = self.kernels.sanitize_trees(self.buffers["chain_trees"][:, :B, :n],
                                              self.buffers["embedding"].shape[0], settings.depth)
        return checked[:4 * B * n].view(4, B, n), self._chain_readback.start(checked)  # (trees, then valid flags)

    def _chain_trees(self, call: ChainCall, trees: torch.Tensor, ticket: int) -> dict[int, CandidateTree]:
        """The checked trees of ``_chain_answer`` on the host, by sequence; a stand-in for a broken tree
        counts as an error and is reported to the draft."""
        _, B, n = trees.shape
        host = self._chain_readback.wait(ticket)
        valid = host[4 * B * n:]
        out = {}
        for j, (q, tree) in enumerate(zip(call.seqs, unpack_trees(host[:4 * B * n].reshape(4, B, n)))):
            out[q.seq_id] = tree
            if not valid[j]:
                self.errors += 1
                log.warning("sequence %d: the draft's chained tree broke the tree invariants; a stand-in was verified",
                            q.seq_id)
                self.tree_rejected(q.seq_id, "a chained tree that breaks the tree invariants")
        return out

    def _exchange_stream(self, s: Session, call: StepCall) -> StepReply:
        s.outgoing.put(step_call_to_proto(call))
        try:
            result = s.results.get(timeout=self.timeout_s)
        except queue.Empty:
            raise TimeoutError("no answer in time") from None
        if result is None:
            raise ConnectionError("the session ended")
        if result.step_id != call.step_id:
            raise LinkProtocolError("answered another step")
        return step_reply_from_proto(result)

    def _exchange_socket(self, s: Session, call: StepCall) -> StepReply:
        sock = s.step_socket
        if sock.waiting():  # before we asked: a frame nobody asked for, or the draft's close
            sock.recv()  # ConnectionError for a close
            raise LinkProtocolError("the draft sent results nobody asked for")
        sock.send(self._frames.encode_call(call))
        return self._frames.decode_reply(sock.recv(), call.step_id)

    def overhead_percentiles_us(self) -> tuple[float, float]:
        """p50 and p99 of the per-step control-plane overhead, in microseconds."""
        return _percentiles_us(self.overhead_ns)

    def draft_compute_percentiles_us(self) -> tuple[float, float]:
        """p50 and p99 of the draft's own time per step as it reports it (a chained step's: its host's
        time to queue the step's work), in microseconds."""
        return _percentiles_us(self.draft_compute_ns)

    def _write_feeds(self, s: Session, feeds: list[DraftFeed]) -> list[FeedRows]:
        features = self.buffers["features"]
        rows, parts, row = [], [], 0
        for f in feeds:
            if f.start == 0:
                s.known.add(f.seq_id)
            n = f.features.shape[0]
            if f.seq_id not in s.known:
                continue
            if row + n > features.shape[0]:  # sized for a full step; never expected
                s.known.discard(f.seq_id)
                log.error("features buffer full; sequence %d stops speculating", f.seq_id)
                continue
            parts.append(f.features)
            rows.append(FeedRows(f.seq_id, f.start, row, np.asarray(f.next_tokens)))
            row += n
        if len(parts) > 1:
            torch.cat(parts, out=features[:row])  # one copy for the step's rows, not one per sequence
        elif parts:
            features[:row].copy_(parts[0])
        return rows

    def _read_trees(self, reply: StepReply, asked: list[ProposeRequest]) -> dict[int, CandidateTree]:
        if not reply.trees:
            return {}
        n = len(asked)
        # Host memory the draft process writes: copied out once (the trees checked and used later
        # must be the ones read here, whatever the peer writes meanwhile).
        tokens, parents, log_probs = (np.array(self.buffers[name][:n].numpy())
                                      for name in ("tree_tokens", "tree_parents", "tree_log_probs"))
        width = tokens.shape[1]
        depths = depths_of_rows(parents)  # every slot's at once: a pass per level, not per tree
        trees = {}
        for ref in reply.trees:
            slot, k = ref.tree_slot, ref.num_nodes
            if slot >= n or asked[slot].seq_id != ref.seq_id or k > width:
                self.errors += 1
                self.tree_rejected(ref.seq_id, f"tree reference (slot {slot}, {k} nodes) outside the step's slots")
                continue
            trees[ref.seq_id] = CandidateTree(tokens[slot, :k].astype(np.int64, copy=False), parents[slot, :k],
                                              depths[slot, :k], log_probs[slot, :k])
        return trees


def _percentiles_us(values: deque[int]) -> tuple[float, float]:
    """p50 and p99 of nanosecond figures, in microseconds (0, 0 for none)."""
    if not values:
        return 0.0, 0.0
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e3  # noqa: E731
    return pick(0.5), pick(0.99)


class RemotePendingTrees:
    """A chained step's trees, grown by the draft service (``RemoteDraft.step_on_device``), as
    ``drafter.PendingTrees`` offers them: ``on_device`` (the checked trees, int64 [4, B, n], queued
    behind the draft's work on this side's stream) and ``collect()`` (by sequence, on the host). The
    first of the two waits for the draft's answer; a failed session gives None and no trees."""

    outlives_next_draft = True  # the copy is the verify side's own until the next answer: collect after the next call

    def __init__(self, remote: RemoteDraft, session: Session | None, call: ChainCall | None, settings: TreeSettings,
                 sent_ns: int = 0):
        self.seq_ids = [q.seq_id for q in call.seqs] if call is not None else []
        self._remote, self._session, self._call, self._settings = remote, session, call, settings
        self._sent_ns = sent_ns
        self._answer = None  # (trees, ticket) once answered
        self._answered = call is None
        self.trees: dict[int, CandidateTree] | None = None

    @property
    def nodes_hint(self) -> int | None:
        """How many nodes each tree should hold, before the answer: the last answer's for this shape
        (None before the first). The answer has the last word (``on_device``)."""
        return self._remote.last_nodes.get(self._settings)

    @property
    def on_device(self) -> torch.Tensor | None:
        self._wait()
        return None if self._answer is None else self._answer[0]

    def collect(self) -> dict[int, CandidateTree]:
        if self.trees is None:
            self._wait()
            self.trees = {} if self._answer is None else self._remote._chain_trees(self._call, *self._answer)
        return self.trees

    def _wait(self) -> None:
        if not self._answered:
            self._answered = True
            self._answer = self._remote._chain_answer(self._session, self._call, self._settings, self._sent_ns)
