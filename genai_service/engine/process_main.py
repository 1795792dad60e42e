"""The engine process: its entry point, its loop and its outbox.

See docs/design.md, "Processes and planes". The frontend starts this process
with ``spawn`` (``genai_service.server.engine_process.EngineProcess``) and
talks to it over a pipe of ``protocol`` messages: the loop takes requests,
aborts and calls, steps the engine, and hands each step's outputs to the
outbox, which writes them at once when the pipe has room and otherwise queues
them for its thread, so the loop never blocks on the pipe.

A call whose answer waits on the kvstore (a session restored from its record)
returns a ``PendingCall``; its answer goes out from a later step, and the
loop keeps stepping meanwhile.

Plain Python at import time: the model (and ONNX Runtime) is loaded inside
``engine_main``, so the frontend imports this module for the spawn target.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import queue as queue_mod
import select
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, assert_never

import structlog

from genai_common.errors import GenAIError, Internal

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
from ..contract.request import GenerationRequest, RequestOutput
from .sessions.restores import PendingCall

if TYPE_CHECKING:
    from .engine import LLMEngine

log = structlog.get_logger("genai_service.engine_process")

IDLE_POLL_S = 0.05
WAIT_POLL_S = 0.002


# A step's outputs go out from the engine loop itself when their pickle fits in
# this many bytes and the pipe has room: with the 4-byte length Connection puts
# before it, one write of at most PIPE_BUF (4,096) bytes, which a pipe that
# polls writable takes whole (a stream socket that polls writable has at least
# three quarters of its send buffer free).
DIRECT_MAX_BYTES = select.PIPE_BUF - 4


class Outbox:
    """Messages to the frontend, in order; the engine loop never blocks on the pipe.

    A message goes out at once, from the loop, when nothing is queued before
    it, it is small and the pipe has room: so a step's tokens leave before the
    next model run takes both cores. Otherwise (a frontend that fell behind: a
    full pipe, a GC pause, no CPU to spare; or a large message) it is queued,
    and the outbox thread writes the queue in order, blocking where it must,
    while the loop keeps stepping. Measured on 2 cores through the server
    against always queuing: the first token of a 128-token prompt ~3 %
    sooner, decode within noise (docs/design.md, "Engine modules").
    """

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._poll = select.poll()
        self._poll.register(conn.fileno(), select.POLLOUT)
        self._queue: queue_mod.SimpleQueue[bytes | None] = queue_mod.SimpleQueue()
        self._lock = threading.Lock()
        self._behind = False  # the thread holds messages: later ones queue behind them
        self.broken = False  # the frontend is gone
        self._thread = threading.Thread(target=self._run, name="engine-outbox", daemon=True)
        self._thread.start()

    def send(self, msg: FromEngine) -> None:
        # The bytes Connection.send would write, less its ForkingPickler: these
        # messages hold no handles for it to reduce, and building one right after
        # an ONNX Runtime call (caches cold) cost the loop more: a batch-1 decode
        # step's send 127 us against 113 with pickle.dumps (4 x 150 steps each,
        # alternating). The frontend reads either with pickle.loads.
        data = pickle.dumps(msg)
        with self._lock:
            if self.broken:
                return
            if self._behind or len(data) > DIRECT_MAX_BYTES or not self._has_room():
                self._behind = True
                self._queue.put(data)
                return
            try:
                self._conn.send_bytes(data)
            except OSError:
                self.broken = True

    def _has_room(self) -> bool:
        return any(event & select.POLLOUT for _, event in self._poll.poll(0))

    def close(self) -> None:
        """Send what is queued, then stop."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (data := self._queue.get()) is not None:
            if not self.broken:
                try:
                    self._conn.send_bytes(data)
                except OSError:
                    self.broken = True
            with self._lock:
                if self._queue.empty():
                    self._behind = False


