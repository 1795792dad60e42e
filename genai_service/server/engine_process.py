"""The engine's own OS process and the frontend's handle on it.

See docs/design.md, "Processes and planes".

The frontend never runs model compute; it talks to the engine over a
``multiprocessing`` pipe carrying small pickled messages: requests, aborts,
control calls one way; one batch of ``RequestOutput`` per engine step the
other way. The process is started with ``spawn`` (gRPC's core is not
fork-safe once initialised).

Messages frontend → engine:
    ("add", GenerationRequest) | ("abort", request_id) | ("call", call_id, method, args) | ("stop",)
Messages engine → frontend:
    ("ready", EngineInfo) | ("outputs", [RequestOutput, ...]) | ("rejected", request_id, error)
    | ("result", call_id, ok, value_or_error) | ("fatal", message)

A call whose answer waits on the kvstore (a session restored from its record)
returns a ``PendingCall``; its "result" goes out from a later step, and the
loop keeps stepping meanwhile.

Request ids are the client's and scoped per principal: the engine sees an id
of its own for each request (the client's id plus a random suffix), so two
principals may use the same id and neither can abort, or learn of, the
other's request (docs/design.md, "Processes and planes").
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import multiprocessing as mp
import os
import queue as queue_mod
import secrets
import threading
import time
from collections.abc import AsyncGenerator, Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import structlog

from genai_common.errors import GenAIError, Internal, InvalidArgument, Unavailable

from ..config import EngineConfig
from ..engine.request import GenerationRequest, RequestOutput, merge_outputs
from ..engine.restores import PendingCall

if TYPE_CHECKING:
    from ..engine.engine import LLMEngine

log = structlog.get_logger(__name__)

# Engine methods the frontend may call by name (sessions, info, counters).
CALLABLE = frozenset(
    {
        "create_session",
        "get_session",
        "reset_session",
        "close_session",
        "list_sessions",
        "info",
        "stats",
    }
)
IDLE_POLL_S = 0.05
MAX_START_FAILURES = 5  # then the server exits non-zero (Kubernetes: CrashLoopBackOff)
RESTART_BACKOFF_S = 0.5
RESTART_BACKOFF_MAX_S = 30.0
WAIT_POLL_S = 0.002


class _Outbox:
    """Messages to the frontend, sent in order by a thread of their own.

    The engine loop never blocks on the pipe: when the frontend falls behind
    (a full pipe, a GC pause, no CPU to spare) the engine keeps stepping, and
    pickling and writing a step's outputs overlap the next model run, which
    releases the GIL. (Measured on 2 cores: no change in single-stream decode
    through the server beyond run-to-run noise; see docs/benchmarks.md.)
    """

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._queue: queue_mod.SimpleQueue[tuple[Any, ...] | None] = queue_mod.SimpleQueue()
        self.broken = False  # the frontend is gone
        self._thread = threading.Thread(target=self._run, name="engine-outbox", daemon=True)
        self._thread.start()

    def send(self, msg: tuple[Any, ...]) -> None:
        self._queue.put(msg)

    def close(self) -> None:
        """Send what is queued, then stop."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (msg := self._queue.get()) is not None:
            if self.broken:
                continue
            try:
                self._conn.send(msg)
            except (BrokenPipeError, OSError):
                self.broken = True


def _engine_main(config: EngineConfig, conn: Connection, log_format: str) -> None:
    """Entry point of the engine process."""
    from genai_common.logging import configure_logging

    from ..engine.engine import LLMEngine
    from ..engine.request import SamplingParams, StoppingCriteria

    configure_logging(log_format)
    plog = structlog.get_logger("genai_service.engine_process")
    try:
        engine = LLMEngine(config)
        # Warm-up: one real prefill + decode step so the first client request
        # does not pay for ORT's lazy initialisation.
        warm = GenerationRequest(
            "__warmup__",
            (0,),
            SamplingParams(),
            StoppingCriteria(max_new_tokens=2, ignore_eos=True),
        )
        engine.generate(warm)
        engine.prefix_index.clear()
    except Exception as exc:
        plog.exception("engine_start_failed")
        conn.send(("fatal", f"engine failed to start: {exc}"))
        return
    conn.send(("ready", engine.info()))
    plog.info("engine_ready", pid=os.getpid(), runner=engine.runner.kind)

    methods: dict[str, Callable[..., Any]] = {name: getattr(engine, name) for name in CALLABLE}
    outbox = _Outbox(conn)
    try:
        _serve(engine, conn, outbox, methods, plog)
    finally:
        outbox.close()


def _answer(outbox: _Outbox, call_id: int, ok: bool, value: Any) -> None:
    outbox.send(("result", call_id, ok, value))


