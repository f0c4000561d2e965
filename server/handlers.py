"""Register servicers with deserializers that cannot crash a call.

The generated `add_*Servicer_to_server` functions deserialize with
`FromString`; a malformed payload (bad wire format, invalid UTF-8 in a
string) then ends as INTERNAL. Here such a payload becomes a
MalformedRequest that the servicer answers with INVALID_ARGUMENT.
"""

from __future__ import annotations

import grpc
from google.protobuf import message_factory
from google.protobuf.message import DecodeError


class MalformedRequest:
    def __init__(self, reason: str):
        self.reason = reason


def _safe(message_class):
    def deserialize(data: bytes):
        try:
            return message_class.FromString(data)
        except (DecodeError, UnicodeDecodeError, ValueError) as exc:
            return MalformedRequest(f"malformed {message_class.DESCRIPTOR.name}: {exc}")
    return deserialize


def add_servicer(server: grpc.aio.Server, servicer, service_descriptor) -> None:
    handlers = {}
    for method in service_descriptor.methods:
        request_class = message_factory.GetMessageClass(method.input_type)
        response_class = message_factory.GetMessageClass(method.output_type)
        factory = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = factory(getattr(servicer, method.name),
                                        request_deserializer=_safe(request_class),
                                        response_serializer=response_class.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service_descriptor.full_name, handlers),))
