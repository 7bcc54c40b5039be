"""Verify side of the internal channel: the remote draft as a ``DraftProvider``.

The draft service dials in, handshakes (compatibility + shared buffers), then holds one
``Session`` stream. Each engine step with something for the draft becomes one
``VerifyMessage``; the engine waits for the matching ``StepResult`` (bounded by a timeout)
and reads the trees from the shared tree buffers. Shared buffers, exported once::

    features        [max_feature_rows, k * hidden]   target features of committed rows
    embedding       [vocab, hidden]                  the target's table (the model uses it too)
    tree_tokens     [max_trees, max_nodes] int64      written by the draft, slot per proposal
    tree_parents    [max_trees, max_nodes] int64
    tree_log_probs  [max_trees, max_nodes] float32

Without a session (no draft, or it died) ``step`` returns no trees: sequences decode one
token per step with exactly the same output. A new session only speculates for sequences
it has seen from their first row (the draft's cache must hold every committed row).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from link.convert import settings_to_proto
from link.protocol import DraftFeed, ProposeRequest
from link.shared_buffers import BufferExporter
from protos.eagle3.v1 import draft_link_pb2 as pb
from runtime.tree import CandidateTree

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Session:
    session_id: int
    outgoing: queue.Queue = field(default_factory=queue.Queue)  # VerifyMessage, or None to end (one per step)
    # StepResult, or None when the peer left. The engine asks one step at a time, so one result
    # at most waits (plus the end marker): a draft sending more floods the link and is dropped.
    results: queue.Queue = field(default_factory=lambda: queue.Queue(2))
    known: set[int] = field(default_factory=set)  # sequences fed from their first row
    alive: bool = False


class RemoteDraft:
    def __init__(self, exporter: BufferExporter, buffers: dict[str, torch.Tensor], capture_layers: tuple[int, ...],
                 timeout_s: float, on_change=lambda connected: None, on_overhead=lambda seconds: None):
        """``on_change(connected)``: a session came or went. ``on_overhead(seconds)``: each step's
        control-plane overhead (round trip minus the draft's compute), on the engine thread."""
        self.exporter, self.buffers = exporter, buffers
        self.capture_layers = capture_layers
        self.timeout_s = timeout_s
        self._on_change, self._on_overhead = on_change, on_overhead
        self._lock = threading.Lock()
        self._session: Session | None = None
        self._ids = itertools.count(1)
        self._steps = itertools.count(1)
        self._finished: list[int] = []
        self._rejected: list[tuple[int, str]] = []
        self.sessions_opened = 0
        self.errors = 0  # sessions lost (crash, timeout, broken stream; not a clean close), unusable tree references
        self.overhead_ns: deque[int] = deque(maxlen=1024)  # round trip minus the draft's compute

    @property
    def connected(self) -> bool:
        s = self._session
        return s is not None and s.alive

    # --- session lifecycle (gRPC threads) --------------------------------------------------

    def new_session(self) -> Session:
        return Session(next(self._ids))

    def activate(self, session: Session) -> bool:
        """Make ``session`` the live one, unless another is alive (one draft at a time: a second
        process cannot take the link over). Returns whether it became live."""
        with self._lock:
            if self._session is not None and self._session.alive:
                return False
            self._session = session
            session.alive = True
            self.sessions_opened += 1
        log.info("draft session %d connected", session.session_id)
        self._on_change(True)
        return True

    def deliver(self, session: Session, result: pb.StepResult) -> bool:
        """Queue a step's result (called by the session's one reader thread). A second result
        while one still waits is a flood: the session is dropped and False returned."""
        if not session.results.empty():
            self.drop(session, "the draft sent results nobody asked for")
            return False
        session.results.put_nowait(result)
        return True

    def drop(self, session: Session, reason: str, clean: bool = False) -> None:
        """End ``session``. ``clean``: the draft closed the link itself (its normal shutdown), which
        is no warning; any other end (a crash, a timeout, a broken stream) is."""
        with self._lock:
            if self._session is session:
                self._session = None
            was_alive, session.alive = session.alive, False
        self._end(session)
        if was_alive and not clean:
            self.errors += 1  # a lost session: the draft crashed, hung or broke its stream
        if was_alive:
            log.log(logging.INFO if clean else logging.WARNING, "draft session %d ended: %s; decoding without "
                    "speculation", session.session_id, reason)
            self._on_change(self.connected)

    def close(self) -> None:
        """Shutdown: end the live session from this side (the draft sees its stream end and waits
        for a new verify service), so stopping the server need not wait out the stream."""
        s = self._session
        if s is not None:
            self.drop(s, "the verify service is shutting down", clean=True)

    @staticmethod
    def _end(session: Session) -> None:
        session.outgoing.put(None)
        try:
            session.results.put_nowait(None)
        except queue.Full:  # a flooded queue: the engine finds results, then the session gone
            pass

    # --- DraftProvider (engine thread) ------------------------------------------------------

    def release(self, seq_id: int) -> None:
        self._finished.append(seq_id)
        s = self._session
        if s is not None:
            s.known.discard(seq_id)

    def tree_rejected(self, seq_id: int, reason: str) -> None:
        self._rejected.append((seq_id, reason))

    def step(self, feeds: list[DraftFeed], proposals: list[ProposeRequest]) -> dict[int, CandidateTree]:
        s = self._session
        if s is None or not s.alive:
            return {}
        msg = pb.VerifyMessage(step_id=next(self._steps), finished_seq_ids=self._finished)
        msg.rejected_trees.extend(pb.TreeRejection(seq_id=i, reason=r) for i, r in self._rejected)
        self._finished, self._rejected = [], []
        self._write_feeds(s, feeds, msg)
        asked = [p for p in proposals if p.seq_id in s.known][: self.buffers["tree_tokens"].shape[0]]
        for slot, p in enumerate(asked):
            msg.proposals.add(seq_id=p.seq_id, max_depth=p.max_depth, tree_slot=slot,
                              settings=settings_to_proto(p.settings))
        start = time.perf_counter_ns()
        if self.buffers["features"].is_cuda:
            torch.cuda.synchronize()  # the draft reads the features from another process
        s.outgoing.put(msg)
        try:
            result = s.results.get(timeout=self.timeout_s)
        except queue.Empty:
            result = None
        if result is None or result.step_id != msg.step_id:
            self.drop(s, "no answer in time" if result is None else "answered another step")
            return {}
        trees = self._read_trees(result, asked)
        # The draft reports its own compute time: a bogus figure may not make the overhead negative.
        overhead_ns = max(0, time.perf_counter_ns() - start - min(result.draft_compute_ns, 2**62))
        self.overhead_ns.append(overhead_ns)
        self._on_overhead(overhead_ns / 1e9)
        return trees

    def overhead_percentiles_us(self) -> tuple[float, float]:
        """p50 and p99 of the per-step control-plane overhead, in microseconds."""
        if not self.overhead_ns:
            return 0.0, 0.0
        ordered = sorted(self.overhead_ns)
        pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e3  # noqa: E731
        return pick(0.5), pick(0.99)

    def _write_feeds(self, s: Session, feeds: list[DraftFeed], msg: pb.VerifyMessage) -> None:
        features = self.buffers["features"]
        row = 0
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
            features[row:row + n].copy_(f.features)
            msg.feeds.add(seq_id=f.seq_id, start_position=f.start, buffer_row=row,
                          next_tokens=np.asarray(f.next_tokens).tolist())
            row += n

    def _read_trees(self, result: pb.StepResult, asked: list[ProposeRequest]) -> dict[int, CandidateTree]:
        if not result.trees:
            return {}
        n = len(asked)
        tokens = self.buffers["tree_tokens"][:n].cpu().numpy()  # one copy of each tree buffer per step
        parents = self.buffers["tree_parents"][:n].cpu().numpy()
        log_probs = self.buffers["tree_log_probs"][:n].cpu().numpy()
        width = tokens.shape[1]
        trees = {}
        for ref in result.trees:
            slot, k = ref.tree_slot, ref.num_nodes
            if slot >= n or asked[slot].seq_id != ref.seq_id or k > width:
                self.errors += 1
                self.tree_rejected(ref.seq_id, f"tree reference (slot {slot}, {k} nodes) outside the step's slots")
                continue
            trees[ref.seq_id] = CandidateTree.from_lists(tokens[slot, :k], parents[slot, :k], log_probs=log_probs[slot, :k])
        return trees
