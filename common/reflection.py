"""Server reflection under both names clients use: grpc.reflection.v1 and v1alpha.

grpcio-reflection ships only v1alpha, and grpcurl asks v1 first. The two protos are the same
messages with the same field numbers, so one servicer answers both: v1 is registered with the
v1alpha messages' (de)serializers.
"""

from __future__ import annotations

import grpc
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as pb

V1_SERVICE = "grpc.reflection.v1.ServerReflection"


def enable_reflection(service_names: tuple[str, ...], server: grpc.Server) -> None:
    """Reflection for ``service_names`` (both reflection services are listed too) on ``server``."""
    names = (*service_names, reflection.SERVICE_NAME, V1_SERVICE)
    servicer = reflection.ReflectionServicer(names)
    reflection.enable_server_reflection(names, server)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo, request_deserializer=pb.ServerReflectionRequest.FromString,
        response_serializer=pb.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE, {"ServerReflectionInfo": handler}),))
