"""`encoderd gateway render`: a standalone Envoy config for operators running Envoy themselves."""

from __future__ import annotations

import argparse
from pathlib import Path

from .envoy import DESCRIPTOR_NAME, GatewayError, GatewaySettings, ListenerLimits, find_envoy, render


def add_commands(commands) -> None:
    gateway = commands.add_parser(
        "gateway", help="the Envoy REST gateway", description="Envoy configuration for encoderd's REST API."
    )
    actions = gateway.add_subparsers(dest="gateway_command", required=True)
    out = actions.add_parser(
        "render",
        help="write envoy.yaml and the proto descriptor set",
        description="Write DIR/envoy.yaml and DIR/encoderd.pb: REST (OpenAI / Cohere / encoderd "
        "JSON) transcoded to the gRPC servers given by --grpc-address.",
    )
    out.add_argument("--out", required=True, type=Path, help="output directory (created if missing)")
    out.add_argument(
        "--grpc-address",
        action="append",
        default=None,
        help="HOST:PORT of an encoderd gRPC server; repeat to balance over several "
        "(least-request) [default: 127.0.0.1:50051]",
    )
    out.add_argument("--rest-host", default="0.0.0.0", help="address Envoy listens on [default: %(default)s]")
    out.add_argument("--rest-port", type=int, default=7997, help="REST port [default: %(default)s]")
    out.add_argument(
        "--admin-port", type=int, default=9901, help="Envoy admin on 127.0.0.1 (0 = none) [default: %(default)s]"
    )
    out.add_argument(
        "--max-body-mb",
        type=float,
        default=32.0,
        help="largest request body in MiB; bigger ones get 413 [default: %(default)s]",
    )
    out.add_argument(
        "--cors-allow-origin",
        action="append",
        default=None,
        metavar="ORIGIN",
        help="let browser pages from ORIGIN (or * for any) call the REST API; repeatable [default: off]",
    )
    out.add_argument(
        "--url-prefix",
        default="",
        help="serve the REST routes under this path (/api: /api/v1/embeddings); /health answers with and without it",
    )
    out.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds per request before 504 (0 = no limit) [default: %(default)s]",
    )
    limits = ListenerLimits()
    for flag, default, what in (
        ("--header-timeout", limits.header_timeout_s, "seconds to send all request headers (and finish TLS)"),
        (
            "--request-timeout",
            limits.request_timeout_s,
            "seconds to send a whole request, body too (408 past it; 0 = no limit)",
        ),
        ("--idle-timeout", limits.idle_timeout_s, "seconds a connection may stay open with nothing in flight"),
        (
            "--max-connection-duration",
            limits.max_connection_duration_s,
            "seconds before a connection is drained (0 = no limit)",
        ),
        ("--max-connections", limits.max_connections, "open connections in all"),
        ("--buffer-kb", limits.buffer_bytes // 1024, "read/write buffer per connection in KiB"),
        ("--max-header-kb", limits.max_header_bytes // 1024, "largest request headers in KiB (431 past it)"),
        ("--max-in-flight", limits.max_in_flight, "requests in flight to the gRPC server(s); more get 429 at once"),
    ):
        out.add_argument(flag, type=type(default), default=default, help=f"{what} [default: %(default)s]")
    out.add_argument("--tls-cert", default="", help="PEM certificate chain: serve REST over HTTPS (with --tls-key)")
    out.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    out.add_argument(
        "--tls-client-ca", default="", help="PEM CA bundle: require client certificates it signed (mutual TLS)"
    )


def run(args: argparse.Namespace) -> int:
    settings = GatewaySettings(
        grpc_addresses=tuple(args.grpc_address or ["127.0.0.1:50051"]),
        rest_host=args.rest_host,
        rest_port=args.rest_port,
        admin_port=args.admin_port,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
        timeout_s=args.timeout,
        cors_allow_origins=tuple(args.cors_allow_origin or ()),
        url_prefix=args.url_prefix,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        limits=ListenerLimits(
            args.header_timeout,
            args.idle_timeout,
            args.max_connection_duration,
            args.max_connections,
            args.buffer_kb * 1024,
            args.max_header_kb * 1024,
            args.max_in_flight,
            args.request_timeout,
        ),
    )
    if bool(args.tls_cert) != bool(args.tls_key) or (args.tls_client_ca and not args.tls_cert):
        raise SystemExit("encoderd gateway: TLS needs both --tls-cert and --tls-key")
    try:
        config = render(args.out, settings)
    except GatewayError as exc:
        raise SystemExit(f"encoderd gateway: {exc}") from exc
    try:
        binary = find_envoy()
    except GatewayError:
        binary = "envoy"
    print(f"wrote {config} and {config.with_name(DESCRIPTOR_NAME)}\nrun:  {binary} --config-path {config}")
    return 0
