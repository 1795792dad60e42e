"""The frontend's handle on the engine process: start it, supervise it, route its outputs.

See docs/design.md, "Processes and planes".

The frontend never runs model compute; it talks to the engine process
(``genai_service.engine.process_main``) over a ``multiprocessing`` pipe
carrying the small pickled messages of ``genai_service.contract.protocol``:
requests, aborts and typed calls one way; one batch of ``RequestOutput`` per
engine step the other way. The process is started with ``spawn`` (gRPC's core
is not fork-safe once initialised). A request's error, a refusal at admission
included, arrives as its final ``RequestOutput``; a call's as ``CallFailed``.

Request ids are the client's and scoped per principal: the engine sees an id
of its own for each request (the client's id plus a random suffix), so two
principals may use the same id and neither can abort, or learn of, the
other's request (docs/design.md, "Processes and planes").
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import multiprocessing as mp
import os
import pickle
import secrets
import select
import time
from collections.abc import AsyncGenerator, Callable
from multiprocessing.connection import Connection
from typing import Any, assert_never

import structlog

from genai_common.errors import GenAIError, InvalidArgument, Unavailable

from ..config import EngineConfig
from ..contract.protocol import (
    AbortRequest,
    AddRequest,
    Call,
    CallDone,
    CallFailed,
    CloseSession,
    CreateSession,
    EngineCall,
    Fatal,
    ForkSession,
    FromEngine,
    GetSession,
    ListSessions,
    Outputs,
    Ready,
    ResetSession,
    RewindSession,
    Stats,
    Stop,
    ToEngine,
)
from ..contract.request import GenerationRequest, RequestOutput, merge_outputs
from ..contract.sessions import SessionInfo, SessionPage
from ..engine.process_main import engine_main

log = structlog.get_logger(__name__)

READ_CHUNK = 64 * 1024  # below malloc's mmap threshold: a read allocates no fresh pages
MAX_START_FAILURES = 5  # then the server exits non-zero (Kubernetes: CrashLoopBackOff)
RESTART_BACKOFF_S = 0.5
RESTART_BACKOFF_MAX_S = 30.0


class PipeReader:
    """The engine's messages from the bytes of its pipe, as ``Connection.recv`` frames them.

    ``multiprocessing.Connection`` sends each message as a 4-byte big-endian
    signed length (-1 and then an 8-byte length for messages over 2 GiB) and
    the pickle. Reading the socket once per readable event and splitting the
    frames here costs one ``read`` per engine step, where ``poll()`` and
    ``recv()`` cost a ``poll``, two ``read``s and a new selector per message
    and one more ``poll`` to find the pipe empty (py-spy of the frontend at one
    stream: about half of its busy samples; ``python -m bench.frontend_profile``).
    """

    def __init__(self) -> None:
        self._pending = bytearray()  # the start of a frame whose rest has not arrived

    def feed(self, data: bytes) -> list[Any]:
        """The messages that ``data`` completes, in order."""
        buffered = bool(self._pending)
        if buffered:
            self._pending += data
        buf = self._pending if buffered else data
        messages = []
        pos, end = 0, len(buf)
        with memoryview(buf) as view:
            while end - pos >= 4:
                size = int.from_bytes(view[pos : pos + 4], "big", signed=True)
                start = pos + 4
                if size == -1:
                    if end - pos < 12:
                        break
                    size = int.from_bytes(view[start : start + 8], "big")
                    start += 8
                if end - start < size:
                    break
                messages.append(pickle.loads(view[start : start + size]))
                pos = start + size
        if buffered:
            del self._pending[:pos]
        elif pos < end:
            self._pending = bytearray(data[pos:])
        return messages


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
        self._reader = PipeReader()
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}  # by engine id
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
            target=engine_main,
            args=(self.config, child, self.log_format),
            name="genai-engine",
            daemon=True,
        )
        proc.start()
        child.close()
        self._proc, self._conn = proc, parent
        self._reader = PipeReader()
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
            # One read: the pipe is readable, so it returns what is there at
            # once; whatever is left makes it readable again.
            alive = self._read_once(conn.fileno())
        except OSError:
            alive = False
        if not alive:
            self._on_exit()

    def _read_once(self, fd: int) -> bool:
        """Read what the pipe holds (one read) and dispatch the messages it
        completes; False at end of file."""
        data = os.read(fd, READ_CHUNK)
        for msg in self._reader.feed(data):
            self._dispatch(msg)
        return bool(data)

    def _dispatch(self, msg: FromEngine) -> None:
        match msg:
            case Outputs():
                for out in msg.outputs:
                    queue = self._queues.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
                        if out.finished:
                            self._queues.pop(out.request_id, None)
            case CallDone() | CallFailed():
                future = self._calls.pop(msg.call_id, None)
                if future is not None and not future.done():
                    if isinstance(msg, CallDone):
                        future.set_result(msg.value)
                    else:
                        future.set_exception(msg.error)
            case Ready():
                self.info = msg.info
                if self._ready is not None and not self._ready.done():
                    self._ready.set_result(msg.info)
                self._start_failures = 0
                self._on_state(True)
            case Fatal():
                log.error("engine_fatal", message=msg.message)
                if self._ready is not None and not self._ready.done():
                    self._ready.set_exception(Unavailable(msg.message))
            case _:
                assert_never(msg)

    def _drain_pipe(self) -> None:
        """Dispatch whatever the pipe still holds (the exit may be noticed
        before the last reads), stopping at end of file or when nothing is left."""
        assert self._conn is not None
        fd = self._conn.fileno()
        with contextlib.suppress(OSError):
            while select.select([fd], [], [], 0)[0] and self._read_once(fd):
                pass

    def _on_exit(self) -> None:
        """The engine process died (or closed its pipe): fail in-flight work, restart."""
        assert self._loop is not None
        if self._conn is None:
            return
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self._conn.fileno())
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self._proc.sentinel)
        self._drain_pipe()  # outputs it wrote before exiting still reach their requests
        self._conn.close()
        self._conn = None
        self._proc.join(timeout=1)
        code = self._proc.exitcode
        self._on_state(False)
        error = Unavailable(f"the engine process exited (code {code}); retry the request")
        for engine_id, queue in self._queues.items():
            queue.put_nowait(RequestOutput(engine_id, finished=True, error=error))
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

    def _send(self, msg: ToEngine) -> None:
        if self._conn is None or not self.ready:
            raise Unavailable("the engine is starting or restarting; retry shortly")
        try:
            self._conn.send(msg)
        except (BrokenPipeError, OSError) as exc:
            raise Unavailable(f"the engine process is gone: {exc}") from exc

    async def generate(
        self, request: GenerationRequest, stream_interval: int = 1
    ) -> AsyncGenerator[RequestOutput, None]:
        """Submit a request and yield its outputs; aborts it in the engine if the
        consumer stops early (client cancel, deadline). ``request.request_id``
        need only be unique among ``request.principal``'s requests in flight.

        Steps the consumer has not taken yet go out as one output, so a consumer
        that falls behind catches up at once. With ``stream_interval`` N > 1 the
        outputs after the first one with tokens wait until N tokens are pending
        (or the request ends) and carry at most N, unless one engine step alone
        produced more (speculative decoding): ServerConfig.stream_interval."""
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        rid, key = request.request_id, (request.principal, request.request_id)
        if key in self._engine_ids:
            raise InvalidArgument(f"request_id: {rid!r} is already in flight")
        engine_id = f"{rid}#{secrets.token_hex(8)}"
        self._engine_ids[key] = engine_id
        self._queues[engine_id] = queue
        cap = stream_interval if stream_interval > 1 else None  # None: catch up unbounded
        finished = False
        sent_tokens = False  # an output with tokens has gone out: the rest may wait
        held: RequestOutput | None = None  # taken from the queue, not yet used
        pending: RequestOutput | None = None  # coalesced, waiting for stream_interval tokens
        try:
            self._send(AddRequest(dataclasses.replace(request, request_id=engine_id)))
            while True:
                item = held if held is not None else await queue.get()
                held = None
                if item.error is not None:
                    if pending is None:
                        finished = True
                        raise item.error
                    item, held, pending = pending, item, None  # what came before, then it
                else:
                    if pending is not None:
                        if pending.index != item.index or (
                            cap is not None and len(pending.token_ids) + len(item.token_ids) > cap
                        ):
                            # at most cap per delta; one completion per delta (n > 1)
                            item, held, pending = pending, item, None
                        else:
                            item, pending = merge_outputs(pending, item), None
                    # (With a stream_interval, a request's first tokens go out alone.)
                    first = cap is not None and not sent_tokens and bool(item.token_ids)
                    while held is None and not item.finished and not first and not queue.empty():
                        following = queue.get_nowait()
                        if (
                            following.error is not None
                            or following.index != item.index
                            or (
                                cap is not None
                                and len(item.token_ids) + len(following.token_ids) > cap
                            )
                        ):
                            held = following
                            break
                        item = merge_outputs(item, following)
                    if (
                        cap is not None
                        and sent_tokens
                        and held is None
                        and not item.finished
                        and len(item.token_ids) < cap
                    ):
                        pending = item
                        continue
                if item.finished:
                    finished = True
                sent_tokens = sent_tokens or bool(item.token_ids)
                yield dataclasses.replace(item, request_id=rid)
                if finished:
                    return
        finally:
            del self._engine_ids[key]
            if not finished:
                self._queues.pop(engine_id, None)
                with contextlib.suppress(GenAIError):
                    self._send(AbortRequest(engine_id))

    def fail_inflight(self, error: GenAIError) -> int:
        """End every request in flight with ``error`` (its consumer gets what
        was already queued for it first, then raises it) and abort it in the
        engine; how many there were. For the end of a drain, so that a stream
        cut at the grace period ends with a status that says so."""
        queues, self._queues = self._queues, {}
        for engine_id, queue in queues.items():
            queue.put_nowait(RequestOutput(engine_id, finished=True, error=error))
            with contextlib.suppress(GenAIError):
                self._send(AbortRequest(engine_id))
        return len(queues)

    def abort(self, request_id: str, principal: str = "") -> None:
        """Abort ``principal``'s request ``request_id`` (nothing if it has none)."""
        engine_id = self._engine_ids.get((principal, request_id))
        if engine_id is not None:
            with contextlib.suppress(GenAIError):
                self._send(AbortRequest(engine_id))

    # Calls: each sends one typed ``Call`` and awaits its answer.

    async def create_session(
        self,
        idle_ttl_s: float | None = None,
        owner: str = "",
        metadata: dict[str, str] | None = None,
        context_overflow: str | None = None,
    ) -> SessionInfo:
        info: SessionInfo = await self._call(
            CreateSession(idle_ttl_s, owner, metadata, context_overflow)
        )
        return info

    async def get_session(self, session_id: str, principal: str = "") -> SessionInfo:
        info: SessionInfo = await self._call(GetSession(session_id, principal))
        return info

    async def reset_session(self, session_id: str, principal: str = "") -> SessionInfo:
        info: SessionInfo = await self._call(ResetSession(session_id, principal))
        return info

    async def rewind_session(
        self,
        session_id: str,
        principal: str = "",
        *,
        turns: int | None = None,
        history_tokens: int | None = None,
    ) -> SessionInfo:
        info: SessionInfo = await self._call(
            RewindSession(session_id, principal, turns, history_tokens)
        )
        return info

    async def fork_session(
        self,
        session_id: str,
        principal: str = "",
        *,
        turns: int | None = None,
        idle_ttl_s: float | None = None,
        metadata: dict[str, str] | None = None,
    ) -> SessionInfo:
        info: SessionInfo = await self._call(
            ForkSession(session_id, principal, turns, idle_ttl_s, metadata)
        )
        return info

    async def close_session(self, session_id: str, principal: str = "") -> SessionInfo:
        info: SessionInfo = await self._call(CloseSession(session_id, principal))
        return info

    async def list_sessions(
        self, principal: str = "", page_size: int = 0, page_token: str = ""
    ) -> SessionPage:
        page: SessionPage = await self._call(ListSessions(principal, page_size, page_token))
        return page

    async def stats(self) -> dict[str, int]:
        """The engine's counters and gauges (for /metrics)."""
        stats: dict[str, int] = await self._call(Stats())
        return stats

    async def _call(self, call: Call) -> Any:
        """Send ``call``; its value, or the ``GenAIError`` it failed with, raised."""
        assert self._loop is not None
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = self._loop.create_future()
        self._calls[call_id] = future
        try:
            self._send(EngineCall(call_id, call))
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
                self._conn.send(Stop())
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
