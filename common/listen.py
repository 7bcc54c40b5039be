"""Binding a gRPC server to its address, exclusively.

gRPC servers set SO_REUSEPORT by default, so a second server on a port already in use starts
and the two split the requests between them. Ours turn it off and refuse an address in use;
a unix socket file that a live server still answers on is refused too, a stale one removed.
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import grpc

from common.errors import AddressInUseError, InvalidRequestError, UnsafeSocketFolderError

NO_PORT_SHARING = ("grpc.so_reuseport", 0)
UNIX_PATH_MAX = 107  # bytes of a unix socket's path (sockaddr_un.sun_path on Linux, its closing NUL aside)


def bind(server: grpc.Server, address: str, tls: grpc.ServerCredentials | None = None) -> int:
    """``server.add_insecure_port(address)``, or ``add_secure_port`` with ``tls``; raises
    AddressInUseError instead of sharing or failing late. Returns the bound port (the one chosen for port 0)."""
    if address.startswith("unix:"):
        _claim_unix_socket(address)
    else:
        _probe_tcp(address)
    try:
        port = server.add_secure_port(address, tls) if tls is not None else server.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if port == 0 and tls is not None:  # the address was free a moment ago: most likely gRPC refused the credentials
        raise InvalidRequestError("tls_cert", f"cannot listen on {address} with TLS: the certificate and key "
                                              "do not go together (another certificate's key?), or the address "
                                              "is not available")
    if port == 0:
        raise AddressInUseError(f"cannot listen on {address}: the address is in use or not available")
    return port


def _probe_tcp(address: str) -> None:
    """Bind the address once ourselves, so a port in use is reported before gRPC logs its own error."""
    host, _, port = address.rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return  # port 0 (any free port) or a form gRPC resolves itself
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, int(port), type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return  # gRPC reports an address it cannot resolve
    for family, kind, proto, _, where in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: TIME_WAIT is no conflict
            try:
                probe.bind(where)
            except OSError as exc:
                raise AddressInUseError(f"cannot listen on {address}: {exc.strerror.lower()}") from None


def default_internal_address() -> str:
    """The internal draft link's default socket, in a folder only this user can enter:
    ``$XDG_RUNTIME_DIR/eagle3/`` (a per-user runtime folder), else ``/tmp/eagle3-UID/``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    folder = Path(runtime) / "eagle3" if runtime else Path("/tmp") / f"eagle3-{os.getuid()}"
    return f"unix:{folder}/draft.sock"


def check_socket_folder(folder: Path) -> None:
    """Refuse a folder another user owns or may write to: they could replace the socket."""
    info = folder.stat()
    if info.st_uid != os.getuid():
        raise UnsafeSocketFolderError(f"{folder} belongs to uid {info.st_uid}, not to this user ({os.getuid()})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeSocketFolderError(f"{folder} is writable by other users (mode {stat.S_IMODE(info.st_mode):o}); "
                                      "use a folder only this user can write to")


def unix_socket_path(address: str) -> Path | None:
    """The file of a ``unix:PATH`` (or ``unix://PATH``) address; None for any other address."""
    return Path(address.removeprefix("unix:").removeprefix("//")) if address.startswith("unix:") else None


def _claim_unix_socket(address: str) -> None:
    """Create the socket's folder (owner-only) or check an existing one; remove a stale socket
    file, refuse a live one."""
    path = unix_socket_path(address)
    size = len(os.fsencode(path))
    if size > UNIX_PATH_MAX:  # gRPC would only log it and report the address as not available
        raise AddressInUseError(f"cannot listen on {address}: the socket path is {size} bytes, more than the "
                                f"{UNIX_PATH_MAX} a unix socket address holds; choose a shorter path "
                                "(or a shorter TMPDIR / XDG_RUNTIME_DIR)")
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_socket_folder(path.parent)
    if not path.exists():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:  # nobody answers: a socket file left by a process that is gone
        path.unlink()
        return
    finally:
        probe.close()
    raise AddressInUseError(f"cannot listen on {address}: another server is listening on that socket")
