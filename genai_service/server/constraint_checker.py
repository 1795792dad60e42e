"""The frontend's side of the constraint checker (docs/design.md, "Structured output").

Every structured-output constraint and tool schema of a request is checked
before the request goes to the engine: the cheap shape limits here, then a
compile and a few matching steps in the checker's own process
(``guidance/constraint_check.py``), started with ``spawn`` and supervised here.
A verdict is kept by a digest of the constraint (and the field it names), so
clients that send the same schema with every request pay for one check.

A check that crashes the process (a native stack overflow, an abort) or uses
more than ``timeout_s`` of CPU (or five times that in wall time) is
``INVALID_ARGUMENT`` for its request, the process is replaced, and the
verdict is kept like any other (a check's CPU, not its wall time, is what is
limited: the checker runs niced, and on a busy machine a second of CPU can take
far longer); a process whose memory has grown past ``MAX_RSS_BYTES``
(llguidance keeps what a large lexer built) is replaced after its answer.
Nothing here runs llguidance on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing as mp
import signal
import time
from collections import OrderedDict
from multiprocessing.connection import Connection
from typing import Any

import structlog

from genai_common import procfs
from genai_common.errors import InvalidArgument, Unavailable

from ..contract.request import Constraint
from ..guidance.constraint_check import (
    CHECK_STACK_BYTES,
    CheckerReady,
    CheckJob,
    Verdict,
    checker_main,
)
from ..guidance.constraints import constraint_digest, validate_shape
from ..model.model_dir import ModelSpec

log = structlog.get_logger(__name__)

MAX_RSS_BYTES = 768 * 1024 * 1024  # a checker process past this is replaced
VERDICT_CACHE_ENTRIES = 4096  # 16-byte keys and messages of at most ~1.2 KiB
START_TIMEOUT_S = 120.0
POLL_S = 0.05  # how often a running check's CPU time is read
WALL_FACTOR = 5  # a check also ends after this many times its CPU limit in wall time


class _CheckerProcess:
    """One checker process; its methods block (they run in a worker thread)."""

    def __init__(self, args: tuple[Any, ...], name: str) -> None:
        self._args = args
        self._name = name
        self._ctx = mp.get_context("spawn")
        self._proc: Any = None
        self._conn: Connection | None = None
        self.starts = 0
        self.last_check_s = 0.0

    def ensure_started(self, timeout_s: float) -> None:
        if self._proc is not None and self._proc.is_alive():
            return
        self.stop()
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(
            target=checker_main, args=(child, *self._args), name=self._name, daemon=True
        )
        proc.start()
        child.close()
        self._proc, self._conn = proc, parent
        self.starts += 1
        if not parent.poll(timeout_s):
            self.stop()
            raise Unavailable("the constraint checker did not start; retry later")
        try:
            ready = parent.recv()
        except (EOFError, OSError) as e:
            self.stop()
            raise Unavailable("the constraint checker did not start; retry later") from e
        assert isinstance(ready, CheckerReady)
        log.info("constraint_checker_started", pid=proc.pid, rss_bytes=ready.rss_bytes)

    def run(self, job: CheckJob, timeout_s: float) -> str:
        """The verdict for ``job``: "" or the INVALID_ARGUMENT message. The
        limit is the checker's CPU time (it runs niced: on a busy machine a
        check that needs 1 s of CPU may take far longer), with a wall-clock
        bound of ``WALL_FACTOR`` times it."""
        assert self._conn is not None and self._proc is not None
        conn, pid = self._conn, self._proc.pid
        started = time.monotonic()
        cpu_at_start = procfs.cpu_seconds(pid)
        verdict = None
        try:
            conn.send(job)
            while verdict is None:
                if conn.poll(POLL_S):
                    verdict = conn.recv()
                    break
                cpu = procfs.cpu_seconds(pid) - cpu_at_start
                wall = time.monotonic() - started
                if cpu > timeout_s or wall > WALL_FACTOR * timeout_s:
                    break
        except (EOFError, OSError):
            return self._died(job)
        if verdict is None:
            log.warning("constraint_check_timed_out", field=job.field, timeout_s=timeout_s)
            self.stop()
            return (
                f"{job.field}: compiling and checking it took more than "
                f"{round(timeout_s * 1000)} ms of CPU; simplify it"
            )
        assert isinstance(verdict, Verdict) and verdict.job_id == job.job_id
        if verdict.rss_bytes > MAX_RSS_BYTES:
            log.info("constraint_checker_recycled", rss_bytes=verdict.rss_bytes)
            self.stop()
        self.last_check_s = time.monotonic() - started
        return verdict.error

    def _died(self, job: CheckJob) -> str:
        proc = self._proc
        proc.join(5.0)
        code = proc.exitcode
        self.stop()
        how = f"exit code {code}"
        if code is not None and code < 0:
            how = signal.Signals(-code).name
        log.warning("constraint_checker_died", field=job.field, how=how)
        return (
            f"{job.field}: checking it crashed the constraint checker ({how}); "
            "it nests too deeply or is too large for llguidance"
        )

    def stop(self) -> None:
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if conn is not None:
            with contextlib.suppress(OSError, ValueError):
                conn.send(None)
            conn.close()
        if proc is not None:
            proc.join(1.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)


class ConstraintChecker:
    """Checks constraints in a pool of ``workers`` checker processes, keeping verdicts."""

    def __init__(
        self,
        spec: ModelSpec,
        max_constraint_bytes: int,
        log_format: str = "console",
        *,
        workers: int = 1,
        timeout_s: float = 10.0,
        cache_entries: int = VERDICT_CACHE_ENTRIES,
        stack_bytes: int = CHECK_STACK_BYTES,
    ) -> None:
        self.max_constraint_bytes = max_constraint_bytes
        self.timeout_s = timeout_s
        args = (spec, max_constraint_bytes, log_format, stack_bytes)
        self._procs = [_CheckerProcess(args, f"genai-constraint-check-{i}") for i in range(workers)]
        self._idle: asyncio.Queue[_CheckerProcess] | None = None
        self._verdicts: OrderedDict[bytes, str] = OrderedDict()
        self._cache_entries = cache_entries
        self._inflight: dict[bytes, asyncio.Future[str]] = {}
        self._job_ids = itertools.count()
        self.counters = {"checks": 0, "verdict_hits": 0, "refused": 0}

    @property
    def starts(self) -> int:
        """Checker processes started so far (a crash or a time-out adds one)."""
        return sum(p.starts for p in self._procs)

    def _pool(self) -> asyncio.Queue[_CheckerProcess]:
        if self._idle is None:
            self._idle = asyncio.Queue()
            for proc in self._procs:
                self._idle.put_nowait(proc)
        return self._idle

    async def start(self) -> None:
        """Start the processes now (else the first check starts one)."""
        await asyncio.gather(
            *(asyncio.to_thread(p.ensure_started, START_TIMEOUT_S) for p in self._procs)
        )

    async def check(self, constraint: Constraint, field: str = "") -> None:
        """``INVALID_ARGUMENT`` naming ``field`` (default ``constraint.<kind>``)
        unless ``constraint`` compiles and matches its first tokens."""
        field = field or f"constraint.{constraint.kind}"
        validate_shape(constraint, self.max_constraint_bytes, field)
        key = constraint_digest(constraint) + field.encode()
        error = self._verdicts.get(key)
        if error is not None:
            self._verdicts.move_to_end(key)
            self.counters["verdict_hits"] += 1
        else:
            pending = self._inflight.get(key)
            if pending is None:
                pending = asyncio.ensure_future(self._run(key, constraint, field))
                self._inflight[key] = pending
                pending.add_done_callback(lambda _: self._inflight.pop(key, None))
            error = await asyncio.shield(pending)
        if error:
            self.counters["refused"] += 1
            raise InvalidArgument(error)

    async def _run(self, key: bytes, constraint: Constraint, field: str) -> str:
        pool = self._pool()
        proc = await pool.get()
        try:
            await asyncio.to_thread(proc.ensure_started, START_TIMEOUT_S)
            job = CheckJob(next(self._job_ids), constraint, field)
            error = await asyncio.to_thread(proc.run, job, self.timeout_s)
        finally:
            pool.put_nowait(proc)
        self.counters["checks"] += 1
        self._verdicts[key] = error
        while len(self._verdicts) > self._cache_entries:
            self._verdicts.popitem(last=False)
        return error

    async def close(self) -> None:
        await asyncio.gather(*(asyncio.to_thread(p.stop) for p in self._procs))
