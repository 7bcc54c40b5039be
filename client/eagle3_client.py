"""Synchronous client of the public ``eagle3.v1.Generation`` API (no torch needed).

    with Eagle3Client("127.0.0.1:50051") as client:
        for event in client.generate("The capital of France is", max_tokens=16):
            print(event.text, end="", flush=True)
        answer = client.complete([{"role": "user", "content": "Hi!"}], temperature=0.7, seed=1)

Every call carries a deadline; every gRPC error becomes a ``ClientError`` whose
``field_violations`` come from the server's rich status (``google.rpc.BadRequest``). A secured
server (README: Securing the public API) takes ``tls_ca=`` (and ``tls_cert=``/``tls_key=`` for
mutual TLS) and a token, by default from $EAGLE3_API_TOKEN.
"""

from __future__ import annotations

import numbers
import re
import struct
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass

import grpc
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from common.auth import channel_credentials, check_token, env_token
from protos.eagle3.v1 import generation_pb2, generation_pb2_grpc, speculation_pb2

Prompt = str | Sequence[int] | Sequence[dict]
UINT32_MAX, UINT64_MAX = (1 << 32) - 1, (1 << 64) - 1

TREE_KINDS = {
    "dynamic": speculation_pb2.TREE_KIND_DYNAMIC,
    "static": speculation_pb2.TREE_KIND_STATIC,
    "chain": speculation_pb2.TREE_KIND_CHAIN,
}


class ClientError(Exception):
    """A failed RPC: ``code`` is the grpc.StatusCode name ("INVALID_ARGUMENT", ...)."""

    def __init__(self, code: str, message: str, field_violations: list[tuple[str, str]] | None = None):
        super().__init__(code, message, field_violations)
        self.code = code
        self.message = message
        self.field_violations = field_violations or []

    def __str__(self) -> str:
        """One line: the code, the message, then the field violations the message does not already say
        (the server's message for one bad field is that violation: "temperature: must be ...")."""
        extra = [f"{name}: {text}" for name, text in self.field_violations if f"{name}: {text}" not in self.message]
        line = f"{self.code}: {self.message}" if self.message else self.code
        return " ".join((line + (f" ({'; '.join(extra)})" if extra else "")).split())

    @classmethod
    def from_rpc_error(cls, err: grpc.RpcError) -> ClientError:
        code = err.code() if hasattr(err, "code") else None
        message = err.details() if hasattr(err, "details") else str(err)
        return cls(code.name if code else "UNKNOWN", message or "", _field_violations(err))


def _field_violations(err: grpc.RpcError) -> list[tuple[str, str]]:
    """(field, description) pairs of every BadRequest detail in the rich status, if any."""
    try:
        status = rpc_status.from_call(err)
    except (ValueError, AttributeError):  # no rich status, or one inconsistent with the call's
        return []
    violations = []
    for detail in status.details if status else ():
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            violations += [(v.field, v.description) for v in bad.field_violations]
    return violations


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """One message of the stream: newly committed tokens, or (``done``) the summary."""

    token_ids: tuple[int, ...] = ()
    text: str = ""
    done: bool = False
    finish_reason: str | None = None  # "stop" | "length", on the done event only
    usage: Usage | None = None
    speculation: dict | None = None  # SpeculationMetrics fields, on the done event only


@dataclass(frozen=True, slots=True)
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str | None  # None: the stream ended without a done event
    usage: Usage | None
    speculation: dict | None


