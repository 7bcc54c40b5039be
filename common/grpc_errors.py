"""Typed errors -> gRPC statuses with rich details (google.rpc.Status), one table for all.

``InvalidRequestError`` carries the offending field as a ``google.rpc.BadRequest`` field
violation; every other ``EagleError`` maps to its class's ``grpc_code``. Anything else
is a bug and surfaces as INTERNAL.
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from common.errors import EagleError, InvalidRequestError

# Messages quote the offending input; a status travels in metadata (8 KiB by default), so what a
# message echoes is cut: a 200,000-character role once turned the real error into RESOURCE_EXHAUSTED.
MAX_MESSAGE_CHARS = 1024


def clip(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how much was left out."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def to_status(exc: Exception) -> grpc.Status:
    """The rich status for ``exc`` (INTERNAL for anything that is not an EagleError)."""
    name = exc.grpc_code if isinstance(exc, EagleError) else "INTERNAL"
    message = str(exc) if isinstance(exc, EagleError) else f"internal error: {type(exc).__name__}: {exc}"
    status = status_pb2.Status(code=getattr(code_pb2, name), message=clip(message))
    if isinstance(exc, InvalidRequestError):
        detail = any_pb2.Any()
        detail.Pack(error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=clip(exc.field, 256), description=clip(exc.message))]))
        status.details.append(detail)
    return rpc_status.to_status(status)


def abort(context: grpc.ServicerContext, exc: Exception) -> None:
    """Terminate the RPC with ``exc``'s status (raises, as ``context.abort`` does)."""
    context.abort_with_status(to_status(exc))
