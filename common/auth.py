"""Securing the public API: TLS credentials (server and client side) and the bearer token.

A client sends the token as gRPC metadata ``authorization: Bearer <token>``; the server compares
it in constant time and answers UNAUTHENTICATED for a missing or wrong one. The standard health
service stays open, so orchestrators' probes need no secret; Generation and reflection need the
token. A token is never logged nor echoed in an error: messages name the flag, not the value.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from pathlib import Path

import grpc

from common.errors import InvalidRequestError

TOKEN_ENV = "EAGLE3_API_TOKEN"  # read from the environment, so a token stays out of process lists
OPEN_METHODS = ("/grpc.health.v1.Health/",)  # method prefixes served without a token
DENIED = "missing or invalid API token (send the metadata 'authorization: Bearer <token>')"


def read_file(path: str, field: str) -> bytes:
    """The bytes of ``path``; a missing or unreadable file is an InvalidRequestError naming ``field``."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidRequestError(field, f"cannot read {path!r}: {exc.strerror or exc}") from None


def read_pem(path: str, field: str, kind: str) -> bytes:
    """``path``'s PEM bytes, which must hold a ``kind`` block ("CERTIFICATE", "PRIVATE KEY"): gRPC
    itself only says "Failed to bind" for a file that is not PEM."""
    data = read_file(path, field)
    if b"-----BEGIN " not in data or f"{kind}-----".encode() not in data:
        raise InvalidRequestError(field, f"{path!r} holds no PEM {kind.lower()} (-----BEGIN ...{kind}-----)")
    return data


def check_key_pair(cert: str | None, key: str | None) -> None:
    """A certificate and its private key come together or not at all."""
    if cert is not None and key is None:
        raise InvalidRequestError("tls_key", "a certificate (tls_cert) needs its private key (tls_key)")
    if key is not None and cert is None:
        raise InvalidRequestError("tls_cert", "a private key (tls_key) needs its certificate (tls_cert)")


def check_token(token: str, field: str) -> str:
    """``token`` if it can travel in a header: non-empty printable ASCII without spaces."""
    if not token:
        raise InvalidRequestError(field, "the API token is empty")
    if not all("!" <= c <= "~" for c in token):
        raise InvalidRequestError(field, "the API token must be printable ASCII without spaces")
    return token


def read_token(path: str, field: str) -> str:
    """The token in file ``path`` (surrounding whitespace, such as the final newline, dropped)."""
    return check_token(read_file(path, field).decode("ascii", "replace").strip(), field)


def env_token() -> str | None:
    """The token in $EAGLE3_API_TOKEN; None when it is unset or blank."""
    token = os.environ.get(TOKEN_ENV, "").strip()
    return check_token(token, TOKEN_ENV) if token else None


def server_credentials(cert: str, key: str, client_ca: str | None = None) -> grpc.ServerCredentials:
    """TLS with ``cert`` (PEM, chain allowed) and ``key``; with ``client_ca``, mutual TLS: a client
    must present a certificate that CA signed, or the handshake fails."""
    ca = read_pem(client_ca, "tls_client_ca", "CERTIFICATE") if client_ca is not None else None
    pair = (read_pem(key, "tls_key", "PRIVATE KEY"), read_pem(cert, "tls_cert", "CERTIFICATE"))
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def channel_credentials(ca: str | None, cert: str | None, key: str | None) -> grpc.ChannelCredentials:
    """TLS to the server, verified against ``ca`` (None: the system's root CAs); ``cert`` and
    ``key``: this client's certificate, for a server that asks for one (mutual TLS)."""
    check_key_pair(cert, key)
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(ca, "tls_ca", "CERTIFICATE") if ca is not None else None,
        private_key=read_pem(key, "tls_key", "PRIVATE KEY") if key is not None else None,
        certificate_chain=read_pem(cert, "tls_cert", "CERTIFICATE") if cert is not None else None)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class TokenInterceptor(grpc.ServerInterceptor):
    """Lets a call through only with ``authorization: Bearer <token>``, whatever the method's kind
    (unary or streaming on either side); the health service (OPEN_METHODS) needs no token."""

    def __init__(self, token: str):
        self._digest = _digest(token)

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or details.method.startswith(OPEN_METHODS) or self._authorized(details):
            return handler
        return _denied(handler)

    def _authorized(self, details) -> bool:
        header = next((v for k, v in details.invocation_metadata or () if k == "authorization"), "")
        scheme, _, token = header.partition(" ")
        # Equal-length digests: compare_digest's time depends on neither the token's content nor its length.
        return scheme.lower() == "bearer" and hmac.compare_digest(_digest(token.strip()), self._digest)


def _denied(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that answers UNAUTHENTICATED without reading the request."""
    def deny(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)

    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return make[handler.request_streaming, handler.response_streaming](deny)


def is_local(address: str) -> bool:
    """True for a unix socket or a loopback host (127.0.0.0/8, ::1, localhost); False for every
    interface ("0.0.0.0", "[::]", ":PORT") and for a host name, which may resolve anywhere."""
    if address.startswith(("unix:", "unix-abstract:")):
        return True
    host = address.rpartition(":")[0].removeprefix("[").removesuffix("]")
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_warning(listen: str, tls: bool, token: bool) -> str | None:
    """The start-up warning for a public API listening beyond loopback without TLS or without a
    token; None when it is local or has both."""
    if is_local(listen) or (tls and token):
        return None
    risks = ([] if tls else ["without TLS: prompts, answers and any token travel in clear text"]) + \
            ([] if token else ["without an API token: anyone who reaches the port can generate"])
    return (f"the public API listens on {listen}, beyond loopback, {'; '.join(risks)}. Use --tls-cert/--tls-key "
            f"and --api-token-file (or ${TOKEN_ENV}), or listen on 127.0.0.1 behind a proxy that does both")
