"""The REST API as an OpenAPI 3.1 document, derived from the same google.api.http rules
and messages that Envoy's transcoder serves (never written by hand, so never out of step).

Routes answering google.api.HttpBody render their JSON in the server (OpenAI, Cohere,
Infinity and TEI shapes); their response schema is left open and their summary is the
RPC's name. Field names are the protos' (snake_case), as the transcoder prints them.
"""

from __future__ import annotations

import functools
import re

from google.protobuf.descriptor import FieldDescriptor

SCALARS: dict[int, dict[str, object]] = {
    FieldDescriptor.TYPE_DOUBLE: {"type": "number"},
    FieldDescriptor.TYPE_FLOAT: {"type": "number"},
    FieldDescriptor.TYPE_BOOL: {"type": "boolean"},
    FieldDescriptor.TYPE_STRING: {"type": "string"},
    FieldDescriptor.TYPE_BYTES: {"type": "string", "contentEncoding": "base64"},
    # proto3 JSON: 64-bit integers are strings (numbers accepted too)
    **{
        t: {"type": ["string", "integer"]}
        for t in (
            FieldDescriptor.TYPE_INT64,
            FieldDescriptor.TYPE_UINT64,
            FieldDescriptor.TYPE_SINT64,
            FieldDescriptor.TYPE_FIXED64,
            FieldDescriptor.TYPE_SFIXED64,
        )
    },
}
# Well-known types, as proto3 JSON writes them.
WELL_KNOWN = {
    "google.protobuf.Value": {},
    "google.protobuf.Struct": {"type": "object"},
    "google.protobuf.ListValue": {"type": "array"},
    "google.protobuf.Empty": {"type": "object"},
    "google.api.HttpBody": {},
}
ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {},
                "code": {"type": "string"},
            },
        }
    },
}


def _field_schema(field, schemas: dict) -> dict:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        schema = _message_ref(field.message_type, schemas)
    elif field.type == FieldDescriptor.TYPE_ENUM:
        schema = {"type": "string", "enum": [v.name for v in field.enum_type.values]}
    else:
        schema = dict(SCALARS.get(field.type, {"type": "integer"}))
    return {"type": "array", "items": schema} if field.is_repeated else schema


def _message_ref(message, schemas: dict) -> dict:
    """A $ref to the message's schema, adding it (and what it uses) to `schemas`."""
    if message.full_name in WELL_KNOWN:
        return dict(WELL_KNOWN[message.full_name])
    if message.full_name not in schemas:
        schemas[message.full_name] = {}  # placeholder first: messages may refer to themselves
        schemas[message.full_name] = {
            "type": "object",
            "properties": {f.name: _field_schema(f, schemas) for f in message.fields},
        }
    return {"$ref": f"#/components/schemas/{message.full_name}"}


def _path(template: str) -> tuple[str, list[str]]:
    """/v1/models/{id=**} -> (/v1/models/{id}, ["id"])."""
    names = re.findall(r"\{([^}=]+)(?:=[^}]*)?\}", template)
    return re.sub(r"\{([^}=]+)(?:=[^}]*)?\}", r"{\1}", template), names


def _operation(service, method, verb: str, template: str, body: str, index: int, schemas: dict) -> dict:
    path_names = _path(template)[1]
    operation = {
        "operationId": f"{service.name}.{method.name}" + (f".{index}" if index else ""),
        "tags": [service.name],
        "summary": method.name,
    }
    parameters = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}} for n in path_names]
    if body == "*":
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": _message_ref(method.input_type, schemas)}},
        }
    else:  # GET: the request's other fields are query parameters
        parameters += [
            {"name": f.name, "in": "query", "schema": _field_schema(f, schemas)}
            for f in method.input_type.fields
            if f.name not in path_names
        ]
    if parameters:
        operation["parameters"] = parameters
    operation["responses"] = {
        "200": {
            "description": "OK",
            "content": {"application/json": {"schema": _message_ref(method.output_type, schemas)}},
        },
        "default": {
            "description": "an error",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        },
    }
    return operation


@functools.cache
def document(url_prefix: str = "") -> dict:
    """The document; under a REST --url-prefix its `servers` says where the paths are (a URL relative
    to the document's own, as OpenAPI reads it), so generated clients call /api/v1/embeddings."""
    from google.api import annotations_pb2

    from ...v1 import compat_pb2, encoderd_pb2

    paths: dict[str, dict] = {}
    schemas: dict[str, dict] = {"Error": ERROR}
    for module in (encoderd_pb2, compat_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                rule = method.GetOptions().Extensions[annotations_pb2.http]
                for index, binding in enumerate((rule, *rule.additional_bindings)):
                    verb = binding.WhichOneof("pattern")
                    if not verb or verb == "custom":
                        continue
                    template = getattr(binding, verb)
                    paths.setdefault(_path(template)[0], {})[verb] = _operation(
                        service, method, verb, template, binding.body, index, schemas
                    )
    servers = {"servers": [{"url": url_prefix, "description": "this server's REST routes (--url-prefix)"}]}
    return {
        "openapi": "3.1.0",
        **(servers if url_prefix else {}),
        "info": {
            "title": "encoderd REST API",
            "version": "v1",
            "description": "OpenAI-, Cohere-, Infinity- and TEI-compatible routes and encoderd's own, "
            "generated from the google.api.http rules of protos/encoderd/v1.",
        },
        "paths": dict(sorted(paths.items())),
        "components": {"schemas": schemas},
    }
