"""The API surface: the gRPC services (encoderd.v1 and the Compat service Envoy transcodes to REST), the
in-process API, request options parsed once at the edge, errors mapped to status, responses."""
