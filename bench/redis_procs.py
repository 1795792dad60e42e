"""Run ``redis-server`` (one node, or a 3-master Redis Cluster) on free 127.0.0.1 ports.

Every process is started in its own temporary directory, with persistence off,
and stopped by its PID. Used by the tests (which check
``require_tool("redis-server")`` and ``require_tool("redis-cli")`` first,
tests/conftest.py) and by the multi-replica benchmark (bench/fleet.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from .procs import free_port

_START_TIMEOUT_S = 20.0


def _cli(port: int, *args: str, timeout_s: float = 10.0) -> str:
    return subprocess.run(
        ["redis-cli", "-h", "127.0.0.1", "-p", str(port), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    ).stdout


_PORT_TRIES = 4  # fresh ports tried when a chosen one was taken before redis bound it


class RedisNode:
    """One ``redis-server`` on a free loopback port (``extra`` args appended).

    ``cluster_bus``: the node is a cluster node, with its bus on a second free
    port (it defaults to port + 10000, which a free port may not allow).
    """

    def __init__(
        self, directory: Path, *extra: str, port: int | None = None, cluster_bus: bool = False
    ) -> None:
        self.fixed_port = port is not None
        self.port = port or free_port()
        self.bus_port = free_port() if cluster_bus else None
        self.directory = directory
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> RedisNode:
        """Start and wait for PONG. A free port is only free when chosen: another
        process (a redis-cli's source port, say) may take it before redis binds
        it, and redis then exits "Address already in use"; a node whose ports
        were chosen here tries fresh ones."""
        for attempt in range(_PORT_TRIES):
            try:
                return self._start()
            except _PortTaken:
                if self.fixed_port or attempt == _PORT_TRIES - 1:
                    raise
                self.port = free_port()
                self.bus_port = free_port() if self.bus_port is not None else None
        raise AssertionError("unreachable")

    def _start(self) -> RedisNode:
        self.directory.mkdir(parents=True, exist_ok=True)
        log_path = self.directory / "redis.log"
        logged = log_path.stat().st_size if log_path.exists() else 0
        bus = [] if self.bus_port is None else ["--cluster-port", str(self.bus_port)]
        log = open(log_path, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--dir",
                str(self.directory),
                "--save",
                "",
                "--appendonly",
                "no",
                *bus,
                *self.extra,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                with open(log_path, "rb") as f:
                    f.seek(logged)
                    said = f.read().decode(errors="replace")
                if "Address already in use" in said:
                    raise _PortTaken(said)
                code = self.proc.returncode
                raise RuntimeError(f"redis-server exited with {code}: {said[-500:]}")
            if _cli(self.port, "PING", timeout_s=2).strip() == "PONG":
                return self
            time.sleep(0.05)
        self.kill()  # never leave a half-started server behind
        raise TimeoutError(f"redis-server on {self.port} did not start")

    def cli(self, *args: str) -> str:
        return _cli(self.port, *args)

    def kill(self) -> None:
        """SIGKILL (a crash: no shutdown, no goodbye to the cluster)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    stop = kill


class _PortTaken(RuntimeError):
    """redis-server exited at start because its port was taken meanwhile."""


class RedisClusterNodes:
    """Three masters, no replicas: ``redis-cli --cluster create``, then cluster_state:ok.

    ``cluster-require-full-coverage no``: the shards left serve their slots
    when one dies, as a cache should be configured (docs/design.md, "Redis tier").
    """

    def __init__(self, directory: Path, masters: int = 3, *extra: str) -> None:
        self.nodes = [
            RedisNode(
                directory / f"node{i}",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "1000",
                "--cluster-require-full-coverage",
                "no",
                *extra,
                cluster_bus=True,
            )
            for i in range(masters)
        ]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> RedisClusterNodes:
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> RedisClusterNodes:
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        out = subprocess.run(
            ["redis-cli", "--cluster", "create", *addresses]
            + ["--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout}{out.stderr}")
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in node.cli("CLUSTER", "INFO") for node in self.nodes):
                return self
            time.sleep(0.1)
        raise TimeoutError("the Redis Cluster did not reach cluster_state:ok")

    def keys_per_node(self) -> list[int]:
        return [int(node.cli("DBSIZE").strip() or 0) for node in self.nodes]

    def used_memory(self) -> list[int]:
        """Each master's ``used_memory`` (bytes)."""
        out = []
        for node in self.nodes:
            info = dict(
                line.split(":", 1) for line in node.cli("INFO", "memory").split() if ":" in line
            )
            out.append(int(info.get("used_memory", 0)))
        return out

    def flush(self) -> None:
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.cli("FLUSHALL")

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()