class Eagle3Client:
    """``address``: "host:port" or "unix:/path". ``timeout_s``: the default deadline of every call.

    ``token``: sent as ``authorization: Bearer <token>`` (default: $EAGLE3_API_TOKEN, if set). TLS
    when ``tls``, ``tls_ca`` or ``tls_cert`` is given: the server is verified against ``tls_ca``
    (PEM; default: the system's root CAs); ``tls_cert`` and ``tls_key``: this client's certificate
    for mutual TLS. A file that cannot be read, or a bad token, raises ValueError naming the
    argument (never the token).
    """

    def __init__(self, address: str = "127.0.0.1:50051", timeout_s: float = 300.0,
                 max_message_bytes: int = 4 << 20, *, token: str | None = None, tls: bool = False,
                 tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.address = address
        self.timeout_s = timeout_s
        token = check_token(token, "token") if token is not None else env_token()
        self._metadata = (("authorization", f"Bearer {token}"),) if token is not None else ()
        secure = tls or any(path is not None for path in (tls_ca, tls_cert, tls_key))
        credentials = channel_credentials(tls_ca, tls_cert, tls_key) if secure else None
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            # Reconnect quickly once a (re)starting server listens: polling must not wait out
            # gRPC's default exponential backoff (up to 2 minutes).
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        self._channel = (grpc.secure_channel(address, credentials, options=options) if credentials is not None
                         else grpc.insecure_channel(address, options=options))
        self._generation = generation_pb2_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def generate(self, prompt: Prompt, *, max_tokens: int = 0, temperature: float | None = None,
                 top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
                 stop: Iterable[str] = (), stop_token_ids: Iterable[int] = (), ignore_eos: bool = False,
                 speculate: bool | None = None, tree: str | None = None, depth: int | None = None,
                 tree_top_k: int | None = None, max_nodes: int | None = None,
                 timeout_s: float | None = None) -> Iterator[StreamEvent]:
        """Streams the answer. The request is built (and checked) now, sent on the first ``next``;
        closing the iterator early (``break`` then ``close()``, or ``contextlib.closing``) cancels it.
        A value no request can carry (a negative ``max_tokens``, ...) raises ValueError naming it."""
        stop_token_ids = list(stop_token_ids)
        _check_unsigned({"max_tokens": (max_tokens, UINT32_MAX), "top_k": (top_k, UINT32_MAX),
                         "seed": (seed, UINT64_MAX), "depth": (depth, UINT32_MAX),
                         "tree_top_k": (tree_top_k, UINT32_MAX), "max_nodes": (max_nodes, UINT32_MAX),
                         **{f"stop_token_ids[{i}]": (t, UINT32_MAX) for i, t in enumerate(stop_token_ids)}})
        request = generation_pb2.GenerateRequest(
            max_tokens=max_tokens, stop=[stop] if isinstance(stop, str) else list(stop),
            stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
            sampling=_sampling(temperature, top_p, top_k, seed),
            speculation=_speculation(speculate, tree, depth, tree_top_k, max_nodes))
        _set_prompt(request, prompt)
        return self._stream(request, self._deadline(timeout_s))

    def complete(self, prompt: Prompt, **kwargs) -> Completion:
        """``generate`` collected into one answer; takes the same keyword arguments."""
        text, ids, last = [], [], StreamEvent()
        with closing(self.generate(prompt, **kwargs)) as stream:
            for event in stream:
                text.append(event.text)
                ids += event.token_ids
                last = event
        return Completion("".join(text), ids, last.finish_reason, last.usage, last.speculation)

    def server_info(self, timeout_s: float | None = None) -> dict:
        return _to_dict(self._unary(self._generation.GetServerInfo, generation_pb2.GetServerInfoRequest(), timeout_s))

    def metrics(self, timeout_s: float | None = None) -> dict:
        return _to_dict(self._unary(self._generation.GetMetrics, generation_pb2.GetMetricsRequest(), timeout_s))

    def health(self, service: str = "", timeout_s: float | None = None) -> str:
        """"SERVING", "NOT_SERVING" or "SERVICE_UNKNOWN"; a server that cannot be reached raises ClientError."""
        try:
            reply = self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout_s)
        except ClientError as err:
            if err.code == "NOT_FOUND":  # the health servicer's answer for a service it does not know
                return "SERVICE_UNKNOWN"
            raise
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def wait_until_healthy(self, timeout_s: float, service: str = "", poll_s: float = 0.1) -> None:
        """Polls ``health(service)`` until SERVING; TimeoutError names the last status or error."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            try:
                last = self.health(service, timeout_s=max(min(remaining, 2.0), 0.05))
            except ClientError as err:
                last = f"error {err}"
            if last == "SERVING":
                return
            if time.monotonic() + poll_s >= deadline:
                raise TimeoutError(f"{self.address} service {service!r} not SERVING after {timeout_s:g}s "
                                   f"(last: {last})")
            time.sleep(poll_s)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Eagle3Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _deadline(self, timeout_s: float | None) -> float:
        return self.timeout_s if timeout_s is None else timeout_s

    def _unary(self, method, request, timeout_s: float | None):
        try:
            return method(request, timeout=self._deadline(timeout_s), metadata=self._metadata)
        except grpc.RpcError as err:
            raise ClientError.from_rpc_error(err) from None

    def _stream(self, request: generation_pb2.GenerateRequest, timeout_s: float) -> Iterator[StreamEvent]:
        call = self._generation.Generate(request, timeout=timeout_s, metadata=self._metadata)
        try:
            for response in call:
                yield _event(response)
        except grpc.RpcError as err:
            raise ClientError.from_rpc_error(err) from None
        finally:
            call.cancel()  # no-op once the stream has finished; otherwise tells the server to stop


def _set_prompt(request: generation_pb2.GenerateRequest, prompt: Prompt) -> None:
    """str -> text, list of ints -> token_ids, list of {"role", "content"} dicts -> chat."""
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        _check_unsigned({f"prompt[{i}]": (t, UINT32_MAX) for i, t in enumerate(prompt)})
        request.token_ids.ids.extend(prompt)
    elif prompt and all(isinstance(m, dict) for m in prompt):
        request.chat.messages.extend(generation_pb2.ChatMessage(role=m["role"], content=m["content"])
                                     for m in prompt)
    else:
        raise ValueError("prompt must be a string, a non-empty list of token ids or of chat message dicts")


def _check_unsigned(fields: dict[str, tuple[int | None, int]]) -> None:
    """``fields``: name -> (value or None, the most it may be). protobuf refuses an unsigned field's
    value out of range without naming the field ("Value out of range: -1"); this names it."""
    for name, (value, most) in fields.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # numpy ints pass
            raise TypeError(f"{name}: must be an integer, got {value!r}")
        if not 0 <= value <= most:
            raise ValueError(f"{name}: must be {'>= 0' if value < 0 else f'<= {most}'}, got {value}")


def _sampling(temperature, top_p, top_k, seed) -> generation_pb2.SamplingParameters:
    given = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed}
    return generation_pb2.SamplingParameters(**{k: v for k, v in given.items() if v is not None})


def _speculation(enabled, tree, depth, top_k, max_nodes) -> generation_pb2.SpeculationOptions:
    if tree is not None and tree not in TREE_KINDS:
        raise ValueError(f"tree must be one of {sorted(TREE_KINDS)}, got {tree!r}")
    given = {"enabled": enabled, "depth": depth, "top_k": top_k, "max_nodes": max_nodes}
    return generation_pb2.SpeculationOptions(tree=TREE_KINDS.get(tree, speculation_pb2.TREE_KIND_UNSPECIFIED),
                                             **{k: v for k, v in given.items() if v is not None})


def _event(response: generation_pb2.GenerateResponse) -> StreamEvent:
    if response.WhichOneof("event") == "delta":
        return StreamEvent(tuple(response.delta.token_ids), response.delta.text)
    done = response.done
    reason = _enum_value(done.DESCRIPTOR.fields_by_name["finish_reason"], done.finish_reason)
    return StreamEvent(done=True, finish_reason=None if reason == "unspecified" else reason,
                       usage=Usage(done.usage.prompt_tokens, done.usage.completion_tokens),
                       speculation=_to_dict(done.speculation) if done.HasField("speculation") else None)


def _to_dict(message) -> dict:
    """Every field by its proto name: enums as short lowercase names ("dynamic"), float32 as written."""
    out = {}
    for f in message.DESCRIPTOR.fields:
        value = getattr(message, f.name)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:  # scalar values only, here
            out[f.name] = dict(sorted(value.items()))
        elif f.message_type is not None:
            out[f.name] = [_to_dict(v) for v in value] if f.is_repeated else _to_dict(value)
        elif f.enum_type is not None:
            out[f.name] = [_enum_value(f, v) for v in value] if f.is_repeated else _enum_value(f, value)
        elif f.type == f.TYPE_FLOAT:
            out[f.name] = [_short_float(v) for v in value] if f.is_repeated else _short_float(value)
        else:
            out[f.name] = list(value) if f.is_repeated else value
    return out


def _enum_value(f, number: int) -> str:
    """TREE_KIND_DYNAMIC -> "dynamic": the enum's name prefix (TreeKind -> TREE_KIND_) dropped."""
    prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", f.enum_type.name).upper() + "_"
    return f.enum_type.values_by_number[number].name.removeprefix(prefix).lower()


def _short_float(x: float) -> float:
    """The shortest decimal that is the same float32 (0.6 rather than 0.6000000238418579)."""
    for digits in range(1, 10):
        y = float(f"{x:.{digits}g}")
        if struct.unpack("f", struct.pack("f", y))[0] == x:
            return y
    return x
