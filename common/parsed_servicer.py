"""Registering a servicer whose handlers parse their own request bytes.

gRPC's deserializer answers a request it cannot parse with INTERNAL ("Exception deserializing
request!"), which says "a bug" to the client. Registered here, every method takes the raw bytes
and a corrupt message, or a string field that is not UTF-8, gets INVALID_ARGUMENT naming the
request type instead.
"""

from __future__ import annotations

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health, health_pb2

from common.errors import InvalidRequestError
from common.grpc_errors import abort

_HANDLERS = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}


def add_parsed_servicer(servicer, service: ServiceDescriptor, server: grpc.Server, name: str | None = None) -> None:
    """Register ``servicer``'s methods of ``service`` on ``server`` under ``name`` (default: the
    service's full name), each parsing its own requests. Methods the servicer lacks are left out."""
    handlers = {}
    for method in service.methods:
        implementation = getattr(servicer, method.name, None)
        if implementation is None:
            continue
        streams = (method.client_streaming, method.server_streaming)
        handlers[method.name] = _HANDLERS[streams](
            _parsing(implementation, GetMessageClass(method.input_type), *streams),
            response_serializer=GetMessageClass(method.output_type).SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name or service.full_name, handlers),))


def add_health_servicer(servicer: health.HealthServicer, server: grpc.Server) -> None:
    """grpc.health.v1.Health (Check, Watch, List), requests parsed as above."""
    add_parsed_servicer(servicer, health_pb2.DESCRIPTOR.services_by_name["Health"], server)


def _parse(raw: bytes, request_type, context: grpc.ServicerContext):
    try:
        return request_type.FromString(raw)
    except DecodeError as exc:
        abort(context, InvalidRequestError("request", f"not a valid {request_type.DESCRIPTOR.name}: {exc}"))


def _parsing(method, request_type, client_streaming: bool, server_streaming: bool):
    """``method`` taking raw request bytes (or an iterator of them) instead of messages."""
    if client_streaming:
        return lambda raws, context: method((_parse(raw, request_type, context) for raw in raws), context)
    if server_streaming:
        def stream(raw, context):
            yield from method(_parse(raw, request_type, context), context)
        return stream
    return lambda raw, context: method(_parse(raw, request_type, context), context)
