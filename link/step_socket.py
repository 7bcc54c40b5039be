"""The unix step socket: a draft session's per-step channel beside the internal gRPC socket.

gRPC stays the session's control channel (handshake, stream, errors, reconnect); each step
is one frame each way (link/step_frames.py) on a SOCK_SEQPACKET unix socket, written and read
by the engine thread and the draft's worker thread themselves: no thread hand-offs, no
per-step allocation, and the kernel keeps frame boundaries and bounds what waits unread.

Who may connect, in layers: the socket lives in the internal socket's folder (owner-only,
checked at bind), its file is made 0600 before it listens, the connecting process must run as
this user (SO_PEERCRED), and its first frame must carry the random token the verify side sent
that session's handshake. It takes one connection and is removed once connected, or when the
session ends or a newer handshake replaces it.
"""

from __future__ import annotations

import hmac
import os
import secrets
import select
import socket
import struct
import threading
from pathlib import Path

from common.errors import LinkProtocolError
from link.step_frames import HELLO, TOKEN_BYTES, hello_frame, hello_token

MAX_PATH_BYTES = 107  # sun_path holds 108 bytes with the terminating NUL


def supported() -> bool:
    """SOCK_SEQPACKET unix sockets with peer credentials: Linux."""
    return hasattr(socket, "SOCK_SEQPACKET") and hasattr(socket, "SO_PEERCRED") and hasattr(socket, "AF_UNIX")


class StepSocket:
    """One end of a connected step socket: ``send`` a frame, ``recv`` the next one into a buffer
    allocated once. ``shutdown`` (any thread) wakes a blocked ``recv``; one lock per call keeps
    ``close`` from releasing the descriptor under a call in flight."""

    def __init__(self, sock: socket.socket, recv_limit: int, send_limit: int, timeout_s: float | None):
        """``recv_limit``/``send_limit``: the largest frame either way; ``timeout_s``: for every
        ``recv`` (None: wait for ever, the draft waiting for the next step)."""
        self._sock = sock
        self._buf = bytearray(recv_limit + 1)  # one byte more: a longer frame is seen, not cut
        self._view = memoryview(self._buf)
        self._lock = threading.Lock()
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        try:  # a frame must fit in the sender's buffer (unix sockets queue against it)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 2 * send_limit + 4096)
        except OSError:
            pass
        sock.settimeout(timeout_s)

    @classmethod
    def connect(cls, path: Path, token: bytes, recv_limit: int, send_limit: int) -> "StepSocket":
        """The draft's end: connect to ``path`` and present ``token``."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.settimeout(10)
            sock.connect(str(path))
            sock.sendall(hello_frame(token))
        except BaseException:
            sock.close()
            raise
        return cls(sock, recv_limit, send_limit, timeout_s=None)

    def send(self, frame) -> None:
        with self._lock:
            self._sock.send(frame)

    def recv(self) -> memoryview:
        """The next frame (a view of this socket's buffer, valid until the next call). Raises
        ConnectionError when the peer closed, LinkProtocolError for a frame over the limit,
        TimeoutError when none came in time."""
        with self._lock:
            n = self._sock.recv_into(self._buf)
        if n == 0:
            raise ConnectionError("the peer closed its step socket")
        if n == len(self._buf):
            raise LinkProtocolError(f"step socket: a frame over the {n - 1}-byte limit")
        return self._view[:n]

    def waiting(self) -> bool:
        """Whether something arrived that nobody read yet (a frame, or the peer's close)."""
        with self._lock:
            if self._sock.fileno() < 0:  # closed by another thread: its number may belong to another file now
                raise ConnectionError("the step socket is closed")
            return bool(self._poll.poll(0))

    def shutdown(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # not connected any more, or closed already
            pass

    def close(self) -> None:
        self.shutdown()
        with self._lock:
            self._sock.close()


class StepListener:
    """The verify side's offer of a step socket to one session (see the module docstring)."""

    def __init__(self, folder: Path, session_id: int):
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.path = folder / f"step-{os.getpid()}-{session_id}.sock"
        if len(os.fsencode(self.path)) > MAX_PATH_BYTES:
            raise OSError(f"{self.path}: longer than a unix socket path may be")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.path.unlink(missing_ok=True)  # left by a process of this pid that died: the pid is ours now
            self._sock.bind(str(self.path))
            os.chmod(self.path, 0o600)  # before listen(): until then every connect is refused
            self._sock.listen(1)
        except BaseException:
            self.close()
            raise

    def accept(self, timeout_s: float, recv_limit: int, send_limit: int, step_timeout_s: float) -> StepSocket:
        """The one connection, once it runs as this user and has sent this session's token; the
        listener is closed and its file removed either way. Raises LinkProtocolError or OSError
        (TimeoutError when nobody connected or said hello in time)."""
        try:
            self._sock.settimeout(timeout_s)
            conn, _ = self._sock.accept()
        finally:
            self.close()
        try:
            _check_peer(conn)
            conn.settimeout(timeout_s)
            token = hello_token(conn.recv(HELLO.size + 1))
            if not hmac.compare_digest(token, self.token):
                raise LinkProtocolError("step socket: wrong session token")
        except BaseException:
            conn.close()
            raise
        return StepSocket(conn, recv_limit, send_limit, step_timeout_s)

    def close(self) -> None:
        self._sock.close()
        self.path.unlink(missing_ok=True)


def remove_stale(folder: Path) -> None:
    """Remove offers left in ``folder`` by processes that are gone (killed before they could)."""
    for path in folder.glob("step-*-*.sock"):
        pid = path.name.split("-")[1]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except OSError:  # alive, as another user: not ours to remove
            pass


def _check_peer(conn: socket.socket) -> None:
    """The peer runs as this user (the folder already keeps others out; this does not rely on it)."""
    _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    if uid != os.getuid():
        raise LinkProtocolError(f"step socket: the peer runs as uid {uid}, not as this user ({os.getuid()})")
