"""The draft link's sessions, on the verify side: one draft at a time, from its handshake to its end.

The gRPC threads drive this part of ``RemoteDraft`` (``draft_link.py``): a handshake makes a pending
session (only the newest handshake's may open), its stream claims it, the draft's choice of step
transport accepts its step socket or withdraws the offer, and ``activate`` makes it the live one unless
another is alive (a second process cannot take the link over). ``drop`` ends a session; only a clean
close by the draft is no error. The engine thread reads ``_session`` and ``connected`` without the lock.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import LinkProtocolError
from link.step_frames import FrameLimits
from link.step_socket import StepListener, StepSocket, remove_stale
from protos.eagle3.v1 import draft_link_pb2 as pb

log = logging.getLogger(__name__)
ACCEPT_TIMEOUT_S = 5.0  # the draft connects to its step socket before it opens the stream


@dataclass(eq=False)
class Session:
    session_id: int
    outgoing: queue.Queue = field(default_factory=queue.Queue)  # VerifyMessage (stream steps), or None to end
    # StepResult, or None when the peer left. The engine asks one step at a time, so one result
    # at most waits (plus the end marker): a draft sending more floods the link and is dropped.
    results: queue.Queue = field(default_factory=lambda: queue.Queue(2))
    known: set[int] = field(default_factory=set)  # sequences fed from their first row
    alive: bool = False
    listener: StepListener | None = None  # the step socket offered at the handshake, until accepted
    step_socket: StepSocket | None = None  # the accepted step socket (None: steps on the stream)
    chained: bool = False  # the draft takes chained steps on its step socket



class DraftSessions:
    def __init__(self, limits: FrameLimits, timeout_s: float, on_change=lambda connected: None,
                 step_socket_folder: Path | None = None):
        """``limits``: what one step frame carries (a step socket is offered only where they fit it).
        ``on_change(connected)``: a session came or went. ``step_socket_folder``: where to offer step
        sockets (None: every session steps on its stream)."""
        self.limits, self.timeout_s, self._on_change = limits, timeout_s, on_change
        self.step_socket_folder = step_socket_folder if limits.fit_socket else None
        if step_socket_folder is not None and not limits.fit_socket:
            log.info("step frames of up to %d bytes: the draft steps on the Session stream", limits.call_bytes)
        if self.step_socket_folder is not None:
            remove_stale(self.step_socket_folder)
        self._lock = threading.Lock()
        self._session: Session | None = None
        self._pending: Session | None = None  # the newest handshake's, until its stream opens
        self._ids = itertools.count(1)
        self.sessions_opened = 0
        self.errors = 0  # sessions lost (crash, timeout, broken stream; not a clean close), unusable tree references

    @property
    def connected(self) -> bool:
        s = self._session
        return s is not None and s.alive

    def _forget(self) -> None:
        """What the live session knew, dropped with it (under the lock)."""

    def new_session(self, step_socket: bool = False) -> Session:
        """A session for a handshake, pending until its stream opens (only the newest handshake's
        may); with ``step_socket``, a step socket is offered to it when this link can."""
        session = Session(next(self._ids))
        if step_socket and self.step_socket_folder is not None:
            try:
                session.listener = StepListener(self.step_socket_folder, session.session_id)
            except OSError as exc:
                log.warning("no step socket for draft session %d (%s); it steps on its stream", session.session_id, exc)
        with self._lock:
            replaced, self._pending = self._pending, session
        if replaced is not None:
            self._end(replaced)
        return session

    def claim(self, session_id: int) -> Session | None:
        """The pending session ``session_id`` (taken: a second stream cannot open it), or None."""
        with self._lock:
            session = self._pending
            if session is None or session.session_id != session_id:
                return None
            self._pending = None
        return session

    def open_step_socket(self, session: Session, chosen: bool) -> None:
        """The draft chose its step transport in its SessionOpen: accept its step socket (it connects
        before it opens the stream), or withdraw the offer. Raises LinkProtocolError."""
        listener, session.listener = session.listener, None
        if not chosen:
            if listener is not None:
                listener.close()
            return
        if listener is None:
            raise LinkProtocolError("the draft chose a step socket it was not offered")
        try:
            session.step_socket = listener.accept(ACCEPT_TIMEOUT_S, self.limits.reply_bytes, self.limits.call_bytes,
                                                  self.timeout_s)
        except OSError as exc:
            raise LinkProtocolError(f"step socket: no draft connected and said hello in time ({exc})") from exc

    def activate(self, session: Session) -> bool:
        """Make ``session`` the live one, unless another is alive (one draft at a time: a second
        process cannot take the link over). Returns whether it became live."""
        with self._lock:
            if self._session is not None and self._session.alive:
                return False
            self._session = session
            session.alive = True
            self.sessions_opened += 1
        log.info("draft session %d connected (steps on its %s)", session.session_id,
                 "stream" if session.step_socket is None else "step socket")
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
                self._forget()
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
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            self._end(pending)
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
        for channel in (session.listener, session.step_socket):
            if channel is not None:
                channel.close()  # a step socket's shutdown wakes the engine thread waiting on it
