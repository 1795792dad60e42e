"""Thin adapters: validate → submit to the engine → convert → yield.

One decorator, ``rpc``, maps domain errors to status codes (docs/design.md, "Status codes") and
binds a request id to every log line of the call.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import structlog

from genai_common.decoding import Undecodable
from genai_common.errors import GenAIError, Internal, InvalidArgument, Unavailable
from genai_common.status import abort, rpc_status_of
from genai_proto.genai.v1 import (
    generate_pb2,
    generate_pb2_grpc,
    model_pb2,
    model_pb2_grpc,
    session_pb2,
    session_pb2_grpc,
)

from ...contract.sessions import check_metadata
from .. import convert
from ..frontend import Frontend, bind_call, principal, set_principal

log = structlog.get_logger(__name__)


def _authorization(context: grpc.aio.ServicerContext) -> str:
    return str(dict(context.invocation_metadata() or ()).get("authorization", ""))


def _event_fields(event: generate_pb2.Delta | generate_pb2.Final) -> dict[str, Any]:
    return {"delta": event} if isinstance(event, generate_pb2.Delta) else {"final": event}


def rpc(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a servicer method (unary or async-generator) with error mapping and log context."""
    name = fn.__name__

    async def fail(exc: BaseException, context: grpc.aio.ServicerContext) -> None:
        if isinstance(exc, GenAIError):
            log.info("rpc_error", rpc=name, code=exc.code, message=exc.message)
            await abort(context, exc)
        log.error("rpc_internal_error", rpc=name, exc_info=exc)
        await abort(context, Internal(f"internal error: {exc}"))

    def bind(request: Any) -> None:
        rid = bind_call(name, getattr(request, "request_id", ""))
        if hasattr(request, "request_id") and not request.request_id:
            request.request_id = rid

    def admit(fe: Frontend, request: Any, context: Any) -> None:
        # Admitted first, then whether the request decoded.
        fe.admit(_authorization(context))
        if isinstance(request, Undecodable):
            raise request.error()

    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def stream_wrapper(self: Any, request: Any, context: Any) -> AsyncIterator[Any]:
            bind(request)
            started, code = time.monotonic(), "CANCELLED"
            try:
                admit(self.fe, request, context)
                async for item in fn(self, request, context):
                    yield item
                code = "OK"
            except (GenAIError, Exception) as exc:
                if isinstance(exc, grpc.aio.AbortError):
                    raise
                code = exc.code if isinstance(exc, GenAIError) else "INTERNAL"
                # Counted before the status goes out, so a client never sees
                # its error before /metrics does.
                self.fe.metrics.observe_rpc(name, code, started)
                code = ""
                await fail(exc, context)
            finally:
                if code:
                    self.fe.metrics.observe_rpc(name, code, started)

        return stream_wrapper

    @functools.wraps(fn)
    async def unary_wrapper(self: Any, request: Any, context: Any) -> Any:
        bind(request)
        started, code = time.monotonic(), "CANCELLED"
        try:
            admit(self.fe, request, context)
            result = await fn(self, request, context)
            code = "OK"
            return result
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            code = exc.code if isinstance(exc, GenAIError) else "INTERNAL"
            self.fe.metrics.observe_rpc(name, code, started)  # before the client sees it
            code = ""
            await fail(exc, context)
        finally:
            if code:
                self.fe.metrics.observe_rpc(name, code, started)

    return unary_wrapper


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(self, frontend: Frontend) -> None:
        self.fe = frontend

    @rpc
    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.GenerateResponse:
        built, use = await self.fe.build_request(request)
        outputs = [out async for out in self.fe.outputs(built)]
        return convert.generate_response(outputs, use)

    @rpc
    async def GenerateStream(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateStreamResponse]:
        async for event in self.fe.events(request):
            yield generate_pb2.GenerateStreamResponse(**_event_fields(event))

    async def GenerateBidi(
        self,
        request_iterator: AsyncIterator[generate_pb2.BidiRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[generate_pb2.BidiResponse]:
        """Several requests on one stream; each one's errors come back as an
        ``error`` event for its ``request_id``, never as the stream's status."""
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(rpc="GenerateBidi")
        try:
            set_principal(self.fe.authenticate(_authorization(context)))
        except GenAIError as exc:
            await abort(context, exc)
        if self.fe.draining:
            await abort(context, Unavailable("the server is shutting down"))
        events: asyncio.Queue[generate_pb2.BidiResponse | None] = asyncio.Queue()
        tasks: dict[str, asyncio.Task[None]] = {}

        def error_event(rid: str, exc: BaseException) -> generate_pb2.BidiResponse:
            if not isinstance(exc, GenAIError):
                log.error("bidi_request_failed", request_id=rid, exc_info=exc)
                exc = Internal(f"internal error: {exc}")
            return generate_pb2.BidiResponse(request_id=rid, error=rpc_status_of(exc))

        async def run_one(rid: str, start: generate_pb2.GenerateRequest) -> None:
            try:
                self.fe.check_serving()  # a start that arrives while draining
                async for event in self.fe.events(start):
                    events.put_nowait(
                        generate_pb2.BidiResponse(request_id=rid, **_event_fields(event))
                    )
            except Exception as exc:
                events.put_nowait(error_event(rid, exc))
            finally:
                tasks.pop(rid, None)
                events.put_nowait(None)  # wake the writer to re-check for the end

        async def read() -> None:
            async for msg in request_iterator:
                if isinstance(msg, Undecodable):
                    raise msg.error()  # ends the whole call: the stream is unusable
                action = msg.WhichOneof("action")
                if action == "start":
                    rid = msg.start.request_id
                    if not rid:
                        events.put_nowait(
                            error_event(
                                "", InvalidArgument("start.request_id: required in GenerateBidi")
                            )
                        )
                    elif rid in tasks:
                        events.put_nowait(
                            error_event(
                                rid, InvalidArgument(f"request_id: {rid!r} is already in flight")
                            )
                        )
                    else:
                        tasks[rid] = asyncio.create_task(run_one(rid, msg.start))
                elif action == "cancel" and msg.cancel.request_id in tasks:
                    # The engine ends the request with a CANCELLED final event.
                    self.fe.engine.abort(msg.cancel.request_id, principal())

        def failure() -> BaseException | None:
            return reader.exception() if reader.done() and not reader.cancelled() else None

        reader = asyncio.create_task(read())
        reader.add_done_callback(lambda _: events.put_nowait(None))
        try:
            while True:
                event = await events.get()
                if event is not None:
                    yield event
                elif failure() is not None or (reader.done() and not tasks and events.empty()):
                    break
            failed = failure()
            if isinstance(failed, GenAIError):
                await abort(context, failed)
            if failed is not None:
                raise failed
        finally:
            reader.cancel()
            for task in list(tasks.values()):
                task.cancel()


class SessionServicer(session_pb2_grpc.SessionServiceServicer):
    def __init__(self, frontend: Frontend) -> None:
        self.fe = frontend

    @rpc
    async def CreateSession(
        self, request: session_pb2.CreateSessionRequest, context: grpc.aio.ServicerContext
    ) -> session_pb2.CreateSessionResponse:
        ttl = _idle_ttl(request)
        # Before anything reaches the engine (docs/design.md "Sessions").
        check_metadata(request.metadata, self.fe.engine.config.sessions)
        overflow = convert.context_overflow(request.context_overflow)
        info = await self.fe.engine.create_session(
            ttl, principal(), dict(request.metadata), overflow
        )
        return session_pb2.CreateSessionResponse(session=convert.session(info))

    @rpc
    async def GetSession(
        self, request: session_pb2.GetSessionRequest, context: grpc.aio.ServicerContext
    ) -> session_pb2.GetSessionResponse:
        info = await self.fe.engine.get_session(request.session_id, principal())
        return session_pb2.GetSessionResponse(session=convert.session(info))

    @rpc
    async def ResetSession(
        self, request: session_pb2.ResetSessionRequest, context: grpc.aio.ServicerContext
    ) -> session_pb2.ResetSessionResponse:
        info = await self.fe.engine.reset_session(request.session_id, principal())
        return session_pb2.ResetSessionResponse(session=convert.session(info))

    @rpc
    async def RewindSession(
        self, request: session_pb2.RewindSessionRequest, context: grpc.aio.ServicerContext
    ) -> session_pb2.RewindSessionResponse:
        target = request.WhichOneof("target")
        if target is None:
            raise InvalidArgument("target: set turns or history_tokens")
        info = await self.fe.engine.rewind_session(
            request.session_id, principal(), **{target: getattr(request, target)}
        )
        return session_pb2.RewindSessionResponse(session=convert.session(info))

    @rpc
    async def ForkSession(
        self, request: session_pb2.ForkSessionRequest, context: grpc.aio.ServicerContext
    ) -> session_pb2.ForkSessionResponse:
        ttl = _idle_ttl(request)
        check_metadata(request.metadata, self.fe.engine.config.sessions)
        info = await self.fe.engine.fork_session(
            request.session_id,
            principal(),
            turns=request.turns if request.HasField("turns") else None,
            idle_ttl_s=ttl,
            metadata=dict(request.metadata),
        )
        return session_pb2.ForkSessionResponse(session=convert.session(info))

    @rpc
    async def CloseSession(
        self, request: session_pb2.CloseSessionRequest, context: grpc.aio.ServicerContext
    ) -> session_pb2.CloseSessionResponse:
        await self.fe.engine.close_session(request.session_id, principal())
        return session_pb2.CloseSessionResponse()

    @rpc
    async def ListSessions(
        self, request: session_pb2.ListSessionsRequest, context: grpc.aio.ServicerContext
    ) -> session_pb2.ListSessionsResponse:
        page = await self.fe.engine.list_sessions(
            principal(), request.page_size, request.page_token
        )
        return session_pb2.ListSessionsResponse(
            sessions=[convert.session(i) for i in page.sessions],
            next_page_token=page.next_page_token,
        )


def _idle_ttl(request: Any) -> float | None:
    """A CreateSession or ForkSession request's idle_ttl_seconds (None: unset)."""
    if not request.HasField("idle_ttl_seconds"):
        return None
    if request.idle_ttl_seconds == 0:
        raise InvalidArgument("idle_ttl_seconds: 0 is out of range; allowed [1, 4294967295]")
    return float(request.idle_ttl_seconds)


class ModelServicer(model_pb2_grpc.ModelServiceServicer):
    def __init__(self, frontend: Frontend) -> None:
        self.fe = frontend

    @rpc
    async def GetModelInfo(
        self, request: model_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> model_pb2.GetModelInfoResponse:
        info = self.fe.engine.info
        if info is None:
            raise Unavailable("the engine is starting; retry shortly")
        return model_pb2.GetModelInfoResponse(model_info=convert.model_info(info))

    @rpc
    async def Tokenize(
        self, request: model_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> model_pb2.TokenizeResponse:
        ids, text = convert.prompt_token_ids(request, self.fe.tokenizer, self.fe.max_input_chars)
        response = model_pb2.TokenizeResponse(token_ids=ids, prompt_text=text)
        if request.return_tokens:
            # Same special-token rule as prompt_token_ids: templates carry their own.
            add_special = request.WhichOneof("input") == "text" and (
                request.add_special_tokens if request.HasField("add_special_tokens") else True
            )
            encoding = self.fe.tokenizer.inner.encode(text, add_special_tokens=add_special)
            for tok_id, (start, end) in zip(encoding.ids, encoding.offsets, strict=True):
                response.tokens.add(
                    id=tok_id,
                    text=self.fe.tokenizer.token_text(tok_id),
                    char_start=start,
                    char_end=end,
                )
        return response

    @rpc
    async def Detokenize(
        self, request: model_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> model_pb2.DetokenizeResponse:
        vocab = self.fe.tokenizer.vocab_size
        for i, tok in enumerate(request.token_ids):
            if tok >= vocab:
                raise InvalidArgument(
                    f"token_ids[{i}]: {tok} is out of range; allowed [0, {vocab - 1}]"
                )
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return model_pb2.DetokenizeResponse(
            text=self.fe.tokenizer.decode(list(request.token_ids), skip_special_tokens=skip)
        )
