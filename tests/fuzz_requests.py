"""Hypothesis strategies for requests to the services: typed messages with hostile values, raw bytes
(hand-written wire format, mutated messages, noise), and calls to every public method.

Raw messages are written from the proto descriptors, field by field: the right wire type
mostly, a wrong one sometimes; varints up to 2^64 - 1 (negative int32 enums included), float bits
of NaN / inf / subnormals, strings of invalid UTF-8, nested messages, packed and unpacked repeated
fields, unknown field numbers and lengths that overrun the message.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from hypothesis import strategies as st

from protos.eagle3.v1 import generation_pb2 as pb
from tiny_tokenizer import SPECIAL_TOKENS, VOCAB_SIZE

VARINT, FIXED64, LEN, START_GROUP, END_GROUP, FIXED32 = 0, 1, 2, 3, 4, 5
U32, U64 = 2**32 - 1, 2**64 - 1
EDGE_INTS = (0, 1, 2, 2**7, 2**31 - 1, 2**31, U32, 2**32, 2**63 - 1, 2**63, U64)
CHAT_ROLES = ("system", "user", "assistant", "tool")
GENERATE = "/eagle3.v1.Generation/Generate"
HEALTH_SERVICES = ("", "eagle3.v1.Generation", "eagle3.speculation")
REFLECTION = ("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
              "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
# Sizes of huge fields: the first three fit the server's 4 MiB message limit (the handler must refuse
# them), the last does not (gRPC's own RESOURCE_EXHAUSTED).
HUGE_COUNTS = (1_000, 100_000, 600_000, 5_000_000)


def varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _key(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def uints(hi: int = U64) -> st.SearchStrategy[int]:
    """Mostly small, often a boundary value, sometimes anything up to ``hi``."""
    return st.one_of(st.integers(0, 8), st.sampled_from([n for n in EDGE_INTS if n <= hi]), st.integers(0, hi))


def texts(max_size: int = 24, min_size: int = 0) -> st.SearchStrategy[str]:
    """Unicode text (NUL, astral planes, combining marks) spliced with the special-token strings."""
    pieces = st.one_of(st.text(st.characters(codec="utf-8"), min_size=min_size, max_size=8),
                       st.sampled_from(SPECIAL_TOKENS),
                       st.sampled_from([" ", "\n", "\x00", "\u00e9", "\U0001f600", "\ufffd", "assistant"]))
    return st.lists(pieces, min_size=min_size, max_size=max(1, max_size // 4)).map("".join)


def float_bits(width: int) -> st.SearchStrategy[bytes]:
    fmt = "<f" if width == 32 else "<d"
    return st.one_of(st.floats(width=width).map(lambda x: struct.pack(fmt, x)), st.binary(min_size=width // 8,
                                                                                          max_size=width // 8))


_SCALAR_WIRE = {FieldDescriptor.TYPE_FLOAT: FIXED32, FieldDescriptor.TYPE_DOUBLE: FIXED64,
                FieldDescriptor.TYPE_FIXED32: FIXED32, FieldDescriptor.TYPE_FIXED64: FIXED64,
                FieldDescriptor.TYPE_SFIXED32: FIXED32, FieldDescriptor.TYPE_SFIXED64: FIXED64}


def _payload(wire_type: int, field: FieldDescriptor | None, depth: int) -> st.SearchStrategy[bytes]:
    """The bytes after a field's key, for ``wire_type`` (``field`` None: an unknown field)."""
    if wire_type == VARINT:
        return uints().map(varint) | st.just(b"\xff" * 10 + b"\x01")  # an 11-byte varint is corrupt
    if wire_type in (FIXED32, FIXED64):
        return float_bits(32 if wire_type == FIXED32 else 64)
    if wire_type in (START_GROUP, END_GROUP) or wire_type > FIXED32:
        return st.binary(max_size=4)
    return st.one_of(_len_body(field, depth).map(lambda body: varint(len(body)) + body),
                     st.tuples(st.integers(1, 2**31), st.binary(max_size=8)).map(  # a length past the end
                         lambda n_body: varint(n_body[0] + len(n_body[1])) + n_body[1]))


def _len_body(field: FieldDescriptor | None, depth: int) -> st.SearchStrategy[bytes]:
    if field is None or field.type == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=16)
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return raw_message(field.message_type, depth + 1) if depth < 3 else st.binary(max_size=16)
    if field.type == FieldDescriptor.TYPE_STRING:
        return st.one_of(texts().map(str.encode), st.binary(max_size=16),
                         st.sampled_from(HUGE_COUNTS).map(lambda n: b"a" * n))
    if field.type in _SCALAR_WIRE:  # packed fixed-width values
        return st.lists(float_bits(32 if _SCALAR_WIRE[field.type] == FIXED32 else 64), max_size=8).map(b"".join)
    return st.one_of(st.lists(uints().map(varint), max_size=16).map(b"".join),  # packed varints
                     st.sampled_from(HUGE_COUNTS).map(lambda n: b"\x07" * n))


