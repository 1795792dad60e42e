"""Start-up, health, reflection and graceful shutdown of ``genai-server``."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from genai_common.credentials import server_credentials
from genai_common.decoding import TolerantDecoding
from genai_common.errors import Unavailable
from genai_common.reflection import enable_reflection
from genai_proto.genai.v1 import (
    generate_pb2,
    generate_pb2_grpc,
    model_pb2,
    model_pb2_grpc,
    session_pb2,
    session_pb2_grpc,
)

from ..config import ServerConfig
from ..model.model_dir import load_model_spec
from ..model.tokenizer import Tokenizer
from .constraint_checker import ConstraintChecker
from .engine_process import EngineProcess
from .frontend import Frontend
from .grpc_api.servicers import GenerateServicer, ModelServicer, SessionServicer
from .http_api.http_gateway import HttpGateway
from .metrics import Metrics

log = structlog.get_logger(__name__)

SERVICE_NAMES = (
    generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name,
    session_pb2.DESCRIPTOR.services_by_name["SessionService"].full_name,
    model_pb2.DESCRIPTOR.services_by_name["ModelService"].full_name,
)


class GenAIServer:
    """The control-plane server and its supervised engine process."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        spec = load_model_spec(config.engine.model_dir)
        self.tokenizer = Tokenizer.from_dir(spec.path, spec)
        self.health = HealthServicer()
        self.fatal: asyncio.Future[str] = asyncio.get_event_loop().create_future()
        self.engine = EngineProcess(
            config.engine,
            config.log_format,
            on_state=self._on_engine_state,
            on_fatal=self._on_engine_fatal,
        )
        self.metrics = Metrics()
        self.metrics_port: int | None = None
        limits = config.engine.limits
        self.checker = ConstraintChecker(
            spec,
            limits.max_constraint_bytes,
            config.log_format,
            workers=config.constraint_check_workers,
            timeout_s=config.constraint_check_timeout_ms / 1000,
        )
        self.frontend = Frontend(
            self.engine,
            self.tokenizer,
            config.max_input_chars,
            config.auth_tokens,
            self.metrics,
            config.stream_interval,
            self.checker,
            limits.max_constraint_bytes,
        )
        options = [
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        self.server = grpc.aio.server(
            options=options, interceptors=[TolerantDecoding(SERVICE_NAMES)]
        )
        generate_pb2_grpc.add_GenerateServiceServicer_to_server(
            GenerateServicer(self.frontend), self.server
        )
        session_pb2_grpc.add_SessionServiceServicer_to_server(
            SessionServicer(self.frontend), self.server
        )
        model_pb2_grpc.add_ModelServiceServicer_to_server(ModelServicer(self.frontend), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        enable_reflection(
            (*SERVICE_NAMES, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name),
            self.server,
        )
        address = f"{config.host}:{config.port}"
        if config.tls_cert_file and config.tls_key_file:
            credentials = server_credentials(
                config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file
            )
            self.port = self.server.add_secure_port(address, credentials)
        else:
            self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot bind {config.host}:{config.port}")
        # The HTTP plane shares the frontend (docs/design.md, "HTTP gateway").
        self.http = HttpGateway(self.frontend, config) if config.http_port is not None else None
        self.http_port = self.http.port if self.http is not None else None
        self._stopped = asyncio.Event()
        self._poller: asyncio.Task[None] | None = None

    def _on_engine_fatal(self, reason: str) -> None:
        if not self.fatal.done():
            self.fatal.set_result(reason)

    def _on_engine_state(self, serving: bool) -> None:
        self.metrics.engine_up.set(1 if serving else 0)
        if not serving and not self.frontend.draining:
            self.metrics.engine_restarts.inc()
        if self.frontend.draining:
            return
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else (health_pb2.HealthCheckResponse.NOT_SERVING)
        )
        asyncio.get_running_loop().create_task(self._set_health(status))
        log.info("health", serving=serving)

    async def _set_health(self, status: int) -> None:
        for name in ("", *SERVICE_NAMES):
            await self.health.set(name, status)

    async def start(self) -> None:
        """Listen at once (health answers NOT_SERVING), then start the engine."""
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        log.info("listening", host=self.config.host, port=self.port)
        if self.http is not None:
            await self.http.start()
        if self.config.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.config.host, self.config.metrics_port)
            log.info("metrics", port=self.metrics_port, path="/metrics")
        # The checkers start beside the engine (each loads the tokenizer only).
        await asyncio.gather(
            self.engine.start(self.config.engine_start_timeout_s), self.checker.start()
        )
        self._poller = asyncio.create_task(self._poll_engine_stats())

    async def _poll_engine_stats(self, interval_s: float = 0.5) -> None:
        """Keep the engine's counters fresh for /metrics (one small IPC call):
        an endpoint picker routes on the waiting/running/KV gauges, so they
        are at most half a second old."""
        while not self.frontend.draining:
            if self.engine.ready:
                with contextlib.suppress(Exception):
                    self.metrics.engine.snapshot = await self.engine.stats()
            await asyncio.sleep(interval_s)

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain: NOT_SERVING, refuse new RPCs, let in-flight ones finish, then stop."""
        if self._stopped.is_set():
            return
        grace = self.config.grace_period_s if grace_s is None else grace_s
        deadline = time.monotonic() + grace
        self.frontend.draining = True
        if self._poller is not None:
            self._poller.cancel()
        await self.health.enter_graceful_shutdown()
        log.info("draining", grace_s=grace, inflight=self.frontend.inflight)
        # The port stays open while generations finish: health answers
        # NOT_SERVING (probes and load balancers take the replica out) and the
        # servicers refuse new RPCs with UNAVAILABLE. Then gRPC's stop sends
        # GOAWAY, refuses everything (health included) and gives what still
        # runs the rest of the grace period; whatever runs after that is
        # cancelled (its engine requests aborted).
        # The grace period's last tenth (at most 1 s, at least 0.2 s) ends what
        # still runs with UNAVAILABLE, after the tokens it has streamed, rather
        # than letting gRPC's stop cut it (CANCELLED over gRPC, a stream that
        # just stops over HTTP), so a client knows to retry (on another replica).
        final_s = max(0.2, min(1.0, grace / 10))
        if not await self.frontend.drained(max(0.0, grace - final_s)):
            cut = self.engine.fail_inflight(
                Unavailable(
                    f"the server is shutting down and its grace period ({grace:g} s, "
                    "--grace-period-s) ended before this request finished; retry it"
                )
            )
            log.warning("grace_period_expired", requests_ended=cut)
            await self.frontend.drained(final_s)
        left = max(0.0, deadline - time.monotonic())
        if self.http is not None:
            await asyncio.gather(self.server.stop(left), self.http.stop(left))
        else:
            await self.server.stop(left)
        if self.frontend.inflight:
            log.warning("stopped_with_calls_running", inflight=self.frontend.inflight)
        await asyncio.gather(self.engine.stop(), self.checker.close())
        self._stopped.set()
        log.info("stopped")

    async def wait(self) -> None:
        await self._stopped.wait()


async def serve(config: ServerConfig) -> None:
    """Run until SIGTERM/SIGINT, then shut down gracefully."""
    server = GenAIServer(config)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    start = asyncio.create_task(server.start())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({start, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if start.done() and start.exception() is not None:
        await server.stop(0)
        raise start.exception()  # type: ignore[misc]
    fatal = asyncio.create_task(_wait_fatal(server))
    await asyncio.wait({stopped, fatal}, return_when=asyncio.FIRST_COMPLETED)
    start.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await start
    if server.fatal.done():
        await server.stop(0)
        raise RuntimeError(server.fatal.result())
    await server.stop()


async def _wait_fatal(server: GenAIServer) -> bool:
    await server.fatal
    return True
