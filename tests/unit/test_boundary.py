"""The engine boundary: every message of the engine-process pipe
(``genai_service.contract.protocol``) pickles intact, errors keep their code and
message, and the frontend's side (plus the engine's plain-Python parts)
imports without ONNX Runtime (STYLE: only the model runners need it)."""

from __future__ import annotations

import pickle
import subprocess
import sys
import typing

import pytest

from genai_common.errors import GenAIError, Internal, InvalidArgument, NotFound, Unavailable
from genai_service.contract import protocol
from genai_service.contract.protocol import (
    AbortRequest,
    AddRequest,
    CallDone,
    CallFailed,
    CloseSession,
    CreateSession,
    EngineCall,
    Fatal,
    ForkSession,
    GetSession,
    ListSessions,
    Outputs,
    Ready,
    ResetSession,
    RewindSession,
    Stats,
    Stop,
)
from genai_service.contract.request import (
    EngineInfo,
    FinishReason,
    GenerationRequest,
    Priority,
    RequestOutput,
    SamplingParams,
    StoppingCriteria,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from genai_service.contract.sessions import SessionInfo, SessionPage

# What the frontend imports to talk to the engine and convert its types, and
# the engine's bookkeeping that is unit-tested without a model.
WITHOUT_ORT = [
    "genai_service.server.convert",
    "genai_service.server.engine_process",
    "genai_service.contract.protocol",
    "genai_service.engine.process_main",
    "genai_service.contract.request",
    "genai_service.engine.sessions.sessions",
    "genai_service.engine.sessions.restores",
    "genai_service.engine.scheduler",
    "genai_service.engine.sequence",
    "genai_service.engine.text.text_output",
    "genai_service.engine.sampling_rows",
    "genai_service.engine.speculation",
    "genai_service.engine.kv_reuse",
]


@pytest.mark.parametrize("module", WITHOUT_ORT)
def test_imports_without_onnxruntime(module: str) -> None:
    # A None entry in sys.modules makes ``import onnxruntime`` raise ImportError.
    code = f"import sys; sys.modules['onnxruntime'] = None; import {module}"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


SESSION = SessionInfo("ab" * 16, 1.5, 2.5, 60.0, 7, 2, False, {"k": "v"}, 42)
REQUEST = GenerationRequest(
    "r#1",
    (1, 2, 3),
    SamplingParams(temperature=0.7, top_k=5, seed=9),
    StoppingCriteria(max_new_tokens=4, stop_sequences=("\n",), time_limit_ms=100),
    top_logprobs=2,
    priority=Priority.HIGH,
    session_id="ab" * 16,
    principal="alice",
    cache_salt="s",
)
OUTPUT = RequestOutput(
    "r#1",
    (4,),
    "x",
    (TokenLogprob(4, "x", -0.1, (TopLogprob(4, "x", -0.1), TopLogprob(5, "y", -2.0))),),
    finished=True,
    finish_reason=FinishReason.STOP_SEQUENCE,
    stop_sequence="\n",
    usage=Usage(3, 1, 2),
    seed=9,
    session_id="ab" * 16,
    session_tokens=4,
)
INFO = EngineInfo("tiny", 128, 64, (1, 2), 2, 2, 8, "float32", "shared_buffer", True, 16)
CALLS = [
    CreateSession(30.0, "alice", {"k": "v"}),
    CreateSession(),
    GetSession("ab" * 16, "alice"),
    ResetSession("ab" * 16, "alice"),
    RewindSession("ab" * 16, "alice", turns=2),
    RewindSession("ab" * 16, "alice", history_tokens=7),
    ForkSession("ab" * 16, "alice", 1, 30.0, {"k": "v"}),
    CloseSession("ab" * 16, "alice"),
    ListSessions("alice", 10, "tok"),
    Stats(),
]

# Every message of the pipe, each call in an EngineCall, each kind of answer.
CROSSING = [
    AddRequest(REQUEST),
    AbortRequest("r#1"),
    *(EngineCall(i, call) for i, call in enumerate(CALLS)),
    Stop(),
    Ready(INFO),
    Outputs((OUTPUT, RequestOutput("r#2", (5, 6), "yz"))),
    Outputs(()),
    CallDone(1, SESSION),
    CallDone(2, SessionPage([SESSION], "next")),
    CallDone(3, {"requests_added": 3, "waiting": 0}),
    Fatal("engine failed to start: bad graph"),
]


def test_every_message_type_is_tried() -> None:
    types = {type(m) for m in CROSSING} | {
        type(m.call) for m in CROSSING if isinstance(m, EngineCall)
    }
    every = {
        t
        for union in (protocol.ToEngine, protocol.FromEngine, protocol.Call)
        for t in typing.get_args(union)
    }
    assert every - types == {CallFailed}  # tried with errors below


@pytest.mark.parametrize("value", CROSSING, ids=lambda v: type(v).__name__)
def test_what_crosses_the_pipe_pickles_intact(value: object) -> None:
    assert pickle.loads(pickle.dumps(value)) == value


ERRORS = [
    InvalidArgument("max_new_tokens: -1"),
    NotFound("session_id: no session"),
    Unavailable("the engine process exited (code -9); retry the request"),
    Internal("GetSession: boom"),
]


def same_error(back: object, error: GenAIError) -> bool:
    return (
        type(back) is type(error)
        and isinstance(back, GenAIError)
        and back.code == error.code
        and back.message == error.message
    )


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: e.code)
def test_errors_cross_the_pipe_with_their_code_and_message(error: GenAIError) -> None:
    failed = pickle.loads(pickle.dumps(CallFailed(7, error)))
    assert isinstance(failed, CallFailed) and failed.call_id == 7
    assert same_error(failed.error, error)
    # A request's error (a refusal at admission too) is its final output.
    outputs = pickle.loads(pickle.dumps(Outputs((RequestOutput("r", finished=True, error=error),))))
    assert same_error(outputs.outputs[0].error, error)
