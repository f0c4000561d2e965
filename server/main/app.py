"""Process wiring: start the workers, serve gRPC (+ health, reflection), drain on signals."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ...gateway.envoy import GatewayError, local_address
from ...v1 import compat_pb2, encoderd_pb2
from ...workers.contract.ipc import envoy_admin_socket, frontend_grpc_socket
from ..api import reflection_v1
from ..api.auth import ApiKeyInterceptor, load_keys
from ..api.compat import CompatService
from ..api.handlers import add_servicer
from ..api.service import EncoderService
from ..base import systemd, tls, tracing
from ..base.config import MAX_MESSAGE_BYTES, ServerConfig
from ..base.startup import StartupError, any_free_port, check_ports
from ..models.registry import ModelRegistry

log = logging.getLogger("encoderd")

OVERALL = ""  # the health service's name for the server as a whole
# Names that report the same status as OVERALL: generic gRPC probes ask for the service they call.
OVERALL_ALIASES = (
    encoderd_pb2.DESCRIPTOR.services_by_name["Encoder"].full_name,
    compat_pb2.DESCRIPTOR.services_by_name["Compat"].full_name,
)


def metadata_limit(max_header_bytes: int) -> int:
    """The request metadata this server takes: whatever Envoy admits (--rest-max-header-kb) with what
    it adds, the original path again after a REST route's rewrite and its forwarding headers."""
    return 2 * max_header_bytes + 16 * 1024


