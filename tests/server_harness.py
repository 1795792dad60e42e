"""Run a real GenAIServer (grpc.aio + engine process) on a free 127.0.0.1 port in a thread."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import grpc

from genai_service.config import EngineConfig, ServerConfig
from genai_service.server.app import GenAIServer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def secure_config(
    engine: EngineConfig, pki: Path, auth_tokens: tuple[tuple[str, str], ...]
) -> ServerConfig:
    """A server on a free port that requires client certificates signed by the
    ``pki`` fixture's CA (tests/conftest.py) and one of ``auth_tokens``."""
    return ServerConfig(
        engine=engine,
        port=free_port(),
        auth_tokens=auth_tokens,
        tls_cert_file=str(pki / "server.pem"),
        tls_key_file=str(pki / "server.key"),
        tls_client_ca_file=str(pki / "ca.pem"),
    )


class ServerThread:
    """Owns an event loop thread running the server; everything else talks to it by RPC."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server: GenAIServer | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.config.port}"

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> ServerThread:
        self.thread.start()

        async def boot() -> GenAIServer:
            server = GenAIServer(self.config)
            await server.start()
            return server

        self.server = self.run(boot())
        return self

    def stop(self, grace_s: float = 0) -> None:
        if self.server is not None:
            self.run(self.server.stop(grace_s))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.target)


def start_http_server(model_dir: str | Path, **settings: Any) -> ServerThread:
    """A server on ``model_dir`` with the HTTP plane on a free port too (the
    OpenAI-compatible tests); ``settings`` are more ServerConfig fields."""
    config = ServerConfig(
        engine=EngineConfig(model_dir=str(model_dir)), port=free_port(), http_port=0, **settings
    )
    return ServerThread(config).start()
