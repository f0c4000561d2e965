"""Process wiring: start the workers, serve gRPC (+ health, reflection), drain on signals."""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ..v1 import encoderd_pb2, encoderd_pb2_grpc
from .config import ServerConfig
from .engine import Engine
from .service import EncoderService

log = logging.getLogger("encoderd")

OVERALL = ""  # the health service's name for the server as a whole
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class Server:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.health = health.aio.HealthServicer()
        self.engine = Engine(config, on_model_state=self._on_model_state)
        self.grpc = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ])
        self._stop = asyncio.Event()
        self.bound_port: int | None = None

    def _on_model_state(self, name: str, ready: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        asyncio.get_running_loop().create_task(self.health.set(name, status))

    async def start(self) -> None:
        cfg = self.config
        await self.health.set(OVERALL, health_pb2.HealthCheckResponse.NOT_SERVING)
        encoderd_pb2_grpc.add_EncoderServicer_to_server(EncoderService(self.engine), self.grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection((
            encoderd_pb2.DESCRIPTOR.services_by_name["Encoder"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME), self.grpc)
        self.bound_port = self.grpc.add_insecure_port(f"{cfg.host}:{cfg.grpc_port}")
        if not self.bound_port:
            raise SystemExit(f"cannot listen on {cfg.host}:{cfg.grpc_port}")
        # Listen first so health checks answer NOT_SERVING while models load.
        await self.grpc.start()
        if cfg.metrics_port:
            from prometheus_client import start_http_server

            start_http_server(cfg.metrics_port, addr=cfg.host)
        await self.engine.start()
        await self.health.set(OVERALL, health_pb2.HealthCheckResponse.SERVING)
        log.info("encoderd ready: gRPC on %s:%d serving %s", cfg.host, self.bound_port, ", ".join(self.engine.models))

    async def drain_and_stop(self) -> None:
        """Stop accepting, let in-flight calls finish (up to the drain timeout), stop workers."""
        log.info("[shutdown] draining for up to %.0fs", self.config.drain_timeout)
        await self.health.enter_graceful_shutdown()
        await self.grpc.stop(self.config.drain_timeout)
        await self.engine.stop()
        log.info("[shutdown] done")

    def request_stop(self) -> None:
        self._stop.set()

    async def run_until_stopped(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        try:
            await self.start()
            await self._stop.wait()
        finally:
            await self.drain_and_stop()


async def _serve(config: ServerConfig) -> None:
    # grpc.aio objects bind to the loop they are created on: create them inside it.
    await Server(config).run_until_stopped()


def serve(config: ServerConfig) -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        asyncio.run(_serve(config))
        return
    uvloop.run(_serve(config))
