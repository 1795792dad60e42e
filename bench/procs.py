"""Machine facts, free ports and peak resident memory of process trees."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import re
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
MB = 1024 * 1024


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape_metrics(port: int, host: str = "127.0.0.1") -> dict[str, float]:
    """The unlabelled samples of a Prometheus ``/metrics`` page, by name."""
    url = f"http://{host}:{port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    values = {}
    for line in text.splitlines():
        match = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*) ([0-9.e+-]+)", line)
        if match:
            values[match[1]] = float(match[2])
    return values


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine_info() -> dict:
    vm = psutil.virtual_memory()
    return {
        "cpu": _cpu_model(),
        "logical_cores": psutil.cpu_count(logical=True),
        "physical_cores": psutil.cpu_count(logical=False),
        "affinity_cores": len(os.sched_getaffinity(0)),
        "memory_gib": round(vm.total / 1024**3, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def versions() -> dict:
    return {
        "genai-grpc": _version("genai-grpc"),
        "genai-grpc_git_rev": _git("rev-parse", "--short=12", "HEAD"),
        "genai-grpc_git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "onnxruntime": _version("onnxruntime"),
        "onnxruntime-genai": _version("onnxruntime-genai"),
        "numpy": _version("numpy"),
        "grpcio": _version("grpcio"),
    }


def log_tail(path: str | Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a child's log file ("" if it cannot be read)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def proc_status_bytes(pid: int, field: str) -> int:
    """A kB field of ``/proc/PID/status`` (``VmHWM``, ``VmRSS``) in bytes; 0 if unreadable."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    return 0


def _vm_hwm(pid: int) -> int:
    """Peak resident set of one process, in bytes; 0 if unreadable."""
    return proc_status_bytes(pid, "VmHWM")


class RssMonitor:
    """Peak resident memory of a process and its descendants.

    ``hwm()`` reads the kernel's exact per-process peaks (``VmHWM``), by pid:
    the figure to report (their sum bounds the tree's peak from above). A
    thread also samples the tree's summed RSS, rarely: on a 2-core machine,
    sampling several trees at 20 Hz took ~14% of a core and slowed the
    measured engines by ~10%.
    """

    def __init__(self, pid: int, interval_s: float = 1.0) -> None:
        self.root = psutil.Process(pid)
        self.interval_s = interval_s
        self.peak = 0
        self.peak_by_name: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _tree(self) -> list[psutil.Process]:
        try:
            return [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            total = 0
            for i, proc in enumerate(self._tree()):
                try:
                    rss = proc.memory_info().rss
                except psutil.Error:
                    continue
                total += rss
                name = "root" if i == 0 else f"child{i}"
                self.peak_by_name[name] = max(self.peak_by_name.get(name, 0), rss)
            self.peak = max(self.peak, total)

    def hwm(self) -> dict[str, int]:
        return {f"{p.pid}:{_safe_name(p)}": _vm_hwm(p.pid) for p in self._tree()}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def summary(self, hwm: dict[str, int]) -> dict:
        return {
            "sampled_peak_mb": round(self.peak / MB, 1),
            "hwm_sum_mb": round(sum(hwm.values()) / MB, 1),
            "hwm_by_process_mb": {k: round(v / MB, 1) for k, v in hwm.items()},
        }


def _safe_name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return "?"


def wait_serving(target: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Poll ``target``'s grpc.health.v1 until it answers SERVING; RuntimeError
    if ``proc`` exits first, TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
            with contextlib.suppress(grpc.RpcError):
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            time.sleep(0.1)
    raise TimeoutError(f"{target} not SERVING after {timeout_s} s")


def stop_tree(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM ``proc`` (it stops its own children), then kill what is left of its tree."""
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    _gone, alive = psutil.wait_procs(children, timeout=5)
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.kill()


def _busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (every process, every core)."""
    t = psutil.cpu_times()
    return sum(
        getattr(t, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq", "guest")
    )


def _own_seconds() -> float:
    """CPU seconds used by this process and every descendant, live or reaped."""
    me = psutil.Process()
    t = me.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            c = child.cpu_times()
            total += c.user + c.system
    return total


class CpuLedger:
    """How much CPU the benchmark used and how much *other* work took meanwhile.

    The machine may be shared: ``foreign_cores`` (CPU seconds used by
    processes that are not ours, per wall second) says how much of the
    machine was taken away from the measurement; on 2 cores, 0.5 means a
    quarter of the machine. Children count while alive and once reaped.
    """

    def __init__(self) -> None:
        self._mark = self._now()

    @staticmethod
    def _now() -> tuple[float, float, float]:
        return time.monotonic(), _busy_seconds(), _own_seconds()

    def lap(self) -> dict:
        """Figures since the previous lap (or since construction)."""
        now = self._now()
        wall = now[0] - self._mark[0]
        busy, own = now[1] - self._mark[1], now[2] - self._mark[2]
        self._mark = now
        return {
            "wall_s": round(wall, 1),
            "ours_cores": round(own / wall, 2) if wall > 0 else 0.0,
            "foreign_cores": round(max(busy - own, 0.0) / wall, 2) if wall > 0 else 0.0,
        }


def wait_quiet(
    threshold_cores: float = 0.15, window_s: float = 0.5, max_wait_s: float = 30.0
) -> dict:
    """Wait (up to ``max_wait_s``) for a window in which other work uses less
    than ``threshold_cores``; returns how long it waited and the last reading."""
    start = time.monotonic()
    ledger = CpuLedger()
    while True:
        time.sleep(window_s)
        foreign = ledger.lap()["foreign_cores"]
        waited = time.monotonic() - start
        if foreign < threshold_cores or waited >= max_wait_s:
            return {"waited_s": round(waited, 1), "foreign_cores": foreign}


_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of one process (every thread) from ``/proc/PID/stat``; NaN if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return float("nan")
    # comm (field 2) may hold spaces and parentheses: the fields after it
    # start past the last ')'; utime and stime are fields 14 and 15.
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S


def engine_pids(server_pid: int) -> list[int]:
    """The engine process(es) under a ``genai-server``: its ``spawn`` children
    (not multiprocessing's resource tracker)."""
    out = []
    try:
        children = psutil.Process(server_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    for child in children:
        with contextlib.suppress(psutil.Error):
            if any("spawn_main" in part for part in child.cmdline()):
                out.append(child.pid)
    return out


class ProcCpu:
    """CPU seconds of named groups of processes over a window (``lap``).

    Each group is a list of pids; a group's figure is the sum of their
    utime + stime deltas (NaN when one of them vanished meanwhile, or the
    group has none: a process not found is not a process that used nothing).
    """

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups = groups
        self._mark = self._now()

    def _now(self) -> dict[str, float]:
        return {
            name: sum(proc_cpu_seconds(p) for p in pids) if pids else float("nan")
            for name, pids in self.groups.items()
        }

    def lap(self) -> dict[str, float]:
        now = self._now()
        out = {name: now[name] - self._mark[name] for name in now}
        self._mark = now
        return out
