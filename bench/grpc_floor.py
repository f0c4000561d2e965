"""A gRPC server that refuses every Embed at once and does nothing else: the floor under bench.flood's
refusal latencies (issue 42, item 2).

    python -m encoderd.bench.grpc_floor PORT [--retry-after SECONDS]

bench.flood --floor floods it as it floods encoderd, with the same clients on the same host: what its
refusals take is what grpc.aio itself (on uvloop, as encoderd's frontend runs it) and the flood's own
clients cost, with no admission, no model and no metrics. A burst of 600 calls at once is refused in
turn by one event loop whatever each refusal costs, and the clients that sent them share the cores.
"""

from __future__ import annotations

import argparse
import sys

import grpc
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ..v1 import encoderd_pb2_grpc


class RefuseEverything(encoderd_pb2_grpc.EncoderServicer):
    """RESOURCE_EXHAUSTED with a retry-after trailer, as encoderd refuses an overload."""

    def __init__(self, retry_after_s: int):
        self.trailers = (("retry-after", str(retry_after_s)),)

    async def Embed(self, request, context):
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the floor server refuses every call", self.trailers)


async def serve(port: int, retry_after_s: int) -> None:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.so_reuseport", 0)])
    encoderd_pb2_grpc.add_EncoderServicer_to_server(RefuseEverything(retry_after_s), server)
    checker = health.aio.HealthServicer()
    await checker.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("port", type=int)
    parser.add_argument("--retry-after", type=int, default=1, help="the trailer's seconds (default: %(default)s)")
    args = parser.parse_args(argv)
    uvloop.run(serve(args.port, args.retry_after))
    return 0


if __name__ == "__main__":
    sys.exit(main())