def _serve(
    engine: LLMEngine,
    conn: Connection,
    outbox: _Outbox,
    methods: dict[str, Callable[..., Any]],
    plog: Any,
) -> None:
    """The engine process's loop: take messages, step, queue outputs."""
    while not outbox.broken:
        # Block when there is nothing to step; nap briefly when the only work is
        # waiting on I/O (kvstore fetches, session records).
        if not engine.has_unfinished():
            timeout = IDLE_POLL_S
        else:
            timeout = WAIT_POLL_S if engine.last_step_idle else 0.0
        while conn.poll(timeout):
            timeout = 0.0
            msg = conn.recv()
            kind = msg[0]
            if kind == "add":
                request: GenerationRequest = msg[1]
                try:
                    engine.add_request(request)
                except GenAIError as exc:
                    outbox.send(("rejected", request.request_id, exc))
                except Exception as exc:
                    plog.exception("add_request_failed", request_id=request.request_id)
                    outbox.send(("rejected", request.request_id, Internal(str(exc))))
            elif kind == "abort":
                engine.abort(msg[1])
            elif kind == "call":
                _, call_id, method, args = msg
                try:
                    result = methods[method](*args)
                    if isinstance(result, PendingCall):  # answered from a later step
                        result.add_done_callback(functools.partial(_answer, outbox, call_id))
                    else:
                        _answer(outbox, call_id, True, result)
                except GenAIError as exc:
                    outbox.send(("result", call_id, False, exc))
                except Exception as exc:
                    plog.exception("call_failed", method=method)
                    outbox.send(("result", call_id, False, Internal(f"{method}: {exc}")))
            elif kind == "stop":
                engine.close()
                return
        if engine.has_unfinished():
            outputs = engine.step()
            if outputs:
                outbox.send(("outputs", outputs))


