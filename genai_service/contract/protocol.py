"""The messages of the engine-process pipe (docs/design.md, "Processes and planes").

Frozen dataclasses, pickled across a ``multiprocessing`` pipe; plain Python
(no ONNX Runtime), so the frontend imports them too.

Frontend → engine: ``AddRequest`` | ``AbortRequest`` | ``EngineCall`` | ``Stop``.
Engine → frontend: ``Ready`` | ``Outputs`` | ``CallDone`` | ``CallFailed`` | ``Fatal``.

A request has one way to fail: a ``RequestOutput`` with ``error`` set, in
``Outputs`` (a request refused at admission too). A call has one: ``CallFailed``
with a ``GenAIError``. An ``EngineCall`` carries one of the typed ``Call``s;
the engine process dispatches it by type (``process_main.dispatch``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from genai_common.errors import GenAIError

from .request import EngineInfo, GenerationRequest, RequestOutput

# -- calls: what the frontend may ask of the engine besides generating --------


@dataclass(frozen=True)
class CreateSession:
    idle_ttl_s: float | None = None  # None: the engine's default
    owner: str = ""  # the principal that creates it
    metadata: dict[str, str] | None = None
    context_overflow: str | None = None  # None: the engine's default


@dataclass(frozen=True)
class GetSession:
    session_id: str
    principal: str = ""


@dataclass(frozen=True)
class ResetSession:
    session_id: str
    principal: str = ""


@dataclass(frozen=True)
class RewindSession:
    session_id: str
    principal: str = ""
    turns: int | None = None  # exactly one of turns and history_tokens
    history_tokens: int | None = None


@dataclass(frozen=True)
class ForkSession:
    session_id: str
    principal: str = ""  # owns the parent; owns the fork
    turns: int | None = None  # None: the parent's whole history
    idle_ttl_s: float | None = None
    metadata: dict[str, str] | None = None


@dataclass(frozen=True)
class CloseSession:
    session_id: str
    principal: str = ""


@dataclass(frozen=True)
class ListSessions:
    principal: str = ""
    page_size: int = 0
    page_token: str = ""


@dataclass(frozen=True)
class Stats:
    """The engine's counters and gauges (for /metrics)."""


Call = (
    CreateSession
    | GetSession
    | ResetSession
    | RewindSession
    | ForkSession
    | CloseSession
    | ListSessions
    | Stats
)

# -- frontend → engine ---------------------------------------------------------


@dataclass(frozen=True)
class AddRequest:
    request: GenerationRequest


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class EngineCall:
    call_id: int
    call: Call


@dataclass(frozen=True)
class Stop:
    """Share what is left to share, close the kvstore connector, exit."""


ToEngine = AddRequest | AbortRequest | EngineCall | Stop

# -- engine → frontend ---------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """The engine has loaded and warmed up."""

    info: EngineInfo


@dataclass(frozen=True)
class Outputs:
    """One engine step's outputs (a request's error among them)."""

    outputs: tuple[RequestOutput, ...]


@dataclass(frozen=True)
class CallDone:
    call_id: int
    value: Any


@dataclass(frozen=True)
class CallFailed:
    call_id: int
    error: GenAIError


@dataclass(frozen=True)
class Fatal:
    """The engine failed to start; the process exits after sending it."""

    message: str


FromEngine = Ready | Outputs | CallDone | CallFailed | Fatal