class Server:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.health = health.aio.HealthServicer()
        self.registry = ModelRegistry(config, on_model_state=self._on_model_state)
        keys = load_keys(config.api_keys + config.bulk_api_keys, config.api_key_file)
        interceptors = [ApiKeyInterceptor(keys, open_health=config.open_health)] if keys else []
        metadata_bytes = metadata_limit(config.rest_limits.max_header_bytes)
        self.grpc = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                # One limit, not gRPC's soft 8 KiB and hard 16 KiB: between those two it refuses a
                # random share of calls (RESOURCE_EXHAUSTED, a 429 through the gateway).
                ("grpc.max_metadata_size", metadata_bytes),
                ("grpc.absolute_max_metadata_size", metadata_bytes),
                ("grpc.so_reuseport", 0),
            ],
        )
        self._stop = asyncio.Event()
        self._hurry = asyncio.Event()  # a second stop signal: cut the drain short
        self.draining = asyncio.Event()  # set when calls are no longer taken (EmbedStreams end)
        self.bound_port: int | None = None
        self.gateway = None  # the Envoy child serving REST (and, unless --grpc-direct, the gRPC port), when on
        self._serving = False  # READY=1 sent: later model state changes update systemd's STATUS
        self.failure: Exception | None = None  # why the server stopped itself, raised once it has drained

    def _on_model_state(self, name: str, ready: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        asyncio.get_running_loop().create_task(self.health.set(name, status))
        if self._serving:
            systemd.status(self._status_line())

    def _status_line(self) -> str:
        down = [name for name, model in self.registry.models.items() if not model.ready]
        line = f"serving {len(self.registry.models)} model(s) on {self.config.host}:{self.bound_port}"
        return line + (f"; unavailable (worker restarting): {', '.join(down)}" if down else "")

    async def _set_overall(self, status) -> None:
        for name in (OVERALL, *OVERALL_ALIASES):
            await self.health.set(name, status)

    async def start(self) -> None:
        cfg = self.config
        tracing.configure(cfg.otel_endpoint)
        await self._set_overall(health_pb2.HealthCheckResponse.NOT_SERVING)
        add_servicer(
            self.grpc, EncoderService(self.registry, self.draining), encoderd_pb2.DESCRIPTOR.services_by_name["Encoder"]
        )
        add_servicer(
            self.grpc, CompatService(self.registry, self.health), compat_pb2.DESCRIPTOR.services_by_name["Compat"]
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection_v1.enable(
            (
                encoderd_pb2.DESCRIPTOR.services_by_name["Encoder"].full_name,
                compat_pb2.DESCRIPTOR.services_by_name["Compat"].full_name,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            ),
            self.grpc,
        )
        check_ports(
            cfg.host, {"--grpc-port": cfg.grpc_port, "--rest-port": cfg.rest_port, "--metrics-port": cfg.metrics_port}
        )
        self.bound_port, upstream = self._listen_grpc()
        # Listen first so health checks answer NOT_SERVING while models load.
        await self.grpc.start()
        if cfg.rest_port:  # before the models load, so REST /health answers 503 meanwhile
            public_grpc_port = self.bound_port if cfg.grpc_behind_envoy else 0
            self.gateway = await start_gateway(cfg, upstream, public_grpc_port, self._gateway_gave_up)
        if cfg.metrics_port:
            from prometheus_client import start_http_server

            try:
                start_http_server(cfg.metrics_port, addr=cfg.host)
            except OSError as exc:
                raise StartupError(
                    f"cannot listen on {cfg.host}:{cfg.metrics_port} (--metrics-port): {exc.strerror}"
                ) from None
        systemd.status(f"loading {len(cfg.models)} model(s): {', '.join(m.name for m in cfg.models)}")
        await self.registry.start()
        await self._set_overall(health_pb2.HealthCheckResponse.SERVING)
        systemd.ready(self._status_line())
        self._serving = True
        # What start-up built (tokenizers, protobuf descriptors, modules) lives until exit: out of the
        # cyclic GC's sight, full collections under load scan only per-call objects (measured under
        # a 640-client flood: pauses of 100-190 ms otherwise, each one a stall of every call).
        gc.freeze()
        security = "" if not cfg.tls else " (mutual TLS)" if cfg.tls.client_ca else " (TLS)"
        log.info(
            "encoderd ready: gRPC%s on %s:%d serving %s",
            security,
            cfg.host,
            self.bound_port,
            ", ".join(self.registry.models),
        )

    def _listen_grpc(self) -> tuple[int, str]:
        """Bind the gRPC server. Returns the public gRPC port and where Envoy reaches the server.

        Behind Envoy (REST on, no --grpc-direct) the server listens only on its private socket and
        Envoy holds --grpc-port, TLS included: a flood's calls are admitted or refused there, before
        Python. (serve() has checked the TLS files already.)"""
        cfg = self.config
        private = "unix:" + frontend_grpc_socket()  # a socket only this user can reach
        if cfg.grpc_behind_envoy:
            self.grpc.add_insecure_port(private)
            return cfg.grpc_port or any_free_port(cfg.host), private
        credentials = tls.server_credentials(cfg.tls) if cfg.tls else None
        address = f"{cfg.host}:{cfg.grpc_port}"
        try:
            port = (
                self.grpc.add_secure_port(address, credentials) if credentials else self.grpc.add_insecure_port(address)
            )
        except RuntimeError:  # taken between the check and now
            port = 0
        if not port:
            raise StartupError(f"cannot listen on {cfg.host}:{cfg.grpc_port} (--grpc-port)")
        if credentials and cfg.rest_port:  # Envoy's own way in, past TLS
            self.grpc.add_insecure_port(private)
            return port, private
        return port, f"{local_address(cfg.host)}:{port}"

    def _gateway_gave_up(self) -> None:
        """Envoy stays down: with gRPC behind it nothing is served, so stop (and exit non-zero, for the
        service manager to restart the whole server); with --grpc-direct gRPC goes on."""
        if self.config.grpc_behind_envoy:
            self.failure = GatewayError("Envoy, which serves the REST and gRPC ports, could not be kept running")
            self.request_stop()

    async def drain_and_stop(self) -> None:
        """Stop accepting, let in-flight calls finish (up to the drain timeout), stop workers."""
        log.info("[shutdown] draining for up to %.0fs", self.config.drain_timeout)
        self._serving = False
        systemd.stopping(f"draining for up to {self.config.drain_timeout:.0f}s")
        await self.health.enter_graceful_shutdown()
        if self.gateway:  # keeps serving REST during the drain, but is not restarted any more
            self.gateway.stop_supervising()
        if self.config.drain_delay:  # keep serving until load balancers have seen NOT_SERVING
            await self._unless_hurried(asyncio.sleep(self.config.drain_delay))
        self.draining.set()
        deadline = time.monotonic() + self.config.drain_timeout
        if self.gateway:  # Envoy first: what it has taken still reaches a server that serves it
            await self._unless_hurried(self.gateway.drain(self.config.drain_timeout))
        stopping = asyncio.ensure_future(self.grpc.stop(max(0.0, deadline - time.monotonic())))
        await self._unless_hurried(asyncio.shield(stopping))
        if not stopping.done():
            await self.grpc.stop(None)  # the smaller grace wins: calls in flight are cancelled now
            await stopping
        if self.gateway:  # after the drain: in-flight REST calls finish through it
            await self.gateway.stop()
        await self.registry.stop()
        tracing.shutdown()  # flush the last spans
        log.info("[shutdown] done")

    async def _unless_hurried(self, step) -> None:
        """Await a drain step, unless a second stop signal comes first (then the step is dropped)."""
        task = asyncio.ensure_future(step)
        hurry = asyncio.ensure_future(self._hurry.wait())
        await asyncio.wait((task, hurry), return_when=asyncio.FIRST_COMPLETED)
        hurry.cancel()
        if task.done():
            task.result()  # a step that failed fails the drain, as it did before
            return
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    def request_stop(self) -> None:
        self._stop.set()

    def _on_stop_signal(self, sig: signal.Signals) -> None:
        if self._stop.is_set():  # a signal while draining: an operator who will not wait
            if not self._hurry.is_set():
                log.warning("[shutdown] %s during the drain: stopping now; calls in flight are cancelled", sig.name)
                self._hurry.set()
            return
        if sig == signal.SIGHUP:  # a closed terminal, or a reload: there is nothing to reload
            log.info("[shutdown] SIGHUP: encoderd reloads nothing; draining and stopping as on SIGTERM")
        self.request_stop()

    async def run_until_stopped(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, self._on_stop_signal, sig)
        try:
            await self._start_unless_stopped()
            await self._stop.wait()
        finally:
            await self.drain_and_stop()
        if self.failure:
            raise self.failure

    async def _start_unless_stopped(self) -> None:
        """start(), abandoned when SIGTERM comes first: a server still loading models stops at
        once (the workers it started die with it) instead of finishing the load or tracing back."""
        starting = asyncio.create_task(self.start(), name="start")
        stopping = asyncio.create_task(self._stop.wait(), name="stop-requested")
        await asyncio.wait((starting, stopping), return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not starting.done():
            log.info("[shutdown] stop requested while loading models")
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            return
        starting.result()  # a failed start raises here


async def start_gateway(cfg: ServerConfig, upstream: str, grpc_port: int, on_give_up: Callable[[], None]):
    """Envoy on cfg.rest_port, transcoding REST to this server's gRPC at `upstream` (HOST:PORT or
    unix:PATH), and passing native gRPC to it from `grpc_port` too (0 = no gRPC listener)."""
    from ...gateway.envoy import GatewaySettings
    from ...gateway.process import EnvoyProcess

    settings = GatewaySettings(
        grpc_addresses=(upstream,),
        rest_host=cfg.host,
        rest_port=cfg.rest_port,
        max_body_bytes=cfg.rest_max_body_bytes,
        timeout_s=cfg.rest_timeout,
        cors_allow_origins=cfg.cors_allow_origins,
        url_prefix=cfg.url_prefix,
        limits=cfg.rest_limits,
        tls_cert=cfg.tls.cert,
        tls_key=cfg.tls.key,
        tls_client_ca=cfg.tls.client_ca,
        grpc_host=cfg.host,
        grpc_port=grpc_port,
        admin_path=envoy_admin_socket(),
    )
    envoy = EnvoyProcess(settings, cfg.envoy_bin, cfg.log_level, on_give_up, drain_s=cfg.drain_timeout)
    await envoy.start()
    also = f" and gRPC on port {grpc_port}" if grpc_port else ""
    log.info("gateway: Envoy %s (pid %d), REST on %s%s -> %s", envoy.binary, envoy.pid, envoy.url, also, upstream)
    if cfg.rest_limits.max_in_flight > cfg.max_queued_inputs:
        # Each call holds at least one input: Envoy then passes calls the queue bound refuses in
        # Python, behind the backlog (docs/reliability.md, Overload: refusal before Python).
        log.info(
            "gateway: Envoy passes up to %d calls in flight, more than a model's queue holds inputs (%d); "
            "for refusals at once under a flood, set --rest-max-in-flight near the calls the queue admits "
            "(--max-queued-inputs / inputs per call)",
            cfg.rest_limits.max_in_flight,
            cfg.max_queued_inputs,
        )
    return envoy


async def _serve(config: ServerConfig) -> None:
    # grpc.aio objects bind to the loop they are created on: create them inside it.
    await Server(config).run_until_stopped()


def serve(config: ServerConfig) -> None:
    run: Callable[[Coroutine[Any, Any, None]], None]
    try:
        from uvloop import run
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        run = asyncio.run
    if config.tls:
        tls.check(config.tls)  # before anything starts: a bad file is one line and nothing to stop
    run(_serve(config))  # a WorkerStartError reaches cli.main, which says it in one line