def _field(descriptor: Descriptor, depth: int) -> st.SearchStrategy[bytes]:
    known = list(descriptor.fields)
    numbers = st.one_of(st.sampled_from(known).map(lambda f: (f.number, f)) if known else st.nothing(),
                        st.one_of(st.integers(0, 40), st.integers(0, 2**29 - 1)).map(
                            lambda n: (n, descriptor.fields_by_number.get(n))))

    def encode(number_field):
        number, field = number_field
        right = LEN if field is None or field.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES,
                                                       FieldDescriptor.TYPE_MESSAGE) else \
            _SCALAR_WIRE.get(field.type, VARINT)
        packed = st.just(LEN) if field is not None and field.is_repeated else st.nothing()
        wire = st.one_of(st.just(right), packed, st.integers(0, 7))
        return wire.flatmap(lambda w: _payload(w, field, depth).map(lambda body: _key(number, w) + body))
    return numbers.flatmap(encode)


_RAW: dict[tuple[str, int], st.SearchStrategy[bytes]] = {}


def raw_message(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[bytes]:
    """Wire-format bytes of ``descriptor``'s message, built field by field (often not a valid one)."""
    key = (descriptor.full_name, depth)
    if key not in _RAW:
        _RAW[key] = st.deferred(lambda: st.lists(_field(descriptor, depth), max_size=6).map(b"".join))
    return _RAW[key]


def mutated(messages: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """A message with a few bytes overwritten, inserted, deleted, or the tail cut."""
    def apply(raw: bytes, edits: list[tuple[int, int, int]]) -> bytes:
        out = bytearray(raw)
        for op, at, value in edits:
            at = at % (len(out) + 1)
            if op == 0 and at < len(out):
                out[at] = value
            elif op == 1:
                out.insert(at, value)
            elif op == 2:
                del out[at:at + 1 + value % 4]
            else:
                del out[at:]
        return bytes(out)
    edit = st.tuples(st.integers(0, 3), st.integers(0, 2**16), st.integers(0, 255))
    return st.builds(apply, messages, st.lists(edit, min_size=1, max_size=4))


def token_ids(max_size: int = 20) -> st.SearchStrategy[list[int]]:
    """Ids out of the vocabulary, edge values, none, or very many."""
    ids = st.one_of(st.integers(0, VOCAB_SIZE - 1), st.integers(VOCAB_SIZE - 2, VOCAB_SIZE + 2), uints(U32))
    return st.one_of(st.lists(ids, max_size=max_size), st.sampled_from(HUGE_COUNTS[:3]).map(lambda n: [7] * n))


class _Fields:
    """Draws each field's value: a valid one, or (for a hostile request) now and then a hostile one.

    Half the requests are valid throughout, so they reach the engine and its speculation paths;
    in the other half a field is hostile one time in four.
    """

    def __init__(self, draw):
        self.draw, self.hostile = draw, draw(st.booleans())

    def __call__(self, usual: st.SearchStrategy, hostile: st.SearchStrategy):
        if self.hostile and self.draw(st.integers(0, 3)) == 0:
            return self.draw(hostile)
        return self.draw(usual)


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    """A GenerateRequest: a valid one, or one with hostile values in some of its fields."""
    pick, req = _Fields(draw), pb.GenerateRequest()
    kind = pick(st.sampled_from(["token_ids", "text", "chat"]), st.just("none"))
    if kind == "token_ids":
        req.token_ids.ids.extend(pick(st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=20), token_ids()))
    elif kind == "text":
        huge = st.sampled_from([HUGE_COUNTS[0], HUGE_COUNTS[1], HUGE_COUNTS[3]]).map(lambda n: "ab" * n)
        req.text = pick(texts(min_size=1), st.one_of(texts(), huge))  # the server tokenizes all of it first
    elif kind == "chat":
        message = st.builds(pb.ChatMessage, role=st.sampled_from(CHAT_ROLES), content=texts())
        hostile = st.builds(pb.ChatMessage, role=st.one_of(st.sampled_from(CHAT_ROLES), texts(8)), content=texts())
        req.chat.messages.extend(pick(st.lists(message, min_size=1, max_size=3), st.one_of(
            st.lists(hostile, max_size=6),
            st.sampled_from(HUGE_COUNTS[:2]).map(lambda n: [pb.ChatMessage(role="user", content="hi")] * n))))
    req.max_tokens = pick(st.integers(0, 6), uints(U32))
    req.ignore_eos = draw(st.booleans())
    req.stop.extend(pick(st.lists(texts(6, min_size=1), max_size=2), st.one_of(
        st.lists(texts(6), max_size=4), st.sampled_from(HUGE_COUNTS[:2]).map(lambda n: ["zz"] * n))))
    req.stop_token_ids.extend(pick(st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=2),
                                   st.lists(st.one_of(st.integers(0, VOCAB_SIZE + 1), uints(U32)), max_size=4)))
    _sampling(draw, pick, req.sampling)
    _speculation(draw, pick, req.speculation)
    return req


