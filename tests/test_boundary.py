"""The engine boundary: what crosses the engine-process pipe pickles intact,
and the frontend's side (plus the engine's plain-Python parts) imports
without ONNX Runtime (STYLE: only the model runners need it)."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

from genai_common.errors import InvalidArgument, NotFound
from genai_service.engine.request import (
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
from genai_service.engine.sessions import SessionInfo, SessionPage

# What the frontend imports to talk to the engine and convert its types, and
# the engine's bookkeeping that is unit-tested without a model.
WITHOUT_ORT = [
    "genai_service.server.convert",
    "genai_service.engine.request",
    "genai_service.engine.sessions",
    "genai_service.engine.restores",
    "genai_service.engine.scheduler",
    "genai_service.engine.sequence",
    "genai_service.engine.text_output",
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

CROSSING = [
    GenerationRequest(
        "r#1",
        (1, 2, 3),
        SamplingParams(temperature=0.7, top_k=5, seed=9),
        StoppingCriteria(max_new_tokens=4, stop_sequences=("\n",), time_limit_ms=100),
        top_logprobs=2,
        priority=Priority.HIGH,
        session_id="ab" * 16,
        principal="alice",
        cache_salt="s",
    ),
    RequestOutput(
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
    ),
    EngineInfo("tiny", 128, 64, (1, 2), 2, 2, 8, "float32", "shared_buffer", True, 16),
    SESSION,
    SessionPage([SESSION], "next"),
]


@pytest.mark.parametrize("value", CROSSING, ids=lambda v: type(v).__name__)
def test_what_crosses_the_pipe_pickles_intact(value: object) -> None:
    assert pickle.loads(pickle.dumps(value)) == value


def test_errors_cross_the_pipe_with_their_code_and_message() -> None:
    for error in (InvalidArgument("max_new_tokens: -1"), NotFound("session_id: no session")):
        back = pickle.loads(pickle.dumps(RequestOutput("r", finished=True, error=error))).error
        assert type(back) is type(error) and back.code == error.code
        assert back.message == error.message