def engine_main(config: EngineConfig, conn: Connection, log_format: str) -> None:
    """Entry point of the engine process."""
    from genai_common.logging import configure_logging

    from ..contract.request import SamplingParams, StoppingCriteria
    from .engine import LLMEngine

    configure_logging(log_format)
    spec = config.speculation
    if spec.draft_model is not None or spec.checks_several:
        # The target and the draft (or the target's twin that checks several
        # sequences at once, speculation at batch > 1) take turns on the cores:
        # one thread pool.
        runner = dataclasses.replace(config.runner, shared_thread_pool=True)
        config = dataclasses.replace(config, runner=runner)
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
        log.exception("engine_start_failed")
        conn.send(Fatal(f"engine failed to start: {exc}"))
        return
    conn.send(Ready(engine.info()))
    log.info("engine_ready", pid=os.getpid(), runner=engine.runner.kind)

    outbox = Outbox(conn)
    try:
        serve(engine, conn, outbox)
    finally:
        outbox.close()


def dispatch(engine: LLMEngine, call: Call) -> Any:
    """Run ``call`` on the engine: its answer, or a ``PendingCall`` for it."""
    match call:
        case CreateSession():
            return engine.create_session(
                call.idle_ttl_s, call.owner, call.metadata, call.context_overflow
            )
        case GetSession():
            return engine.get_session(call.session_id, call.principal)
        case ResetSession():
            return engine.reset_session(call.session_id, call.principal)
        case RewindSession():
            return engine.rewind_session(
                call.session_id, call.principal, call.turns, call.history_tokens
            )
        case ForkSession():
            return engine.fork_session(
                call.session_id, call.principal, call.turns, call.idle_ttl_s, call.metadata
            )
        case CloseSession():
            return engine.close_session(call.session_id, call.principal)
        case ListSessions():
            return engine.list_sessions(call.principal, call.page_size, call.page_token)
        case Stats():
            return engine.stats()
        case _:
            assert_never(call)


def answer_call(engine: LLMEngine, msg: EngineCall, send: Callable[[FromEngine], None]) -> None:
    """Dispatch ``msg``'s call and ``send`` its answer, now or (a ``PendingCall``)
    from the step that resolves it. A ``GenAIError`` is the caller's to see; any
    other exception is a bug, answered ``Internal``."""
    call_id = msg.call_id
    try:
        result = dispatch(engine, msg.call)
    except GenAIError as exc:
        send(CallFailed(call_id, exc))
        return
    except Exception as exc:
        name = type(msg.call).__name__
        log.exception("call_failed", call=name)
        send(CallFailed(call_id, Internal(f"{name}: {exc}")))
        return
    if isinstance(result, PendingCall):

        def settled(ok: bool, value: Any) -> None:
            send(CallDone(call_id, value) if ok else CallFailed(call_id, value))

        result.add_done_callback(settled)
    else:
        send(CallDone(call_id, result))


def add_request(engine: LLMEngine, request: GenerationRequest) -> RequestOutput | None:
    """Admit ``request``; if it is refused, its one output, carrying the error."""
    try:
        engine.add_request(request)
    except GenAIError as exc:
        return RequestOutput(request.request_id, finished=True, error=exc)
    except Exception as exc:
        log.exception("add_request_failed", request_id=request.request_id)
        return RequestOutput(request.request_id, finished=True, error=Internal(str(exc)))
    return None


def serve(engine: LLMEngine, conn: Connection, outbox: Outbox) -> None:
    """The engine process's loop: take messages, step, hand outputs to the outbox."""
    while not outbox.broken:
        # Block when there is nothing to step; nap briefly when the only work is
        # waiting on I/O (kvstore fetches, session records).
        if not engine.has_unfinished():
            timeout = IDLE_POLL_S
        else:
            timeout = WAIT_POLL_S if engine.last_step_idle else 0.0
        while conn.poll(timeout):
            timeout = 0.0
            msg: ToEngine = conn.recv()
            match msg:
                case AddRequest():
                    refused = add_request(engine, msg.request)
                    if refused is not None:
                        outbox.send(Outputs((refused,)))
                case AbortRequest():
                    engine.abort(msg.request_id)
                case EngineCall():
                    answer_call(engine, msg, outbox.send)
                case Stop():
                    engine.close()
                    return
                case _:
                    assert_never(msg)
        if engine.has_unfinished():
            outputs = engine.step()
            if outputs:
                outbox.send(Outputs(tuple(outputs)))
