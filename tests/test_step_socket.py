"""The unix step socket's frames and sockets, in one process: frames round-trip, every size a
peer sends is checked before use (hand-written and fuzzed frames), and a socket takes one
connection, owner-only, that must say hello with its session's token."""

import os
import socket
import stat
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.errors import LinkProtocolError
from common.tree_settings import TreeSettings
from link import step_socket
from link.protocol import ChainCall, ChainedSeq, ChainReply, FeedRows, ProposeRequest, StepCall, StepReply, TreeRef
from link.step_frames import (CALL_HEADER, CHAIN_HEADER, FEED, HELLO_MAGIC, MAX_REASON_BYTES, PROPOSAL, FrameLimits,
                              StepFrames, hello_frame)
from link.step_socket import StepListener, StepSocket

pytestmark = pytest.mark.skipif(not step_socket.supported(), reason="SOCK_SEQPACKET and SO_PEERCRED: Linux")
LIMITS = FrameLimits(max_seqs=4, max_rows=32)
fuzz = settings(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))


def a_call(step_id=7) -> StepCall:
    return StepCall(step_id, [FeedRows(3, 0, 0, np.array([5, 6, 7])), FeedRows(2**40, 12, 3, np.array([96]))],
                    [ProposeRequest(3, 4), ProposeRequest(2**40, 2, TreeSettings("dynamic", 3, 2, 5)),
                     ProposeRequest(9, 1, TreeSettings("chain", 2))],
                    [1, 2**63], [(4, "parent after child"), (5, "é" * 150)], [(3, 17), (2**40, 2**32 - 1)])


def encoded(call: StepCall) -> bytearray:
    return bytearray(StepFrames(LIMITS).encode_call(call))


def a_chain(step_id=9) -> ChainCall:
    return ChainCall(step_id, [ChainedSeq(3, 40, 8), ChainedSeq(2**40, 0, 1)], 8, TreeSettings("dynamic", 7, 10, 59),
                     [2**63], [(4, "a token outside the vocabulary")], [(3, 40), (6, 12)])


def encoded_chain(call: ChainCall) -> bytearray:
    return bytearray(StepFrames(LIMITS).encode_chain(call))


