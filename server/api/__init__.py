"""The API surface: the gRPC services (encoderd.v1 and the Compat service Envoy transcodes to REST, with
its dialects and their shared REST helpers), auth, safe deserialization, responses, OpenAPI and reflection."""
