"""The internal socket's folder is trusted only when this user alone can write to it."""

import os
from concurrent import futures

import grpc
import pytest

from common.errors import AddressInUseError, UnsafeSocketFolderError
from common.listen import bind, default_internal_address


def bind_in(folder) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    try:
        bind(server, f"unix:{folder}/draft.sock")
    finally:
        server.stop(0)


def test_a_folder_others_may_write_to_is_refused(tmp_path):
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(UnsafeSocketFolderError, match="writable by other users"):
        bind_in(folder)
    folder.chmod(0o755)
    bind_in(folder)  # the same folder, once only its owner may write


@pytest.mark.skipif(os.getuid() != 0, reason="giving a folder to another user needs root")
def test_a_folder_another_user_owns_is_refused(tmp_path):
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o755)
    os.chown(folder, 65534, 65534)
    with pytest.raises(UnsafeSocketFolderError, match="belongs to uid 65534"):
        bind_in(folder)


def test_the_default_socket_lives_in_a_per_user_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_internal_address() == f"unix:{tmp_path}/eagle3/draft.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_internal_address() == f"unix:/tmp/eagle3-{os.getuid()}/draft.sock"


def test_a_socket_path_too_long_for_a_unix_address_is_refused_by_its_length(tmp_path):
    """A path past the 107 bytes a unix socket address holds is refused with its length, not as an
    address in use (gRPC itself would only log it); one of exactly 107 bytes binds."""
    short = tmp_path / "s"
    short.mkdir(mode=0o700)
    room = 107 - len(os.fsencode(short)) - 1  # the file name's bytes that fit after "<short>/"
    assert room > 5, "the test's temporary folder is too deep for this test"
    with pytest.raises(AddressInUseError, match="the socket path is 108 bytes, more than the 107"):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
        try:
            bind(server, f"unix:{short}/{'x' * (room + 1)}")
        finally:
            server.stop(0)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    try:
        bind(server, f"unix:{short}/{'x' * room}")
    finally:
        server.stop(0)
