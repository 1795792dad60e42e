"""Run `genai-kvstore` as a child process on a free 127.0.0.1 port."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from genai_service.config import KvStoreConfig
from kvstore.protocol import AUTH_TOKEN_ENV
from tests.server_harness import free_port

DATA_PLANE_TOKEN = "test-data-plane-token"  # what the harness's kvstores require


class KvStoreProcess:
    """``genai-kvstore`` requiring ``token`` (passed in its environment, as
    genai-stack does); with ``token=None`` the ``args`` must say how it runs
    (``--insecure``, ``--auth-token-file``). ``credentials``: for ``--tls-cert``."""

    def __init__(
        self,
        *args: str,
        port: int | None = None,
        token: str | None = DATA_PLANE_TOKEN,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.port = port or free_port()
        self.args = args
        self.token = token
        self.credentials = credentials  # how the health check dials a kvstore serving TLS
        self.proc: subprocess.Popen[bytes] | None = None

    def config(self, **settings: object) -> KvStoreConfig:
        """The server-side ``KvStoreConfig`` that reaches this kvstore with its token."""
        return KvStoreConfig(self.target, auth_token=self.token, **settings)  # type: ignore[arg-type]

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, log: Path | None = None) -> KvStoreProcess:
        out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
        env = {k: v for k, v in os.environ.items() if k != AUTH_TOKEN_ENV}
        if self.token is not None:
            env[AUTH_TOKEN_ENV] = self.token
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore", "--port", str(self.port), *self.args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.monotonic() + 30
        channel = (
            grpc.secure_channel(self.target, self.credentials)
            if self.credentials
            else grpc.insecure_channel(self.target)
        )
        with channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"kvstore exited with {self.proc.returncode}")
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return self
                except grpc.RpcError:
                    pass
                time.sleep(0.05)
        raise TimeoutError("kvstore did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
