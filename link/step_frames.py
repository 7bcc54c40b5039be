"""Frames of the unix step socket: a step (verify -> draft) and its answer (draft -> verify) as
fixed-layout little-endian records, packed into and parsed from buffers allocated once.

Step frame (verify -> draft); every count is in the header and bounded by ``FrameLimits``::

    bytes     section                                                           count
    44        header: "E3SC", version, step_id u64, F, P, N, R, T, B, S (u32)
    24 each   feeds: seq_id u64, start u32, buffer_row u32, rows u32, pad u32   F <= max_seqs
    32 each   proposals: seq_id u64, max_depth u32, tree u32 (TreeKind, 0: the   P <= max_seqs
              draft's own), depth u32, top_k u32, max_nodes u32, pad u32
    8 each    finished seq_id u64                                               N <= max_seqs
    16 each   rejections: seq_id u64, reason_bytes u32, pad u32                 R <= max_seqs
    16 each   settled: seq_id u64, rows u32, pad u32                            S <= max_seqs
    4 each    next tokens u32 of every feed, in feed order                      T <= max_rows
    B         rejection reasons, UTF-8, in order (each <= MAX_REASON_BYTES)

Chained step frame (verify -> draft; link/protocol.py ``ChainCall``)::

    56        header: "E3CH", version, step_id u64, Q, W, tree u32 (TreeKind), depth,
              top_k, max_nodes, N, R, S, B (u32)
    16 each   sequences: seq_id u64, start u32, most u32                        Q <= max_seqs, Q * W <= max_rows
    8 / 16 / 16 each, then B: finished, rejections, settled, reasons, as above

Reply frames (draft -> verify)::

    24        header: "E3SR", n u32, step_id u64, draft_compute_ns u64
    16 each   trees: seq_id u64, tree_slot u32, num_nodes u32                   n <= max_seqs

    28        "E3CR", step_id u64, num_trees u32, num_nodes u32, draft_compute_ns u64   (a chained step's)

Hello frame (draft -> verify, the first on a new socket): "E3SH" + the session's 32-byte token.

Tensors never travel here: features and trees stay in the shared buffers. A frame is parsed
only after its length matches its counts exactly, and every count is checked against the
limits both sides derive from the handshake, so a peer's sizes are validated before use.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from common.errors import EagleError, LinkProtocolError
from common.tree_settings import TreeSettings
from link.convert import TREE_FROM_PROTO, TREE_TO_PROTO
from link.protocol import ChainCall, ChainedSeq, ChainReply, FeedRows, ProposeRequest, StepCall, StepReply, TreeRef

VERSION = 2
TOKEN_BYTES = 32
MAX_REASON_BYTES = 200  # a rejection's reason is cut (on a character boundary) to this
# Step frames over this (huge batches) would not fit a default socket buffer: such a link steps
# on its Session stream. 160 KiB holds 256 sequences and 10,000 fed rows.
MAX_CALL_BYTES = 160 << 10

CALL_HEADER = struct.Struct("<4sIQ7I")  # magic, version, step_id, F, P, N, R, T, B, S
CHAIN_HEADER = struct.Struct("<4sIQ10I")  # magic, version, step_id, Q, W, tree, depth, top_k, max_nodes, N, R, S, B
FEED = struct.Struct("<QIIII")
PROPOSAL = struct.Struct("<QIIIIII")
CHAINED = struct.Struct("<QII")
FINISHED = struct.Struct("<Q")
REJECTION = struct.Struct("<QII")
SETTLED = struct.Struct("<QII")
REPLY_HEADER = struct.Struct("<4sIQQ")  # magic, n, step_id, draft_compute_ns
CHAIN_REPLY = struct.Struct("<4sQIIQ")  # magic, step_id, num_trees, num_nodes, draft_compute_ns
TREE = struct.Struct("<QII")
HELLO = struct.Struct(f"<4s{TOKEN_BYTES}s")
CALL_MAGIC, CHAIN_MAGIC, REPLY_MAGIC, CHAIN_REPLY_MAGIC, HELLO_MAGIC = b"E3SC", b"E3CH", b"E3SR", b"E3CR", b"E3SH"


@dataclass(frozen=True, slots=True)
class FrameLimits:
    """What one step may carry, from the handshake: ``max_seqs`` tree slots, ``max_rows`` feature rows."""

    max_seqs: int
    max_rows: int

    @property
    def call_bytes(self) -> int:
        per_seq = FEED.size + PROPOSAL.size + FINISHED.size + REJECTION.size + SETTLED.size + MAX_REASON_BYTES
        return CALL_HEADER.size + self.max_seqs * per_seq + 4 * self.max_rows  # a chained step's is smaller

    @property
    def reply_bytes(self) -> int:
        return max(REPLY_HEADER.size + self.max_seqs * TREE.size, CHAIN_REPLY.size)

    @property
    def fit_socket(self) -> bool:
        return self.call_bytes <= MAX_CALL_BYTES


def hello_frame(token: bytes) -> bytes:
    return HELLO.pack(HELLO_MAGIC, token)


def hello_token(frame: bytes) -> bytes:
    """The token of a hello frame; LinkProtocolError for anything else."""
    if len(frame) != HELLO.size or frame[:4] != HELLO_MAGIC:
        raise LinkProtocolError(f"step socket: the first frame is not a hello ({len(frame)} bytes)")
    return HELLO.unpack(frame)[1]


def _cut(reason: str) -> bytes:
    return reason.encode()[:MAX_REASON_BYTES].decode(errors="ignore").encode()


class StepFrames:
    """Packs and parses the frames of one side, in two buffers allocated once (a frame returned
    by ``encode_*`` is a view of them: valid until the next call)."""

    def __init__(self, limits: FrameLimits):
        self.limits = limits
        self._call = bytearray(limits.call_bytes)
        self._reply = bytearray(limits.reply_bytes)

    # --- verify side -------------------------------------------------------------------------

    def encode_call(self, call: StepCall) -> memoryview:
        """The caller keeps within the limits (RemoteDraft caps what it sends per step)."""
        reasons = [_cut(r) for _, r in call.rejections]
        counts = (len(call.feeds), len(call.proposals), len(call.finished), len(reasons),
                  sum(len(f.next_tokens) for f in call.feeds), sum(map(len, reasons)), len(call.settled))
        assert max(*counts[:4], counts[6]) <= self.limits.max_seqs and counts[4] <= self.limits.max_rows, counts
        buf = self._call
        CALL_HEADER.pack_into(buf, 0, CALL_MAGIC, VERSION, call.step_id, *counts)
        at = CALL_HEADER.size
        for f in call.feeds:
            FEED.pack_into(buf, at, f.seq_id, f.start, f.buffer_row, len(f.next_tokens), 0)
            at += FEED.size
        for p in call.proposals:
            s = p.settings
            shape = (0, 0, 0, 0) if s is None else (TREE_TO_PROTO[s.tree], s.depth, s.top_k, s.max_nodes)
            PROPOSAL.pack_into(buf, at, p.seq_id, p.max_depth, *shape, 0)
            at += PROPOSAL.size
        at = self._pack_lists(at, call.finished, call.rejections, reasons, call.settled, tokens_of=call.feeds)
        return memoryview(buf)[:at]

    def encode_chain(self, call: ChainCall) -> memoryview:
        """A chained step (the caller keeps within the limits)."""
        reasons = [_cut(r) for _, r in call.rejections]
        s = call.settings
        counts = (len(call.finished), len(reasons), len(call.settled), sum(map(len, reasons)))
        assert max(len(call.seqs), *counts[:3]) <= self.limits.max_seqs, counts
        assert len(call.seqs) * call.width <= self.limits.max_rows, (len(call.seqs), call.width)
        buf = self._call
        CHAIN_HEADER.pack_into(buf, 0, CHAIN_MAGIC, VERSION, call.step_id, len(call.seqs), call.width,
                               TREE_TO_PROTO[s.tree], s.depth, s.top_k, s.max_nodes, *counts)
        at = CHAIN_HEADER.size
        for q in call.seqs:
            CHAINED.pack_into(buf, at, q.seq_id, q.start, q.most)
            at += CHAINED.size
        at = self._pack_lists(at, call.finished, call.rejections, reasons, call.settled)
        return memoryview(buf)[:at]

    def _pack_lists(self, at: int, finished, rejections, reasons, settled, tokens_of=()) -> int:
        """Finished, rejections, settled, the feeds' tokens (a step's: ``tokens_of``), then the
        reasons, packed from ``at``; returns the end."""
        buf = self._call
        for seq_id in finished:
            FINISHED.pack_into(buf, at, seq_id)
            at += FINISHED.size
        for (seq_id, _), reason in zip(rejections, reasons):
            REJECTION.pack_into(buf, at, seq_id, len(reason), 0)
            at += REJECTION.size
        for seq_id, rows in settled:
            SETTLED.pack_into(buf, at, seq_id, rows, 0)
            at += SETTLED.size
        if tokens_of:
            n = sum(len(f.next_tokens) for f in tokens_of)
            tokens = np.frombuffer(buf, np.uint32, n, at)
            row = 0
            for f in tokens_of:
                tokens[row:row + len(f.next_tokens)] = f.next_tokens
                row += len(f.next_tokens)
            at += 4 * n
        for reason in reasons:
            buf[at:at + len(reason)] = reason
            at += len(reason)
        return at

    def decode_reply(self, frame: memoryview, step_id: int) -> StepReply:
        """The draft's answer to ``step_id``; LinkProtocolError for a frame that is not one."""
        if len(frame) < REPLY_HEADER.size or frame[:4] != REPLY_MAGIC:
            raise LinkProtocolError(f"step socket: a {len(frame)}-byte frame that is not a step result")
        _, n, got_step, compute_ns = REPLY_HEADER.unpack_from(frame)
        if n > self.limits.max_seqs or len(frame) != REPLY_HEADER.size + n * TREE.size:
            raise LinkProtocolError(f"step socket: a result of {len(frame)} bytes claiming {n} trees")
        if got_step != step_id:
            raise LinkProtocolError("answered another step")
        trees = [TreeRef(*t) for t in TREE.iter_unpack(frame[REPLY_HEADER.size:])]
        return StepReply(got_step, trees, compute_ns)

    @staticmethod
    def decode_chain_reply(frame: memoryview, step_id: int) -> ChainReply:
        """The draft's answer to chained step ``step_id`` (its counts are the caller's to check against
        what it asked); LinkProtocolError for a frame that is not one."""
        if len(frame) != CHAIN_REPLY.size or frame[:4] != CHAIN_REPLY_MAGIC:
            raise LinkProtocolError(f"step socket: a {len(frame)}-byte frame that is not a chained step's result")
        _, got_step, trees, nodes, compute_ns = CHAIN_REPLY.unpack_from(frame)
        if got_step != step_id:
            raise LinkProtocolError("answered another step")
        return ChainReply(got_step, trees, nodes, compute_ns)

    # --- draft side --------------------------------------------------------------------------

    def encode_chain_reply(self, reply: ChainReply) -> memoryview:
        buf = self._reply
        CHAIN_REPLY.pack_into(buf, 0, CHAIN_REPLY_MAGIC, reply.step_id, reply.num_trees, reply.num_nodes,
                              reply.draft_compute_ns)
        return memoryview(buf)[:CHAIN_REPLY.size]

    def encode_reply(self, reply: StepReply) -> memoryview:
        trees = reply.trees[:self.limits.max_seqs]  # one per proposal: never more
        buf = self._reply
        REPLY_HEADER.pack_into(buf, 0, REPLY_MAGIC, len(trees), reply.step_id, reply.draft_compute_ns)
        at = REPLY_HEADER.size
        for t in trees:
            TREE.pack_into(buf, at, t.seq_id, t.tree_slot, t.num_nodes)
            at += TREE.size
        return memoryview(buf)[:at]

    def decode(self, frame: memoryview) -> StepCall | ChainCall:
        """A step or a chained step, by its magic; LinkProtocolError for anything else."""
        return self.decode_chain(frame) if frame[:4] == CHAIN_MAGIC else self.decode_call(frame)

    def decode_call(self, frame: memoryview) -> StepCall:
        """The verify side's step; LinkProtocolError for a frame whose sizes do not add up."""
        lim = self.limits
        if len(frame) < CALL_HEADER.size or frame[:4] != CALL_MAGIC:
            raise LinkProtocolError(f"step socket: a {len(frame)}-byte frame that is not a step")
        _, version, step_id, *counts = CALL_HEADER.unpack_from(frame)
        n_feeds, n_props, n_done, n_rej, n_tokens, n_text, n_settled = counts
        if version != VERSION or max(n_feeds, n_props, n_done, n_rej, n_settled) > lim.max_seqs \
                or n_tokens > lim.max_rows or n_text > n_rej * MAX_REASON_BYTES:
            raise LinkProtocolError(f"step socket: step {step_id} (version {version}) exceeds the limits: {counts}")
        sizes = (n_feeds * FEED.size, n_props * PROPOSAL.size, n_done * FINISHED.size, n_rej * REJECTION.size,
                 n_settled * SETTLED.size, 4 * n_tokens, n_text)
        sections = self._sections(frame, CALL_HEADER.size, sizes, step_id)
        tokens = np.frombuffer(sections[5], np.uint32).astype(np.int64)
        return StepCall(step_id, self._feeds(sections[0], tokens), self._proposals(sections[1]),
                        [seq_id for (seq_id,) in FINISHED.iter_unpack(sections[2])],
                        self._rejections(sections[3], sections[6]), _settled(sections[4]))

    def decode_chain(self, frame: memoryview) -> ChainCall:
        """The verify side's chained step; LinkProtocolError for a frame whose sizes do not add up."""
        lim = self.limits
        if len(frame) < CHAIN_HEADER.size or frame[:4] != CHAIN_MAGIC:
            raise LinkProtocolError(f"step socket: a {len(frame)}-byte frame that is not a chained step")
        _, version, step_id, n_seqs, width, tree, depth, top_k, max_nodes, *counts = CHAIN_HEADER.unpack_from(frame)
        n_done, n_rej, n_settled, n_text = counts
        if version != VERSION or max(n_seqs, n_done, n_rej, n_settled) > lim.max_seqs or not 1 <= width \
                or n_seqs * width > lim.max_rows or n_text > n_rej * MAX_REASON_BYTES:
            raise LinkProtocolError(f"step socket: chained step {step_id} (version {version}) exceeds the limits: "
                                    f"{[n_seqs, width, *counts]}")
        settings = _settings(tree, depth, top_k, max_nodes, f"chained step {step_id}")
        if settings is None:
            raise LinkProtocolError(f"step socket: chained step {step_id} names no tree")
        sizes = (n_seqs * CHAINED.size, n_done * FINISHED.size, n_rej * REJECTION.size, n_settled * SETTLED.size,
                 n_text)
        sections = self._sections(frame, CHAIN_HEADER.size, sizes, step_id)
        seqs = [ChainedSeq(*q) for q in CHAINED.iter_unpack(sections[0])]
        return ChainCall(step_id, seqs, width, settings, [seq_id for (seq_id,) in FINISHED.iter_unpack(sections[1])],
                         self._rejections(sections[2], sections[4]), _settled(sections[3]))

    @staticmethod
    def _sections(frame: memoryview, header: int, sizes: tuple[int, ...], step_id: int) -> list[memoryview]:
        """The frame cut into its sections, once its length is exactly the header and ``sizes``."""
        if len(frame) != header + sum(sizes):
            raise LinkProtocolError(f"step socket: step {step_id} is {len(frame)} bytes, its counts say "
                                    f"{header + sum(sizes)}")
        bounds = np.cumsum((header, *sizes))  # where each section starts, then the end
        return [frame[bounds[i]:bounds[i + 1]] for i in range(len(sizes))]

    def _feeds(self, section, tokens: np.ndarray) -> list[FeedRows]:
        feeds, row = [], 0
        for seq_id, start, buffer_row, rows, _ in FEED.iter_unpack(section):
            if rows == 0 or buffer_row + rows > self.limits.max_rows or row + rows > len(tokens):
                raise LinkProtocolError(f"step socket: feed of sequence {seq_id} (rows {buffer_row} + {rows}) "
                                        "outside the features buffer or the tokens")
            feeds.append(FeedRows(seq_id, start, buffer_row, tokens[row:row + rows]))
            row += rows
        if row != len(tokens):
            raise LinkProtocolError(f"step socket: {len(tokens)} tokens for {row} fed rows")
        return feeds

    @staticmethod
    def _proposals(section) -> list[ProposeRequest]:
        return [ProposeRequest(seq_id, max_depth,
                               _settings(tree, depth, top_k, max_nodes, f"proposal for sequence {seq_id}"))
                for seq_id, max_depth, tree, depth, top_k, max_nodes, _ in PROPOSAL.iter_unpack(section)]

    @staticmethod
    def _rejections(section, text) -> list[tuple[int, str]]:
        rejections, at = [], 0
        for seq_id, n, _ in REJECTION.iter_unpack(section):
            if n > MAX_REASON_BYTES or at + n > len(text):
                raise LinkProtocolError(f"step socket: rejection of sequence {seq_id}: reason of {n} bytes")
            rejections.append((seq_id, bytes(text[at:at + n]).decode(errors="replace")))
            at += n
        if at != len(text):
            raise LinkProtocolError(f"step socket: {len(text)} bytes of reasons, {at} used")
        return rejections


def _settings(tree: int, depth: int, top_k: int, max_nodes: int, what: str) -> TreeSettings | None:
    """A frame's tree shape (TreeKind 0: None, the draft's own); LinkProtocolError for a bad one."""
    try:
        return None if tree == 0 else TreeSettings(TREE_FROM_PROTO[tree], depth, top_k, max_nodes)
    except (KeyError, EagleError) as exc:
        raise LinkProtocolError(f"step socket: {what}: bad tree settings") from exc


def _settled(section) -> list[tuple[int, int]]:
    return [(seq_id, rows) for seq_id, rows, _ in SETTLED.iter_unpack(section)]
