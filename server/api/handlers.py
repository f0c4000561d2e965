"""Register servicers with deserializers that cannot crash a call.

The generated `add_*Servicer_to_server` functions deserialize with
`FromString`; a malformed payload (bad wire format, invalid UTF-8 in a
string) then ends as INTERNAL. Here such a payload becomes a
MalformedRequest that the servicer answers with INVALID_ARGUMENT. So does an
enum field holding a number its enum does not define (proto3 enums are open:
`priority: 99` parses), in any request of any method, at any depth.
"""

from __future__ import annotations

import grpc
from google.protobuf import empty_pb2, message_factory
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet

from ..base.errors import echo
from .messages import Serialized


class MalformedRequest:
    """What the servicer answers instead of the request; `id`: the request's own `id` field where
    it has one that could be read (EmbedStream answers each message by it)."""

    def __init__(self, reason: str, id: str = ""):
        self.reason = reason
        self.id = id


def _id_of(message_class, data: bytes) -> str:
    """The `id` string field of a refused payload, read from the wire format as unknown fields of an
    Empty, which checks no UTF-8 (one bad UTF-8 string fails the whole message's parse)."""
    field = message_class.DESCRIPTOR.fields_by_name.get("id")
    if field is None or field.type != field.TYPE_STRING:
        return ""
    found = ""
    try:
        for unknown in UnknownFieldSet(empty_pb2.Empty.FromString(data)):
            if unknown.field_number == field.number and isinstance(unknown.data, bytes):
                found = unknown.data.decode("utf-8", "replace")  # the last one wins, as in a parse
    except DecodeError:
        return ""
    return found


def unknown_enum_value(message, path: str = "") -> str | None:
    """The first enum field (as `field.sub[2].name = 99`) set to a number its enum does not
    define, or None. Only set enum and message fields are walked, so plain requests cost little;
    google.protobuf types (Struct: REST JSON bodies) hold no enum of ours and are skipped."""
    for field, value in message.ListFields():
        if field.enum_type is None and (
            field.message_type is None or field.message_type.full_name.startswith("google.protobuf.")
        ):
            continue
        name = f"{path}{field.name}"
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            items = (
                [(f"{name}[{echo(k)}]", v) for k, v in value.items()]
                if value_field.message_type or value_field.enum_type
                else []
            )
            described = value_field  # a map's items are its values
        elif field.is_repeated:
            described = field
            items = [(f"{name}[{i}]", v) for i, v in enumerate(value)]
        else:
            described = field
            items = [(name, value)]
        for where, item in items:
            if described.enum_type is not None and item not in described.enum_type.values_by_number:
                return f"{where} = {item}"
            if described.message_type is not None and (found := unknown_enum_value(item, where + ".")):
                return found
    return None


def _safe(message_class):
    def deserialize(data: bytes):
        try:
            message = message_class.FromString(data)
        except (DecodeError, UnicodeDecodeError, ValueError) as exc:
            return MalformedRequest(f"malformed {message_class.DESCRIPTOR.name}: {exc}", _id_of(message_class, data))
        if bad := unknown_enum_value(message):
            return MalformedRequest(f"{bad} is not a valid value of that field's enum", _id_of(message_class, data))
        return message

    return deserialize


def _serialize(response) -> bytes:
    """A response message's wire format; one the servicer wrote in wire format itself (Serialized: a
    big Embed answer, messages.embed_response) goes as it is."""
    return response.wire if isinstance(response, Serialized) else response.SerializeToString()


def add_servicer(server: grpc.aio.Server, servicer, service_descriptor) -> None:
    handlers = {}
    for method in service_descriptor.methods:
        request_class = message_factory.GetMessageClass(method.input_type)
        factory = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = factory(
            getattr(servicer, method.name),
            request_deserializer=_safe(request_class),
            response_serializer=_serialize,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service_descriptor.full_name, handlers),))