class EngineProcess:
    """The frontend's handle: start/supervise the engine process and route its outputs.

    All methods run on the frontend's asyncio loop. One reader callback
    demultiplexes each step's outputs into per-request queues.
    """

    def __init__(
        self,
        config: EngineConfig,
        log_format: str = "console",
        on_state: Callable[[bool], None] | None = None,
        on_fatal: Callable[[str], None] | None = None,
        restart: bool = True,
    ) -> None:
        self.config = config
        self.log_format = log_format
        self._on_state = on_state or (lambda serving: None)
        self._on_fatal = on_fatal or (lambda reason: None)
        self._start_failures = 0  # consecutive engine starts that died before ready
        self._restart = restart
        self._ctx = mp.get_context("spawn")
        self._proc: Any = None
        self._conn: Connection | None = None
        self._queues: dict[str, asyncio.Queue[RequestOutput | GenAIError]] = {}  # by engine id
        self._engine_ids: dict[tuple[str, str], str] = {}  # (principal, request_id) -> engine id
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._ready: asyncio.Future[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self.info: Any = None
        self.restarts = 0

    @property
    def ready(self) -> bool:
        return self._ready is not None and self._ready.done() and not self._ready.exception()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def start(self, timeout_s: float = 600.0) -> None:
        self._loop = asyncio.get_running_loop()
        self._spawn()
        await self.wait_ready(timeout_s)

    async def wait_ready(self, timeout_s: float = 600.0) -> None:
        assert self._ready is not None
        await asyncio.wait_for(asyncio.shield(self._ready), timeout_s)

    def _spawn(self) -> None:
        assert self._loop is not None
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(
            target=_engine_main,
            args=(self.config, child, self.log_format),
            name="genai-engine",
            daemon=True,
        )
        proc.start()
        child.close()
        self._proc, self._conn = proc, parent
        self._ready = self._loop.create_future()
        # Nobody may be waiting (a restart): read the error so asyncio does not
        # report it as never retrieved.
        self._ready.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._loop.add_reader(parent.fileno(), self._on_readable)
        self._loop.add_reader(proc.sentinel, self._on_exit)
        log.info("engine_process_started", pid=proc.pid)

    def _on_readable(self) -> None:
        conn = self._conn
        if conn is None:
            return
        try:
            while conn.poll():
                self._dispatch(conn.recv())
        except (EOFError, OSError):
            self._on_exit()

    def _dispatch(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "outputs":
            for out in msg[1]:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
                    if out.finished:
                        self._queues.pop(out.request_id, None)
        elif kind == "rejected":
            queue = self._queues.pop(msg[1], None)
            if queue is not None:
                queue.put_nowait(msg[2])
        elif kind == "result":
            future = self._calls.pop(msg[1], None)
            if future is not None and not future.done():
                if msg[2]:
                    future.set_result(msg[3])
                else:
                    future.set_exception(msg[3])
        elif kind == "ready":
            self.info = msg[1]
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(msg[1])
            self._start_failures = 0
            self._on_state(True)
        elif kind == "fatal":
            log.error("engine_fatal", message=msg[1])
            if self._ready is not None and not self._ready.done():
                self._ready.set_exception(Unavailable(msg[1]))

    def _on_exit(self) -> None:
        """The engine process died (or closed its pipe): fail in-flight work, restart."""
        assert self._loop is not None
        if self._conn is None:
            return
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self._conn.fileno())
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self._proc.sentinel)
        self._conn.close()
        self._conn = None
        self._proc.join(timeout=1)
        code = self._proc.exitcode
        self._on_state(False)
        error = Unavailable(f"the engine process exited (code {code}); retry the request")
        for queue in self._queues.values():
            queue.put_nowait(error)
        self._queues.clear()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._calls.clear()
        started = self._ready is not None and self._ready.done() and not self._ready.exception()
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(error)
        if self._closing or not self._restart:
            return
        self._start_failures = 0 if started else self._start_failures + 1
        if self._start_failures >= MAX_START_FAILURES:
            reason = f"the engine failed to start {self._start_failures} times in a row"
            log.error("engine_gave_up", exitcode=code, reason=reason)
            self._on_fatal(reason)
            return
        # Back off when it keeps dying before it is ready (bad model, OOM at load).
        delay = min(
            RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2 ** max(0, self._start_failures - 1)
        )
        delay = delay if self._start_failures else 0.0
        log.error("engine_process_died", exitcode=code, restarting_in_s=delay)
        self.restarts += 1
        self._loop.call_later(delay, self._respawn)

    def _respawn(self) -> None:
        if not self._closing and self._conn is None:
            self._spawn()

    def _send(self, msg: tuple[Any, ...]) -> None:
        if self._conn is None or not self.ready:
            raise Unavailable("the engine is starting or restarting; retry shortly")
        try:
            self._conn.send(msg)
        except (BrokenPipeError, OSError) as exc:
            raise Unavailable(f"the engine process is gone: {exc}") from exc

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[RequestOutput, None]:
        """Submit a request and yield its outputs; aborts it in the engine if the
        consumer stops early (client cancel, deadline). ``request.request_id``
        need only be unique among ``request.principal``'s requests in flight."""
        queue: asyncio.Queue[RequestOutput | GenAIError] = asyncio.Queue()
        rid, key = request.request_id, (request.principal, request.request_id)
        if key in self._engine_ids:
            raise InvalidArgument(f"request_id: {rid!r} is already in flight")
        engine_id = f"{rid}#{secrets.token_hex(8)}"
        self._engine_ids[key] = engine_id
        self._queues[engine_id] = queue
        finished = False
        held: RequestOutput | GenAIError | None = None  # taken from the queue, not yet used
        try:
            self._send(("add", dataclasses.replace(request, request_id=engine_id)))
            while True:
                item = held if held is not None else await queue.get()
                held = None
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.error is not None:
                    finished = True
                    raise item.error
                # Steps the consumer has not taken yet go out as one delta, so a
                # consumer that falls behind catches up in one message.
                while not item.finished and not queue.empty():
                    following = queue.get_nowait()
                    if isinstance(following, BaseException) or following.error is not None:
                        held = following
                        break
                    item = merge_outputs(item, following)
                if item.finished:
                    finished = True
                yield dataclasses.replace(item, request_id=rid)
                if finished:
                    return
        finally:
            del self._engine_ids[key]
            if not finished:
                self._queues.pop(engine_id, None)
                with contextlib.suppress(GenAIError):
                    self._send(("abort", engine_id))

    def abort(self, request_id: str, principal: str = "") -> None:
        """Abort ``principal``'s request ``request_id`` (nothing if it has none)."""
        engine_id = self._engine_ids.get((principal, request_id))
        if engine_id is not None:
            with contextlib.suppress(GenAIError):
                self._send(("abort", engine_id))

    async def call(self, method: str, *args: Any) -> Any:
        if method not in CALLABLE:
            raise ValueError(f"unknown engine method {method!r}")
        assert self._loop is not None
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = self._loop.create_future()
        self._calls[call_id] = future
        try:
            self._send(("call", call_id, method, args))
        except GenAIError:
            self._calls.pop(call_id, None)
            raise
        return await future

    async def stop(self, timeout_s: float = 10.0) -> None:
        self._closing = True
        proc = self._proc
        if proc is None:
            return
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.send(("stop",))
        deadline = time.monotonic() + timeout_s
        while proc.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
        self._on_exit()

    def kill(self) -> None:
        """Kill the engine process (tests of supervision)."""
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