def _sampling(draw, pick: _Fields, s: pb.SamplingParameters) -> None:
    if draw(st.booleans()):
        return  # unset: greedy
    for name, usual, hostile in (
            ("temperature", st.sampled_from([0.0, 0.5, 1.0, 1e-5, 100.0]), st.floats(width=32)),
            ("top_p", st.floats(0.0625, 1.0, width=32), st.floats(width=32)),
            ("top_k", st.integers(0, 5), uints(U32)), ("seed", st.integers(0, 2**63 - 1), uints())):
        if draw(st.booleans()):
            setattr(s, name, pick(usual, hostile))


def _speculation(draw, pick: _Fields, o: pb.SpeculationOptions) -> None:
    if draw(st.booleans()):
        o.enabled = draw(st.booleans())
    o.tree = pick(st.sampled_from([0, 1, 3]), st.one_of(st.integers(0, 3), st.integers(-2**31, 2**31 - 1)))
    for name in ("depth", "top_k", "max_nodes"):  # the stack's limits: depth 4, top-k 3, 12 nodes
        if draw(st.booleans()):
            setattr(o, name, pick(st.integers(1, 3), st.one_of(st.integers(0, 13), uints(U32))))


@dataclass(frozen=True)
class Call:
    """One RPC: the method's path and its raw request messages (one for unary requests)."""

    method: str
    requests: tuple[bytes, ...]

    def __repr__(self) -> str:  # what a failing example prints: short enough to read
        shown = [r[:300].hex() + (f"...({len(r)} bytes)" if len(r) > 300 else "") for r in self.requests]
        return f"Call({self.method!r}, {shown})"


def _one(method: str, requests: st.SearchStrategy[bytes]) -> st.SearchStrategy[Call]:
    return requests.map(lambda raw: Call(method, (raw,)))


def _raw(descriptor) -> st.SearchStrategy[bytes]:
    return st.one_of(raw_message(descriptor), st.binary(max_size=64))


def public_calls() -> st.SearchStrategy[Call]:
    """Calls to every public method, Generate most often."""
    typed = generate_requests().map(pb.GenerateRequest.SerializeToString)
    generate = _one(GENERATE, weighted((typed, 7), (raw_message(pb.GenerateRequest.DESCRIPTOR), 1),
                                       (mutated(typed), 1), (st.binary(max_size=64), 1)))
    health = st.one_of(st.sampled_from(HEALTH_SERVICES), texts()).map(
        lambda s: health_pb2.HealthCheckRequest(service=s).SerializeToString())
    health = st.one_of(health, _raw(health_pb2.HealthCheckRequest.DESCRIPTOR))
    reflect = st.one_of(st.builds(reflection_pb2.ServerReflectionRequest, list_services=texts()),
                        st.builds(reflection_pb2.ServerReflectionRequest, file_containing_symbol=st.one_of(
                            st.just("eagle3.v1.Generation"), texts()))).map(
        reflection_pb2.ServerReflectionRequest.SerializeToString)
    reflect = st.one_of(reflect, _raw(reflection_pb2.ServerReflectionRequest.DESCRIPTOR))
    others = st.one_of(
        _one("/eagle3.v1.Generation/GetServerInfo", _raw(pb.GetServerInfoRequest.DESCRIPTOR)),
        _one("/eagle3.v1.Generation/GetMetrics", _raw(pb.GetMetricsRequest.DESCRIPTOR)),
        _one("/grpc.health.v1.Health/Check", health), _one("/grpc.health.v1.Health/Watch", health),
        st.tuples(st.sampled_from(REFLECTION), st.lists(reflect, min_size=1, max_size=3)).map(
            lambda m_r: Call(m_r[0], tuple(m_r[1]))))
    return weighted((generate, 3), (others, 1))


def weighted(*choices: tuple[st.SearchStrategy, int]) -> st.SearchStrategy:
    """One of the strategies, each about as often as its weight (``one_of`` drops repeated strategies)."""
    slots = [strategy for strategy, weight in choices for _ in range(weight)]
    return st.integers(0, len(slots) - 1).flatmap(slots.__getitem__)
