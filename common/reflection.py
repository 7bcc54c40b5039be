"""Server reflection under both names clients use: grpc.reflection.v1 and v1alpha.

grpcio-reflection ships only v1alpha, and grpcurl asks v1 first. The two protos are the same
messages with the same field numbers, so one servicer answers both: v1 is registered with the
v1alpha messages. Both parse their own requests (``add_parsed_servicer``): a malformed one gets
INVALID_ARGUMENT, not gRPC's INTERNAL.
"""

from __future__ import annotations

import grpc
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as pb

from common.parsed_servicer import add_parsed_servicer

V1_SERVICE = "grpc.reflection.v1.ServerReflection"


def enable_reflection(service_names: tuple[str, ...], server: grpc.Server) -> None:
    """Reflection for ``service_names`` (both reflection services are listed too) on ``server``."""
    names = (*service_names, reflection.SERVICE_NAME, V1_SERVICE)
    servicer = reflection.ReflectionServicer(names)
    service = pb.DESCRIPTOR.services_by_name["ServerReflection"]
    for name in (reflection.SERVICE_NAME, V1_SERVICE):
        add_parsed_servicer(servicer, service, server, name)
