"""The frontend both planes drive (docs/design.md, "Processes and planes").

``Frontend`` holds what a call needs on either plane: the engine process's
handle, the tokenizer, the limits, the bearer tokens, the constraint checker,
metrics and the draining flag. It admits a call (credentials, then whether the
server takes new calls), builds the engine's request from a
``GenerateRequest`` (tools, chat template, constraint checks) and runs it
(``outputs``, ``events``). The gRPC servicers (``grpc_api/``) and the HTTP
gateway (``http_api/``) are thin adapters over it; neither imports the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import hmac
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import structlog

from genai_common.errors import Unauthenticated, Unavailable
from genai_proto.genai.v1 import generate_pb2

from ..contract.request import Constraint, GenerationRequest, RequestOutput
from ..contract.sessions import SessionInfo
from ..model.tokenizer import Tokenizer
from . import convert
from .constraint_checker import ConstraintChecker
from .engine_process import EngineProcess
from .metrics import Metrics
from .tools import ToolUse, tool_use

log = structlog.get_logger(__name__)

# The authenticated caller of the call being served (set by ``Frontend.admit``; per task).
_principal: contextvars.ContextVar[str] = contextvars.ContextVar("principal", default="")


class Frontend:
    """What every servicer shares: the engine handle, the tokenizer, limits, draining."""

    def __init__(
        self,
        engine: EngineProcess,
        tokenizer: Tokenizer,
        max_input_chars: int,
        auth_tokens: tuple[tuple[str, str], ...] = (),
        metrics: Metrics | None = None,
        stream_interval: int = 1,
        checker: ConstraintChecker | None = None,
        max_constraint_bytes: int = 65_536,
    ) -> None:
        self.engine = engine
        # Constraints and tool schemas are compiled there before the engine
        # sees them; None: by the engine alone (a crash there costs every stream).
        self.checker = checker
        self.max_constraint_bytes = max_constraint_bytes
        self.stream_interval = stream_interval  # ServerConfig.stream_interval
        self.metrics = metrics or Metrics()
        self.auth_tokens = auth_tokens
        self.tokenizer = tokenizer
        self.max_input_chars = max_input_chars
        self.draining = False
        self.inflight = 0  # generations running (a drain waits for them)
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def tracking(self) -> Any:
        self.inflight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.inflight -= 1
            if not self.inflight:
                self._idle.set()

    async def drained(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until no generation runs; whether none does."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        return not self.inflight

    def authenticate(self, authorization: str) -> str:
        """The principal behind an ``authorization: Bearer <token>`` header (gRPC
        metadata or HTTP header, the same tokens); "" when auth is off."""
        if not self.auth_tokens:
            return ""
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer" and token:
            for known, principal in self.auth_tokens:
                if hmac.compare_digest(known.encode(), token.encode()):
                    return principal
        raise Unauthenticated("authorization: a valid 'Bearer <token>' is required")

    def check_serving(self) -> None:
        if self.draining:
            raise Unavailable("the server is shutting down; retry on another replica")

    def admit(self, authorization: str) -> None:
        """Admit a call on either plane: credentials first (an anonymous caller
        learns nothing else), then whether the server takes new calls. The
        principal holds for the rest of the call's task (``principal()``)."""
        _principal.set(self.authenticate(authorization))
        self.check_serving()

    async def build_request(
        self, request: generate_pb2.GenerateRequest, session: SessionInfo | None = None
    ) -> tuple[GenerationRequest, ToolUse | None]:
        """The engine's request, and the tools it offers (None: no tools).
        ``session``: the request's session as a caller has just read it."""
        use = tool_use(request, self.max_constraint_bytes)  # INVALID_ARGUMENT before other work
        if request.session_id and session is None:
            # NOT_FOUND for an unknown session comes from here, before any work.
            session = await self.engine.get_session(request.session_id, _principal.get())
        ids, _ = convert.prompt_token_ids(
            request, self.tokenizer, self.max_input_chars, session, use
        )
        built = convert.generation_request(request, ids)
        if request.WhichOneof("input") == "fim" and self.tokenizer.fim is not None:
            # The model's FIM end markers stop the answer.
            have = built.stopping.stop_token_ids
            ends = tuple(t for t in self.tokenizer.fim.ends if t not in have)
            stopping = dataclasses.replace(
                built.stopping, stop_token_ids=built.stopping.stop_token_ids + ends
            )
            built = dataclasses.replace(built, stopping=stopping)
        forced = use.constraint() if use is not None else None
        await self.check_constraints(use, forced or built.constraint, forced is not None)
        return (
            dataclasses.replace(
                built, principal=_principal.get(), constraint=forced or built.constraint
            ),
            use,
        )

    async def check_constraints(
        self, use: ToolUse | None, constraint: Constraint | None, forced: bool
    ) -> None:
        """Refuse, before the engine sees them, a tool schema or a constraint
        that llguidance cannot compile or match (the constraint checker's
        process; docs/design.md, "Structured output")."""
        if self.checker is None:
            return
        checks = use.schema_checks() if use is not None else []
        if constraint is not None:
            checks.append((constraint, "tools" if forced else ""))
        for each, field in checks:
            await self.checker.check(each, field)

    async def outputs(self, request: Any, stream_interval: int = 1) -> AsyncIterator[RequestOutput]:
        m = self.metrics
        started = time.monotonic()
        first = True
        with self.tracking(), m.inflight.track_inprogress():
            stream = self.engine.generate(request, stream_interval)
            async with contextlib.aclosing(stream):
                async for out in stream:
                    if first and out.token_ids:
                        m.ttft.observe(time.monotonic() - started)
                        first = False
                    if out.finished and out.usage is not None:
                        u = out.usage
                        m.observe_usage(u.prompt_tokens, u.cached_tokens, u.completion_tokens)
                    yield out

    async def events(
        self,
        request: generate_pb2.GenerateRequest,
        session: SessionInfo | None = None,
        on_prompt: Callable[[int], None] | None = None,
    ) -> AsyncGenerator[generate_pb2.Delta | generate_pb2.Final, None]:
        """A request's stream events: a Delta per output with tokens or
        text, then one Final (shared by GenerateStream, GenerateBidi and the
        HTTP gateway, which passes the ``session`` it has read already).
        ``on_prompt`` hears the prompt's length once it is tokenized (a
        session turn's history included, ``truncate_prompt_tokens`` applied;
        a context slide at admission is not foreseen)."""
        outputs: list[RequestOutput] = []
        built, use = await self.build_request(request, session)
        if on_prompt is not None:
            history = session.history_tokens if session is not None else 0
            n = history + len(built.prompt_token_ids)
            if request.HasField("truncate_prompt_tokens"):  # what the engine will keep
                n = min(n, request.truncate_prompt_tokens)
            on_prompt(n)
        async for out in self.outputs(built, self.stream_interval):
            outputs.append(out)
            if out.token_ids or out.text or out.prompt_logprobs:
                yield convert.delta(out)
            if out.finished:
                yield convert.final(outputs, use)


def principal() -> str:
    """The authenticated caller of the call being served ("" when auth is off)."""
    return _principal.get()


def set_principal(name: str) -> None:
    """Make ``name`` the caller for the rest of the current task (a call that
    authenticates once for many requests: GenerateBidi)."""
    _principal.set(name)


def bind_call(name: str, request_id: str = "") -> str:
    """Bind a call's log context; returns its request id. The one place a
    request id is made: for a request that has none, and for the log lines of
    a call without one (a GenerateBidi call's own)."""
    rid = request_id or uuid.uuid4().hex
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(request_id=rid, rpc=name)
    return rid
