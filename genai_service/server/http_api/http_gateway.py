"""The OpenAI-compatible HTTP plane of ``genai-server --http-port P``
(docs/design.md, "HTTP gateway").

A Starlette app served by uvicorn on the frontend's own event loop, beside
grpc.aio: each call is admitted as an RPC is (``Frontend.admit``: the same
bearer tokens, UNAVAILABLE while draining), translated by ``openai_api`` into
a ``GenerateRequest`` and run through ``Frontend.events``, the path
GenerateStream takes, so validation, limits, tools, sessions, principals and
metrics are the gRPC plane's own; ``openai_reply`` translates the events back.
No loopback gRPC hop.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import h11
import prometheus_client
import structlog
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from genai_common import bounded_json
from genai_common.errors import (
    DeadlineExceeded,
    GenAIError,
    Internal,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from genai_common.metadata import CONTEXT_OVERFLOW_HEADER, SESSION_ID_HEADER

from ...config import ServerConfig
from ...contract.sessions import check_metadata
from .. import convert
from ..frontend import Frontend, bind_call, principal
from . import openai_api, openai_reply

log = structlog.get_logger(__name__)
# Levels a body may add around a schema or tool parameters (tools[i].function.parameters).
BODY_DEPTH_SLACK = 8
_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    return Response(data, status, headers, media_type="application/json")


def _sse(body: Any) -> bytes:
    return (
        b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
    )


class _EventStream(StreamingResponse):
    """An SSE response whose generator is closed however the response ends
    (a client that disconnects mid-stream aborts the engine request)."""

    def __init__(self, body: AsyncIterator[bytes], events: Any, request_id: str) -> None:
        headers = {**_SSE_HEADERS, "x-request-id": request_id}
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self.events.aclose()  # also when the body never started


class ModelNotFound(NotFound):
    """A request's ``model`` that is none of the served names: 404
    ``model_not_found``, as OpenAI and vLLM answer."""


class BodyTimeout(DeadlineExceeded):
    """A request body that did not all arrive within ``--http-body-timeout-s``:
    HTTP 408 (the client was too slow, not the server), and the connection closes."""


def _refusal(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 response, in OpenAI's error shape, for a connection that
    is closed before any request on it was parsed (so h11 cannot write one)."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    error = {"message": message, "type": kind, "param": None, "code": None}
    body = json.dumps({"error": error}, separators=(",", ":")).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with the bounds it lacks (docs/design.md,
    "HTTP gateway"). uvicorn closes a keep-alive connection idle between
    requests (``timeout_keep_alive``, our ``--http-idle-timeout-s``), but waits
    forever for a request's headers: a client that sends nothing, or one header
    byte every few seconds, holds a connection (and a file descriptor, shared
    with gRPC) for good. Here a request's headers must be complete within
    ``header_timeout_s`` of the connection opening or of the request's first
    byte (else 408, closed), and a connection beyond ``max_connections`` is
    answered 503 and closed at once. The body's deadline is the app's
    (``HttpGateway._body``). Set per server by ``HttpGateway``."""

    header_timeout_s: float = 10.0
    max_connections: int = 1000
    on_refused: Any = None  # callable(reason) counting what was closed

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._partial = False  # bytes of a request whose headers are not complete
        if len(self.connections) > self.max_connections:
            self._refuse(
                503,
                "Service Unavailable",
                f"too many HTTP connections: {self.max_connections} are open; "
                "allowed at most that many (--http-max-connections)",
                "max_connections",
            )
            return
        self._arm_header_timer()

    def _waiting_for_a_request(self) -> bool:
        """h11 waits for a request line and headers (not inside a request's
        body, nor with a response still to finish)."""
        return self.conn.their_state is h11.IDLE

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_deadline)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def data_received(self, data: bytes) -> None:
        # The first byte of a request (after an idle keep-alive wait, too)
        # starts its clock; bytes of a body never do.
        if self._waiting_for_a_request():
            self._partial = True
            if self._header_timer is None:
                self._arm_header_timer()
        super().data_received(data)  # (cancels uvicorn's own keep-alive timer)
        if not self._waiting_for_a_request():  # the headers are in
            self._partial = False
            self._disarm()
        elif self._header_timer is None:
            # A body's last bytes ended the cycle after its response (an early
            # 4xx): the connection is idle again, with no keep-alive timer left.
            self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _header_deadline(self) -> None:
        self._header_timer = None
        if not self._waiting_for_a_request() or self.transport.is_closing():
            return
        self._unset_keepalive_if_required()
        if self._partial or self.cycle is None:  # a request begun, or none yet
            self._refuse(
                408,
                "Request Timeout",
                f"request headers not complete within {self.header_timeout_s:g} s; "
                "allowed at most that (--http-header-timeout-s)",
                "header_timeout",
            )
        else:  # idle after a response: close as uvicorn's keep-alive timeout does
            self.conn.send(h11.ConnectionClosed())
            self.transport.close()

    def _refuse(self, status: int, reason: str, message: str, why: str) -> None:
        if self.on_refused is not None:
            self.on_refused(why)
        self.transport.write(_refusal(status, reason, message))
        self.transport.close()