def test_a_step_and_its_reply_round_trip():
    call = StepFrames(LIMITS).decode_call(memoryview(encoded(a_call())))
    want = a_call()
    assert (call.step_id, call.proposals, call.finished) == (want.step_id, want.proposals, want.finished)
    assert [(f.seq_id, f.start, f.buffer_row, f.next_tokens.tolist()) for f in call.feeds] == \
        [(f.seq_id, f.start, f.buffer_row, f.next_tokens.tolist()) for f in want.feeds]
    assert call.feeds[0].next_tokens.dtype == np.int64
    assert call.rejections[0] == (4, "parent after child")
    assert call.rejections[1][1] == "é" * (MAX_REASON_BYTES // 2)  # cut on a character boundary
    assert call.settled == want.settled
    empty = StepFrames(LIMITS).decode_call(memoryview(encoded(StepCall(1, [], [], [], []))))
    assert empty == StepCall(1, [], [], [], [])
    reply = StepReply(7, [TreeRef(3, 0, 4), TreeRef(2**40, 1, 60)], 2**63 - 1)
    frame = StepFrames(LIMITS).encode_reply(reply)
    assert StepFrames(LIMITS).decode_reply(frame, 7) == reply


def test_a_reply_to_another_step_or_past_the_limits_is_refused():
    frames = StepFrames(LIMITS)
    frame = bytes(frames.encode_reply(StepReply(7, [TreeRef(3, 0, 4)], 1)))
    with pytest.raises(LinkProtocolError, match="another step"):
        frames.decode_reply(memoryview(frame), 8)
    big = bytes(StepFrames(FrameLimits(8, 32)).encode_reply(StepReply(7, [TreeRef(i, i, 1) for i in range(5)], 1)))
    with pytest.raises(LinkProtocolError, match="claiming 5 trees"):
        frames.decode_reply(memoryview(big), 7)
    for bad in (frame[:-1], frame + b"\0", b"E3SC" + frame[4:], b""):
        with pytest.raises(LinkProtocolError):
            frames.decode_reply(memoryview(bad), 7)


def patched(frame: bytearray, offset: int, fmt: str, value: int) -> bytearray:
    """``frame`` with one field at ``offset`` overwritten."""
    import struct
    struct.pack_into(fmt, frame, offset, value)
    return frame


FEED0 = CALL_HEADER.size  # the first feed record
PROPOSAL0 = CALL_HEADER.size + 2 * FEED.size


@pytest.mark.parametrize("corrupt, message", [
    (lambda f: f[:-1], "counts say"),
    (lambda f: f + b"\0", "counts say"),
    (lambda f: b"XXXX" + f[4:], "not a step"),
    (lambda f: f[:10], "not a step"),
    (lambda f: patched(f, 4, "<I", 1), "version 1"),
    (lambda f: patched(f, 40, "<I", 5), "exceeds the limits"),  # 5 settled, the limit is 4
    (lambda f: patched(f, 16, "<I", 5), "exceeds the limits"),  # 5 feeds, the limit is 4
    (lambda f: patched(f, 32, "<I", 33), "exceeds the limits"),  # 33 tokens, 32 rows
    (lambda f: patched(f, 16, "<I", 1), "counts say"),  # one feed fewer than the frame holds
    (lambda f: patched(f, FEED0 + 12, "<I", 30), "outside the features buffer"),  # rows 30..32 of 32
    (lambda f: patched(f, FEED0 + 16, "<I", 0), "outside the features buffer"),  # a feed of no rows
    (lambda f: patched(f, FEED0 + 16, "<I", 2), "4 tokens for 3 fed rows"),
    (lambda f: patched(f, PROPOSAL0 + 12, "<I", 99), "bad tree settings"),  # tree kind 99
    (lambda f: patched(f, PROPOSAL0 + PROPOSAL.size + 16, "<I", 0), "bad tree settings"),  # depth 0
    (lambda f: patched(f, 36, "<I", 2 * MAX_REASON_BYTES + 1), "exceeds the limits"),  # reason bytes
])
def test_a_step_whose_sizes_do_not_add_up_is_refused(corrupt, message):
    with pytest.raises(LinkProtocolError, match=message):
        StepFrames(LIMITS).decode_call(memoryview(bytes(corrupt(encoded(a_call())))))


def test_a_chained_step_and_its_reply_round_trip():
    frames = StepFrames(LIMITS)
    frame = frames.encode_chain(a_chain())
    assert frames.decode(memoryview(bytes(frame))) == a_chain()
    assert frames.decode(memoryview(encoded(a_call()))).step_id == 7  # the other kind, by its magic
    reply = ChainReply(9, 2, 59, 12345)
    assert frames.decode_chain_reply(memoryview(bytes(frames.encode_chain_reply(reply))), 9) == reply
    with pytest.raises(LinkProtocolError, match="another step"):
        frames.decode_chain_reply(memoryview(bytes(frames.encode_chain_reply(reply))), 10)
    step_reply = bytes(frames.encode_reply(StepReply(9, [], 1)))
    with pytest.raises(LinkProtocolError, match="not a chained step's result"):
        frames.decode_chain_reply(memoryview(step_reply), 9)


@pytest.mark.parametrize("corrupt, message", [
    (lambda f: f[:-1], "counts say"),
    (lambda f: f + b"\0", "counts say"),
    (lambda f: f[:20], "not a chained step"),
    (lambda f: patched(f, 4, "<I", 1), "version 1"),
    (lambda f: patched(f, 16, "<I", 5), "exceeds the limits"),  # 5 sequences, the limit is 4
    (lambda f: patched(f, 20, "<I", 17), "exceeds the limits"),  # 2 x 17 rows, 32 in the buffer
    (lambda f: patched(f, 20, "<I", 0), "exceeds the limits"),  # no row
    (lambda f: patched(f, 24, "<I", 99), "bad tree settings"),  # tree kind 99
    (lambda f: patched(f, 24, "<I", 0), "names no tree"),
    (lambda f: patched(f, 28, "<I", 0), "bad tree settings"),  # depth 0
    (lambda f: patched(f, 16, "<I", 1), "counts say"),  # one sequence fewer than the frame holds
    (lambda f: patched(f, 52, "<I", 2 * MAX_REASON_BYTES + 1), "exceeds the limits"),  # reason bytes
])
def test_a_chained_step_whose_sizes_do_not_add_up_is_refused(corrupt, message):
    assert CHAIN_HEADER.size == 56
    with pytest.raises(LinkProtocolError, match=message):
        StepFrames(LIMITS).decode(memoryview(bytes(corrupt(encoded_chain(a_chain())))))


@fuzz
@given(data=st.one_of(st.binary(max_size=600),
                      st.builds(lambda at, b: (at, b), st.integers(0, 500), st.binary(min_size=1, max_size=8))))
def test_no_frame_raises_anything_but_a_protocol_error(data):
    """Random bytes, and a valid step with a few bytes overwritten: parsed or refused, nothing else."""
    frames = StepFrames(LIMITS)
    if isinstance(data, tuple):
        at, patch = data
        frame = encoded(a_call()) if at % 2 else encoded_chain(a_chain())
        frame[at:at + len(patch)] = patch
        data = bytes(frame)
    for decode in (frames.decode, lambda f: frames.decode_reply(f, 7), lambda f: frames.decode_chain_reply(f, 9)):
        try:
            decode(memoryview(data))
        except LinkProtocolError:
            pass


@pytest.fixture
def folder(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    return run


def test_frames_travel_once_the_right_token_says_hello(folder):
    listener = StepListener(folder, 1)
    assert stat.S_IMODE(listener.path.stat().st_mode) == 0o600 and listener.path.parent == folder
    draft = StepSocket.connect(listener.path, listener.token, LIMITS.call_bytes, LIMITS.reply_bytes)
    verify = listener.accept(5, LIMITS.reply_bytes, LIMITS.call_bytes, step_timeout_s=5)
    assert not listener.path.exists()  # one connection: the file goes once it is taken
    try:
        sender, receiver = StepFrames(LIMITS), StepFrames(LIMITS)
        verify.send(sender.encode_call(a_call(11)))
        assert receiver.decode_call(draft.recv()).step_id == 11
        draft.send(receiver.encode_reply(StepReply(11, [TreeRef(3, 0, 2)], 5)))
        assert sender.decode_reply(verify.recv(), 11).trees == [TreeRef(3, 0, 2)]
        assert not verify.waiting()
        draft.send(receiver.encode_reply(StepReply(12, [], 5)))  # nobody asked
        deadline = time.monotonic() + 5
        while not verify.waiting():
            assert time.monotonic() < deadline
    finally:
        draft.close()
        verify.close()


@pytest.mark.parametrize("hello", ["wrong_token", "garbage", "nothing"])
def test_a_wrong_hello_is_refused_and_the_socket_removed(folder, hello):
    listener = StepListener(folder, 2)
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    peer.connect(str(listener.path))
    if hello == "wrong_token":
        peer.send(hello_frame(bytes(32)))
    elif hello == "garbage":
        peer.send(HELLO_MAGIC + b"\xff" * 100)
    with pytest.raises((LinkProtocolError, TimeoutError)):
        listener.accept(0.5, LIMITS.reply_bytes, LIMITS.call_bytes, step_timeout_s=5)
    assert not listener.path.exists()
    peer.settimeout(5)
    assert peer.recv(64) == b""  # the verify side closed it
    peer.close()


def test_nobody_connecting_times_out_and_removes_the_socket(folder):
    listener = StepListener(folder, 3)
    with pytest.raises(TimeoutError):
        listener.accept(0.2, LIMITS.reply_bytes, LIMITS.call_bytes, step_timeout_s=5)
    assert not listener.path.exists()
    listener.close()  # closing twice is fine


def test_oversized_frames_closes_and_shutdown_are_seen(folder):
    listener = StepListener(folder, 4)
    draft = StepSocket.connect(listener.path, listener.token, LIMITS.call_bytes, LIMITS.reply_bytes)
    verify = listener.accept(5, LIMITS.reply_bytes, LIMITS.call_bytes, step_timeout_s=5)
    try:
        draft.send(b"x" * (LIMITS.reply_bytes + 1))
        with pytest.raises(LinkProtocolError, match="over the"):
            verify.recv()
        woken = []
        blocked = threading.Thread(target=lambda: woken.append(pytest.raises(ConnectionError, draft.recv)))
        blocked.start()
        time.sleep(0.2)
        draft.shutdown()  # another thread ends the draft's wait for a step
        blocked.join(5)
        assert woken and not blocked.is_alive()
        with pytest.raises(ConnectionError):
            verify.recv()  # the draft's end is shut
    finally:
        draft.close()
        verify.close()


def test_a_socket_path_too_long_is_refused(tmp_path):
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    with pytest.raises(OSError, match="longer than"):
        StepListener(deep, 5)
    assert os.listdir(deep) == []


def test_offers_left_by_a_killed_process_are_removed(folder):
    gone, mine = folder / "step-999999999-1.sock", folder / f"step-{os.getpid()}-1.sock"
    for path in (gone, mine):
        path.touch()
    step_socket.remove_stale(folder)
    assert not gone.exists() and mine.exists()
