"""Run `genai-kvstore` as a child process on a free 127.0.0.1 port."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.server_harness import free_port


class KvStoreProcess:
    def __init__(self, *args: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, log: Path | None = None) -> KvStoreProcess:
        out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore", "--port", str(self.port), *self.args],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        with grpc.insecure_channel(self.target) as channel:
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
