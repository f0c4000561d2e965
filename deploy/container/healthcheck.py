#!/usr/bin/env python3
"""Container health check: exit 0 when encoderd's gRPC health service answers SERVING.

Asks the standard grpc.health.v1 service (open even with --api-key) on the local gRPC port, in
plaintext and with no key: with TLS or closed health checks it cannot, and says so.
"""

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def unreachable() -> list[str]:
    """Why the server's own settings (as encoderd serve reads these variables) shut this check out."""
    why = ["TLS is on"] if os.environ.get("ENCODERD_TLS_CERT", "").strip() else []
    if os.environ.get("ENCODERD_NO_OPEN_HEALTH", "").lower() in ("1", "true", "yes", "on"):
        why.append("health checks need an API key")
    return why


def main() -> int:
    why = unreachable()
    if why:
        print(
            f"this HEALTHCHECK speaks plaintext to an open health service, but {' and '.join(why)}: run the "
            "container with --no-healthcheck (or your own --health-cmd) and probe its ports from outside",
            file=sys.stderr,
        )
        return 1
    address = f"127.0.0.1:{os.environ.get('ENCODERD_GRPC_PORT', '50051')}"
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=4)
    except grpc.RpcError as exc:
        print(f"{address}: {exc.code().name}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
