"""The engine process's side of the pipe, with a fake engine (no model):
each typed call reaches its engine method, errors come back as ``CallFailed``
(``Internal`` for a bug), a ``PendingCall`` is answered once it resolves, and
a request refused at admission comes back as its one output."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
from typing import Any

import pytest

from genai_common.errors import GenAIError, Internal, NotFound, ResourceExhausted
from genai_service.contract.protocol import (
    AbortRequest,
    AddRequest,
    Call,
    CallDone,
    CallFailed,
    CloseSession,
    CreateSession,
    EngineCall,
    FromEngine,
    GetSession,
    ListSessions,
    Outputs,
    ResetSession,
    Stats,
    Stop,
)
from genai_service.contract.request import GenerationRequest, RequestOutput
from genai_service.engine.process_main import Outbox, answer_call, serve
from genai_service.engine.sessions.restores import PendingCall


class FakeEngine:
    """Records each call; answers ``answer`` (or raises it, if an exception)."""

    def __init__(self, answer: Any = "answer") -> None:
        self.answer = answer
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.closed = False
        self.last_step_idle = False

    def _record(self, name: str, *args: Any) -> Any:
        self.calls.append((name, args))
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    def create_session(self, *args: Any) -> Any:
        return self._record("create_session", *args)

    def get_session(self, *args: Any) -> Any:
        return self._record("get_session", *args)

    def reset_session(self, *args: Any) -> Any:
        return self._record("reset_session", *args)

    def close_session(self, *args: Any) -> Any:
        return self._record("close_session", *args)

    def list_sessions(self, *args: Any) -> Any:
        return self._record("list_sessions", *args)

    def stats(self) -> Any:
        return self._record("stats")

    # the loop's side
    def add_request(self, request: GenerationRequest) -> None:
        if request.request_id.startswith("refused"):
            raise ResourceExhausted("queue: full")
        if request.request_id.startswith("buggy"):
            raise RuntimeError("a bug")
        self.added.append(request.request_id)

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return True

    def has_unfinished(self) -> bool:
        return False

    def step(self) -> list[RequestOutput]:
        return []

    def close(self) -> None:
        self.closed = True


CALLS: list[tuple[Call, str, tuple[Any, ...]]] = [
    (
        CreateSession(30.0, "alice", {"k": "v"}, "slide"),
        "create_session",
        (30.0, "alice", {"k": "v"}, "slide"),
    ),
    (CreateSession(), "create_session", (None, "", None, None)),
    (GetSession("s1", "alice"), "get_session", ("s1", "alice")),
    (ResetSession("s1", "alice"), "reset_session", ("s1", "alice")),
    (CloseSession("s1", "alice"), "close_session", ("s1", "alice")),
    (ListSessions("alice", 10, "tok"), "list_sessions", ("alice", 10, "tok")),
    (Stats(), "stats", ()),
]


def run_call(engine: FakeEngine, call: Call, call_id: int = 3) -> list[FromEngine]:
    sent: list[FromEngine] = []
    answer_call(engine, EngineCall(call_id, call), sent.append)  # type: ignore[arg-type]
    return sent


@pytest.mark.parametrize(("call", "method", "args"), CALLS, ids=lambda v: repr(v))
def test_each_call_reaches_its_engine_method(call: Call, method: str, args: tuple) -> None:
    engine = FakeEngine()
    assert run_call(engine, call) == [CallDone(3, "answer")]
    assert engine.calls == [(method, args)]


@pytest.mark.parametrize(("call", "method", "args"), CALLS, ids=lambda v: repr(v))
def test_a_domain_error_comes_back_as_call_failed_with_the_same_error(
    call: Call, method: str, args: tuple
) -> None:
    error = NotFound("session_id: no session")
    sent = run_call(FakeEngine(error), call)
    assert len(sent) == 1 and isinstance(sent[0], CallFailed)
    assert sent[0].call_id == 3 and sent[0].error is error


def test_an_unexpected_exception_comes_back_as_internal() -> None:
    sent = run_call(FakeEngine(KeyError("oops")), GetSession("s1"))
    assert len(sent) == 1 and isinstance(sent[0], CallFailed)
    assert isinstance(sent[0].error, Internal)
    assert sent[0].error.message == "GetSession: 'oops'"


def test_a_pending_call_is_answered_when_it_resolves() -> None:
    pending, failing = PendingCall(), PendingCall()
    engine = FakeEngine(pending)
    sent: list[FromEngine] = []
    answer_call(engine, EngineCall(1, GetSession("s1")), sent.append)  # type: ignore[arg-type]
    engine.answer = failing
    answer_call(engine, EngineCall(2, ResetSession("s2")), sent.append)  # type: ignore[arg-type]
    assert sent == []  # nothing until a later step resolves them
    pending.resolve(lambda: "info")
    error = NotFound("session_id: no session")

    def fail() -> None:
        raise error

    failing.resolve(fail)
    assert sent == [CallDone(1, "info"), CallFailed(2, error)]


def test_the_loop_serves_messages_and_answers_a_refused_request_as_its_output() -> None:
    frontend, engine_end = mp.Pipe()
    engine = FakeEngine()
    outbox = Outbox(engine_end)
    for msg in (
        AddRequest(GenerationRequest("ok#1", (1,))),
        AddRequest(GenerationRequest("refused#1", (1,))),
        AddRequest(GenerationRequest("buggy#1", (1,))),
        AbortRequest("ok#1"),
        EngineCall(5, Stats()),
        Stop(),
    ):
        frontend.send(msg)
    serve(engine, engine_end, outbox)  # type: ignore[arg-type]
    outbox.close()
    got = []
    while frontend.poll():
        got.append(frontend.recv())
    assert engine.added == ["ok#1"] and engine.aborted == ["ok#1"] and engine.closed
    refused, buggy, stats = got
    assert isinstance(refused, Outputs) and isinstance(buggy, Outputs)
    (out,) = refused.outputs
    assert out.request_id == "refused#1" and out.finished
    assert isinstance(out.error, ResourceExhausted) and out.error.message == "queue: full"
    (out,) = buggy.outputs
    assert out.request_id == "buggy#1" and out.finished
    assert isinstance(out.error, Internal) and isinstance(out.error, GenAIError)
    assert stats == CallDone(5, "answer")


def test_the_frontend_reads_the_engines_messages_however_the_bytes_arrive() -> None:
    """``PipeReader`` splits ``Connection.send``'s frames itself (one read per
    readable event): whole, several at once, or cut anywhere, including a
    message larger than one read."""
    from genai_service.server.engine_process import READ_CHUNK, PipeReader

    sent: list[FromEngine] = [
        Outputs((RequestOutput("a#1", (5,), "x"),)),
        CallDone(3, "v" * (3 * READ_CHUNK)),
        Outputs(tuple(RequestOutput(f"r{i}", (i,), "t") for i in range(8))),
        CallFailed(4, NotFound("no session 's'")),
    ]
    parent, child = mp.Pipe()

    def send_all() -> None:
        for msg in sent:
            child.send(msg)
        child.close()

    sender = threading.Thread(target=send_all)
    sender.start()
    wire = b""
    while chunk := os.read(parent.fileno(), 1 << 16):  # the bytes as they are on the pipe
        wire += chunk
    sender.join()
    parent.close()
    for cut in (len(wire), 1, 3, 4, 5, 7, 1000, READ_CHUNK):
        reader = PipeReader()
        got: list[Any] = []
        for i in range(0, len(wire), cut):
            got += reader.feed(wire[i : i + cut])
        assert [type(m) for m in got] == [type(m) for m in sent]
        assert got[:3] == sent[:3]
        assert isinstance(got[3], CallFailed) and got[3].error.message == "no session 's'"


def test_the_engine_outbox_keeps_order_flushes_on_close_and_notes_a_broken_pipe() -> None:
    reader, writer = mp.Pipe(duplex=False)
    outbox = Outbox(writer)
    # 100 messages of ~330 bytes: within the pipe's 64 KiB, which nothing reads
    # until close() has returned.
    for i in range(100):
        outbox.send(Outputs((RequestOutput(f"r{i}"),)))
    outbox.close()  # returns once everything queued is written
    assert [reader.recv().outputs[0].request_id for _ in range(100)] == [
        f"r{i}" for i in range(100)
    ]
    assert not reader.poll() and not outbox.broken

    reader, writer = mp.Pipe(duplex=False)
    reader.close()  # the frontend is gone
    outbox = Outbox(writer)
    outbox.send(Outputs(()))
    outbox.close()
    assert outbox.broken  # the engine loop stops on this


@pytest.mark.parametrize("duplex", [False, True], ids=["pipe", "socket pair"])
def test_the_outbox_writes_at_once_when_there_is_room_and_queues_behind_what_waits(
    duplex: bool,
) -> None:
    """A small message leaves from the loop before ``send`` returns; a large
    one, or any while the pipe is full, goes to the outbox thread, and later
    messages queue behind it: the reader gets them all in order, and ``send``
    never waited for the reader."""
    reader, writer = mp.Pipe(duplex=duplex)
    outbox = Outbox(writer)
    outbox.send(Outputs((RequestOutput("now"),)))
    assert reader.poll(0)  # written by send() itself
    assert reader.recv() == Outputs((RequestOutput("now"),))

    big = Outputs((RequestOutput("big", (), "x" * 2_000_000),))  # more than the pipe holds
    outbox.send(big)
    assert outbox._behind  # the thread holds it, blocked until the reader reads
    for i in range(3):
        outbox.send(Outputs((RequestOutput(f"after-big-{i}"),)))
    assert reader.recv() == big
    assert [reader.recv().outputs[0].request_id for _ in range(3)] == [
        f"after-big-{i}" for i in range(3)
    ]

    # A pipe that nobody reads fills up: the first messages are written at
    # once, the rest wait for the thread, and none is lost or reordered.
    n = 2_000  # ~0.6 MB of small messages
    for i in range(n):
        outbox.send(Outputs((RequestOutput(f"m{i}"),)))
    assert outbox._behind  # the pipe filled up: the rest went to the thread
    assert [reader.recv().outputs[0].request_id for _ in range(n)] == [f"m{i}" for i in range(n)]
    outbox.close()
    assert not reader.poll(0) and not outbox.broken
    reader.close()
    writer.close()
