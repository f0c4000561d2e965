"""gRPC server reflection under its v1 name, grpc.reflection.v1, beside v1alpha.

grpcio-reflection serves only v1alpha. v1 is the same protocol under another package
(identical messages, field for field), so its descriptor is derived here from the
v1alpha one, and its method runs the v1alpha servicer; the wire bytes are the same.
"""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha

PACKAGE = "grpc.reflection.v1"
SERVICE_NAME = f"{PACKAGE}.ServerReflection"


def _register_v1_descriptor() -> None:
    """Add grpc/reflection/v1/reflection.proto to the default pool (so reflection can describe itself)."""
    pool = descriptor_pool.Default()
    try:
        pool.FindServiceByName(SERVICE_NAME)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha.DESCRIPTOR.CopyToProto(proto)
    old, new = f".{v1alpha.DESCRIPTOR.package}.", f".{PACKAGE}."
    proto.name, proto.package = "grpc/reflection/v1/reflection.proto", PACKAGE
    proto.ClearField("options")
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):  # message-typed fields only
                field.type_name = field.type_name.replace(old, new)
    for method in proto.service[0].method:
        method.input_type = method.input_type.replace(old, new)
        method.output_type = method.output_type.replace(old, new)
    pool.Add(proto)


def enable(service_names: tuple[str, ...], server: grpc.aio.Server) -> None:
    """Reflection v1alpha and v1 for `service_names` (both reflection services are listed too)."""
    _register_v1_descriptor()
    names = (*service_names, reflection.SERVICE_NAME, SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    servicer = reflection.aio.ReflectionServicer(names)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=v1alpha.ServerReflectionRequest.FromString,
        response_serializer=v1alpha.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, {"ServerReflectionInfo": handler}),)
    )