class HttpGateway:
    """The app, and the uvicorn server that serves it on a socket bound at
    construction (as gRPC's port is), started and stopped with GenAIServer."""

    def __init__(self, frontend: Frontend, config: ServerConfig) -> None:
        assert config.http_port is not None
        self.fe = frontend
        self.config = config
        self.created = int(time.time())
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
                Route("/v1/sessions", self.create_session, methods=["POST"]),
                Route("/v1/sessions/{session_id}:rewind", self.rewind_session, methods=["POST"]),
                Route("/v1/sessions/{session_id}:fork", self.fork_session, methods=["POST"]),
                Route("/v1/sessions/{session_id}", self.get_session, methods=["GET"]),
                Route("/v1/sessions/{session_id}", self.close_session, methods=["DELETE"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.prometheus, methods=["GET"]),
            ],
            exception_handlers={HTTPException: self._http_error},
        )
        self.socket = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((config.host, config.http_port))
        self.port = int(self.socket.getsockname()[1])
        tls: dict[str, Any] = {}
        if config.tls_cert_file:
            tls = {"ssl_certfile": config.tls_cert_file, "ssl_keyfile": config.tls_key_file}
            if config.tls_client_ca_file:
                tls |= {
                    "ssl_ca_certs": config.tls_client_ca_file,
                    "ssl_cert_reqs": ssl.CERT_REQUIRED,
                }
        refused = frontend.metrics.http_refused
        protocol = type(
            "GuardedH11Protocol",
            (GuardedH11Protocol,),
            {
                "header_timeout_s": config.http_header_timeout_s,
                "max_connections": config.http_max_connections,
                "on_refused": staticmethod(lambda why: refused.labels(why).inc()),
            },
        )
        self.server = uvicorn.Server(
            uvicorn.Config(
                self.app,
                http=protocol,
                timeout_keep_alive=config.http_idle_timeout_s,  # type: ignore[arg-type]
                log_config=None,  # structlog owns logging (genai_common.logging)
                access_log=False,
                lifespan="off",
                server_header=False,
                **tls,
            )
        )
        self._ticker: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.server.config.load()
        self.server.lifespan = self.server.config.lifespan_class(self.server.config)
        await self.server.startup(sockets=[self.socket])
        # uvicorn's own tick (Date header, exit flag); not Server.serve, which
        # would take over SIGTERM/SIGINT from serve() in app.py.
        self._ticker = asyncio.create_task(self.server.main_loop())
        log.info("http_listening", host=self.config.host, port=self.port)

    async def stop(self, grace_s: float) -> None:
        """Close the port; responses still being written get ``grace_s``."""
        if self._ticker is None:  # never started
            self.socket.close()
            return
        self.server.config.timeout_graceful_shutdown = grace_s  # type: ignore[assignment]
        self.server.should_exit = True
        await self._ticker
        await self.server.shutdown(sockets=[self.socket])
        self._ticker = None

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        """Starlette's own refusals (no such route, wrong method) in OpenAI's shape."""
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        error = {"message": f"{request.method} {request.url.path}: {exc.detail}", "type": kind}
        return _json({"error": {**error, "param": None, "code": None}}, exc.status_code)

    # -- calls ------------------------------------------------------------------

    def _admit(self, request: Request, name: str) -> str:
        rid = bind_call(name, request.headers.get("x-request-id", "")[:128])
        self.fe.admit(request.headers.get("authorization", ""))
        return rid

    async def _body(self, request: Request) -> Any:
        limit = self.config.max_message_bytes
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > limit:
            raise InvalidArgument(f"body: {size} bytes; allowed at most {limit}")
        chunks, received = [], 0
        timeout = self.config.http_body_timeout_s
        try:
            async with asyncio.timeout(timeout):
                async for chunk in request.stream():  # a chunked body has no Content-Length
                    received += len(chunk)
                    if received > limit:
                        raise InvalidArgument(
                            f"body: more than {limit} bytes; allowed at most {limit}"
                        )
                    chunks.append(chunk)
        except TimeoutError:
            self.fe.metrics.http_refused.labels("body_timeout").inc()
            raise BodyTimeout(
                f"body: {received} bytes within {timeout:g} s of the headers, not all of it; "
                "allowed at most that (--http-body-timeout-s)"
            ) from None
        data = b"".join(chunks)
        if not data:
            return {}
        # A schema or tool parameters sit a few levels inside the body: their
        # own bound (and field name) applies when they are read.
        return bounded_json.loads(data, "body", bounded_json.MAX_JSON_DEPTH + BODY_DEPTH_SLACK)

    def _failure(
        self, name: str, exc: BaseException, started: float, names: dict[str, str] | None = None
    ) -> Response:
        if not isinstance(exc, GenAIError):
            log.error("http_internal_error", exc_info=exc)
            exc = Internal(f"internal error: {exc}")
        else:
            log.info("http_error", code=exc.code, message=exc.message)
        self.fe.metrics.observe_rpc(name, exc.code, started)
        status, body = openai_reply.error_body(exc, names)
        headers = {"www-authenticate": "Bearer"} if status == 401 else None
        if isinstance(exc, BodyTimeout):
            status, headers = 408, {"connection": "close"}
        if isinstance(exc, ModelNotFound):
            error = {"type": "invalid_request_error", "param": "model", "code": "model_not_found"}
            body["error"].update(error)
        return _json(body, status, headers)

    def served_names(self) -> tuple[str, ...]:
        """What a request's ``model`` may say (the first one answers when it says
        nothing): ``--served-model-name``, else "default" and the model id."""
        if self.config.served_model_names:
            return self.config.served_model_names
        info = self.fe.engine.info
        return ("default", info.model_id) if info else ("default",)

    def _model_of(self, body: Any) -> str:
        """The name a response gives: the request's ``model`` if it is served
        (``ModelNotFound`` if not), else the first served name."""
        if not self.config.served_model_names and self.fe.engine.info is None:
            # the model id is not known yet: "not served" would be wrong
            raise Unavailable("the engine is starting; retry shortly")
        served = self.served_names()
        asked = body.get("model") if isinstance(body, dict) else None
        if asked is None:
            return served[0]
        if not isinstance(asked, str):
            raise InvalidArgument(f"model: {json.dumps(asked)[:80]} is not a string")
        if asked not in served:
            raise ModelNotFound(f"model: the model `{asked[:256]}` does not exist")
        return asked

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, openai_api.CHAT, "ChatCompletions")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, openai_api.COMPLETIONS, "Completions")

    async def _generate(self, request: Request, kind: str, name: str) -> Response:
        started = time.monotonic()
        call = None
        try:
            rid = self._admit(request, name)
            session_id = request.headers.get(SESSION_ID_HEADER, "")
            overflow = request.headers.get(CONTEXT_OVERFLOW_HEADER, "")
            body = await self._body(request)
            model = self._model_of(body)
            call = openai_api.parse(kind, body, session_id, overflow, self.config.strict_openai)
            if call.unknown:
                # accepted and unused, as vLLM does (--strict-openai refuses them)
                log.warning("openai_fields_ignored", fields=call.unknown[:32])
            call.request.request_id = rid
            session = None
            if session_id:
                # NOT_FOUND for an unknown session from here, before any work.
                session = await self.fe.engine.get_session(session_id, principal())
                if kind == openai_api.CHAT and session.history_tokens > 0:
                    # OpenAI clients resend the whole conversation: a turn of a
                    # session that has history sends what follows the last answer.
                    openai_api.continue_conversation(call)
            reply = openai_reply.Reply(call, model, rid)
            on_prompt = reply.prompt_counted if call.continuous_usage else None
            events = self.fe.events(call.request, session, on_prompt)
            # The first event before any byte goes out: a request the engine
            # refuses (bad value, queue full, busy session) gets its own HTTP
            # status rather than an error inside a 200 stream.
            first = await anext(events)
        except Exception as exc:
            return self._failure(name, exc, started, call.names if call else None)
        if call.stream:
            body = self._stream(name, reply, first, events, started)
            return _EventStream(body, events, rid)
        text: dict[int, list[str]] = {}  # per choice (n > 1)
        event: Any = first
        try:
            while not openai_reply.is_final(event):
                text.setdefault(event.index, []).append(event.text)
                reply.seen(event)
                event = await anext(events)
        except Exception as exc:
            return self._failure(name, exc, started, call.names)
        finally:
            await events.aclose()
        self.fe.metrics.observe_rpc(name, "OK", started)
        texts = {i: "".join(parts) for i, parts in text.items()}
        headers = {"x-request-id": rid, "x-seed": str(event.seed)}
        return _json(reply.response(texts, event), headers=headers)

    async def _stream(
        self,
        name: str,
        reply: openai_reply.Reply,
        event: Any,
        events: AsyncGenerator[Any, None],
        started: float,
    ) -> AsyncIterator[bytes]:
        code = "CANCELLED"  # until the stream ends (a disconnect leaves it so)
        try:
            while True:
                if openai_reply.is_final(event):
                    for last in reply.final_chunks(event):
                        yield _sse(last)
                    yield b"data: [DONE]\n\n"
                    code = "OK"
                    return
                chunk = reply.delta_chunk(event)
                if chunk is not None:
                    yield _sse(chunk)
                event = await anext(events)
        except GenAIError as exc:
            # After the headers: the error as the stream's last event, as
            # OpenAI's server sends it.
            code = exc.code
            yield _sse(openai_reply.error_body(exc, reply.call.names)[1])
        finally:
            await events.aclose()
            self.fe.metrics.observe_rpc(name, code, started)

    async def models(self, request: Request) -> Response:
        started = time.monotonic()
        try:
            self._admit(request, "ListModels")
            info = self.fe.engine.info
            if info is None:
                raise Unavailable("the engine is starting; retry shortly")
        except Exception as exc:
            return self._failure("ListModels", exc, started)
        self.fe.metrics.observe_rpc("ListModels", "OK", started)
        return _json(openai_reply.models(self.served_names(), self.created))

    async def model(self, request: Request) -> Response:
        """``GET /v1/models/{id}``: the served name's model object, or 404."""
        started = time.monotonic()
        try:
            self._admit(request, "GetModel")
            if self.fe.engine.info is None:
                raise Unavailable("the engine is starting; retry shortly")
            asked = self._model_of({"model": request.path_params["model_id"]})
        except Exception as exc:
            return self._failure("GetModel", exc, started)
        self.fe.metrics.observe_rpc("GetModel", "OK", started)
        return _json(openai_reply.model_object(asked, self.created))

    async def health(self, request: Request) -> Response:
        serving = self.fe.engine.ready and not self.fe.draining
        return _json({"status": "ok" if serving else "unavailable"}, 200 if serving else 503)

    async def prometheus(self, request: Request) -> Response:
        """The --metrics-port registry on this port too, for scrapers that read
        the model server's own port (the Inference Extension's endpoint picker);
        open like /health and --metrics-port."""
        body = prometheus_client.generate_latest(self.fe.metrics.registry)
        return Response(body, media_type=prometheus_client.CONTENT_TYPE_LATEST)

    # -- sessions (SessionService over HTTP) -------------------------------------

    def _session(self, info: Any) -> dict[str, Any]:
        return {
            "id": info.session_id,
            "object": "session",
            "created_at": int(info.created_at),
            "last_used_at": int(info.last_used_at),
            "history_tokens": info.history_tokens,
            "turns": info.turns,
            "idle_ttl_seconds": int(info.idle_ttl_s),
            "metadata": dict(info.metadata),
            "context_overflow": info.context_overflow,
            "dropped_tokens": info.dropped_tokens,
        }

    async def _session_call(self, request: Request, name: str, fn: Any) -> Response:
        started = time.monotonic()
        try:
            self._admit(request, name)
            body = await fn()
        except Exception as exc:
            return self._failure(name, exc, started)
        self.fe.metrics.observe_rpc(name, "OK", started)
        return _json(body)

    async def _object(self, request: Request, fields: tuple[str, ...]) -> dict[str, Any]:
        body = await self._body(request)
        if not isinstance(body, dict):
            raise InvalidArgument("body: must be a JSON object")
        for key in body:
            if key not in fields:
                raise InvalidArgument(f"{key}: unknown field")
        return body

    def _new_session_fields(self, body: dict[str, Any]) -> tuple[float | None, dict[str, str]]:
        """``idle_ttl_seconds`` and ``metadata`` of a CreateSession or ForkSession body."""
        ttl = _count(body, "idle_ttl_seconds", low=1)
        metadata: Any = body.get("metadata") or {}
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise InvalidArgument("metadata: must be an object of strings")
        check_metadata(metadata, self.fe.engine.config.sessions)
        return (float(ttl) if ttl is not None else None), metadata

    async def create_session(self, request: Request) -> Response:
        async def run() -> dict[str, Any]:
            body = await self._object(request, ("idle_ttl_seconds", "metadata", "context_overflow"))
            ttl, metadata = self._new_session_fields(body)
            mode = body.get("context_overflow")
            overflow = None
            if mode is not None:
                if not isinstance(mode, str):
                    shown = json.dumps(mode)[:80]
                    raise InvalidArgument(f"context_overflow: {shown} is not a string")
                overflow = convert.context_overflow(openai_api.context_overflow(mode))
            info = await self.fe.engine.create_session(ttl, principal(), metadata, overflow)
            return self._session(info)

        return await self._session_call(request, "CreateSession", run)

    async def rewind_session(self, request: Request) -> Response:
        async def run() -> dict[str, Any]:
            body = await self._object(request, ("turns", "history_tokens"))
            if len(body) != 1:
                raise InvalidArgument("body: give one of turns and history_tokens")
            (name,) = body
            if body[name] is None:
                raise InvalidArgument(f"{name}: must be a number")
            sid = request.path_params["session_id"]
            target = {name: _count(body, name, low=0)}
            return self._session(await self.fe.engine.rewind_session(sid, principal(), **target))

        return await self._session_call(request, "RewindSession", run)

    async def fork_session(self, request: Request) -> Response:
        async def run() -> dict[str, Any]:
            body = await self._object(request, ("turns", "idle_ttl_seconds", "metadata"))
            ttl, metadata = self._new_session_fields(body)
            info = await self.fe.engine.fork_session(
                request.path_params["session_id"],
                principal(),
                turns=_count(body, "turns", low=0),
                idle_ttl_s=ttl,
                metadata=metadata,
            )
            return self._session(info)

        return await self._session_call(request, "ForkSession", run)

    async def get_session(self, request: Request) -> Response:
        async def run() -> dict[str, Any]:
            sid = request.path_params["session_id"]
            return self._session(await self.fe.engine.get_session(sid, principal()))

        return await self._session_call(request, "GetSession", run)

    async def close_session(self, request: Request) -> Response:
        async def run() -> dict[str, Any]:
            sid = request.path_params["session_id"]
            await self.fe.engine.close_session(sid, principal())
            return {"id": sid, "object": "session", "deleted": True}

        return await self._session_call(request, "CloseSession", run)


def _count(body: dict[str, Any], name: str, *, low: int) -> int | None:
    """An unsigned 32-bit integer field of a JSON body (None when absent)."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value < 2**32:
        raise InvalidArgument(
            f"{name}: {json.dumps(value)[:40]} is out of range; allowed [{low}, 4294967295]"
        )
    return value
