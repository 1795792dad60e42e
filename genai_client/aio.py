"""Asynchronous (asyncio) client for the genai.v1 control plane.

    from genai_client import AsyncClient

    async with AsyncClient("localhost:50051") as client:
        result = await client.generate("Hello", max_new_tokens=16)

        stream = client.stream("Once upon a time", temperature=0.8, seed=1)
        async for delta in stream:
            print(delta.text, end="", flush=True)
        print(stream.result.finish_reason)

        async with client.session() as chat:
            await chat.generate(messages=[("user", "Hi, I am Ada.")])

It mirrors :class:`genai_client.Client`; create it inside the event loop that
uses it. Failed calls raise :class:`~genai_client.errors.GenAIClientError`
subclasses.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Generator, Mapping, Sequence
from types import TracebackType
from typing import Any, Unpack

import grpc
import grpc.aio

from genai_client import _convert
from genai_client._convert import GenerateOptions, MessageLike
from genai_client.client import _ClientBase
from genai_client.errors import (
    CancelledError,
    GenAIClientError,
    InternalError,
    NotFoundError,
    from_rpc_error,
)
from genai_client.types import (
    BidiEvent,
    Delta,
    GenerationResult,
    ModelInfo,
    SessionInfo,
    Token,
)
from genai_proto.genai.v1 import generate_pb2_grpc


class AsyncGenerationStream(_convert.StreamState):
    """A streamed request: ``async for`` it for :class:`Delta` objects.

    After the iteration ends, :attr:`result` holds the whole result;
    ``await collect()`` consumes what is left and returns it. :meth:`cancel`,
    or leaving an ``async with`` block early, cancels the request.
    """

    _collect_hint = "await collect()"

    def __init__(self, call: Any) -> None:
        super().__init__(call)
        self._cancelled = False

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._deltas()

    async def _deltas(self) -> AsyncIterator[Delta]:
        try:
            async for response in self._call:
                delta = self._absorb(response)
                if delta is not None:
                    yield delta
        except grpc.RpcError as error:
            raise from_rpc_error(error) from error
        except asyncio.CancelledError:
            if self._cancelled:  # our cancel(), not the task's cancellation
                raise CancelledError("cancelled by the client") from None
            raise
        self._check_finished()

    async def collect(self) -> GenerationResult:
        """Consume the remaining deltas and return the whole result."""
        async for _ in self:
            pass
        return self.result

    def cancel(self) -> None:
        """Cancel the request; further iteration raises ``CancelledError``."""
        self._cancelled = True
        self._call.cancel()

    async def __aenter__(self) -> AsyncGenerationStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._result is None:
            self.cancel()


class AsyncBidiStream:
    """Several requests multiplexed on one ``GenerateBidi`` call (the async
    :class:`genai_client.client.BidiStream`): ``await start(...)``,
    ``await cancel(id)``, ``async for event in stream``, ``await close()``."""

    def __init__(
        self, stub: generate_pb2_grpc.GenerateServiceStub, metadata: Any, timeout: float | None
    ) -> None:
        self._call = stub.GenerateBidi(metadata=metadata, timeout=timeout)
        self._texts: dict[str, list[str]] = {}  # running request id -> delta texts
        self._write_lock = asyncio.Lock()  # grpc.aio allows one write at a time
        self._closed = False

    @property
    def pending(self) -> list[str]:
        """Ids of the started requests that have not ended yet."""
        return list(self._texts)

    async def _write(self, message: Any) -> None:
        async with self._write_lock:
            try:
                await self._call.write(message)
            except grpc.RpcError as error:
                raise from_rpc_error(error) from error

    async def start(self, prompt: str | None = None, **options: Unpack[GenerateOptions]) -> str:
        """Start a request (options as :meth:`AsyncClient.generate`); returns
        its request id (``request_id`` if given, else a fresh random one)."""
        if self._closed:
            raise RuntimeError("the bidi stream is closed")
        request_id = options["request_id"] = options.get("request_id") or uuid.uuid4().hex
        if request_id in self._texts:
            raise ValueError(f"request_id {request_id!r} is already running on this stream")
        request = _convert.generate_request(prompt, **options)
        self._texts[request_id] = []
        await self._write(_convert.bidi_start(request))
        return request_id

    async def cancel(self, request_id: str) -> None:
        """Cancel a started request (ignored by the server once it ended)."""
        if not self._closed:
            await self._write(_convert.bidi_cancel(request_id))

    def __aiter__(self) -> AsyncIterator[BidiEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[BidiEvent]:
        while self._texts:
            try:
                response = await self._call.read()
            except grpc.RpcError as error:
                raise from_rpc_error(error) from error
            if response is grpc.aio.EOF:
                raise InternalError(f"the stream ended with requests still running: {self.pending}")
            event = _convert.bidi_event(response, self._texts)
            if event is not None:
                yield event

    async def results(self) -> dict[str, GenerationResult | GenAIClientError]:
        """Consume events until every started request has ended; returns each
        request's result, or its error, by request id."""
        out: dict[str, GenerationResult | GenAIClientError] = {}
        async for event in self:
            if event.result is not None:
                out[event.request_id] = event.result
            elif event.error is not None:
                out[event.request_id] = event.error
        return out

    async def close(self) -> None:
        """Half-close the call and wait for it to end; requests still running
        are cancelled with the call."""
        if self._closed:
            return
        self._closed = True
        if self._texts:
            self._call.cancel()
            self._texts.clear()
            return
        try:
            async with self._write_lock:
                await self._call.done_writing()
            while await self._call.read() is not grpc.aio.EOF:
                pass
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.CANCELLED:
                raise from_rpc_error(error) from error

    async def __aenter__(self) -> AsyncBidiStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncSession:
    """A server-side session; each :meth:`generate`/:meth:`stream` is a turn.

    Made by :meth:`AsyncClient.session`; as an async context manager it closes
    the session on exit when it created it (an expired one closes silently).
    """

    def __init__(self, client: AsyncClient, info: SessionInfo, *, close_on_exit: bool) -> None:
        self._client = client
        self._info = info
        self.close_on_exit = close_on_exit

    @property
    def id(self) -> str:
        """The session id."""
        return self._info.session_id

    async def generate(
        self,
        prompt: str | None = None,
        *,
        timeout: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> GenerationResult:
        """Run one turn to completion (options as :meth:`AsyncClient.generate`)."""
        options["session_id"] = self.id  # a fresh dict per call
        return await self._client.generate(prompt, timeout=timeout, **options)

    def stream(
        self,
        prompt: str | None = None,
        *,
        timeout: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> AsyncGenerationStream:
        """Run one turn, streaming (see :meth:`AsyncClient.stream`)."""
        options["session_id"] = self.id  # a fresh dict per call
        return self._client.stream(prompt, timeout=timeout, **options)

    async def info(self) -> SessionInfo:
        """The session's current state."""
        self._info = await self._client.get_session(self.id)
        return self._info

    async def reset(self) -> SessionInfo:
        """Clear the history (the id stays valid)."""
        self._info = await self._client.reset_session(self.id)
        return self._info

    async def rewind(
        self, *, turns: int | None = None, history_tokens: int | None = None
    ) -> SessionInfo:
        """Step back to the first ``turns`` turns or ``history_tokens`` tokens
        (one of them); the KV of what is kept stays on the server."""
        self._info = await self._client.rewind_session(
            self.id, turns=turns, history_tokens=history_tokens
        )
        return self._info

    async def fork(
        self,
        *,
        turns: int | None = None,
        idle_ttl_seconds: int | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> AsyncSession:
        """A new session with this one's history (or its first ``turns``
        turns), its KV shared on the server; closed when its ``async with`` exits."""
        info = await self._client.fork_session(
            self.id, turns=turns, idle_ttl_seconds=idle_ttl_seconds, metadata=metadata
        )
        return AsyncSession(self._client, info, close_on_exit=True)

    async def close(self) -> None:
        """Close the session on the server; an expired one is ignored."""
        with contextlib.suppress(NotFoundError):
            await self._client.close_session(self.id)

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self.close_on_exit:
            return
        try:
            await self.close()
        except GenAIClientError:
            if exc is None:  # do not hide the exception that ended the block
                raise


class _SessionOpener:
    """What :meth:`AsyncClient.session` returns: ``await`` it for an
    :class:`AsyncSession`, or use it in ``async with``."""

    def __init__(self, open_session: Any) -> None:
        self._open = open_session
        self._session: AsyncSession | None = None

    def __await__(self) -> Generator[Any, None, AsyncSession]:
        return self._open().__await__()

    async def __aenter__(self) -> AsyncSession:
        self._session = await self._open()
        return self._session

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._session is not None:
            await self._session.__aexit__(exc_type, exc, tb)


class AsyncClient(_ClientBase):
    """Asynchronous client of GenerateService, SessionService and ModelService.

    Arguments as :class:`genai_client.Client`. Use ``async with``, or
    ``await close()``.
    """

    _grpc = grpc.aio
    _channel: grpc.aio.Channel

    async def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        try:
            return await method(
                request, metadata=self._call_metadata(request), timeout=self._deadline(timeout)
            )
        except grpc.RpcError as error:
            raise from_rpc_error(error) from error

    # --- generation ------------------------------------------------------

    async def generate(
        self,
        prompt: str | None = None,
        *,
        timeout: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> GenerationResult:
        """Generate to completion and return the whole result (arguments as
        :meth:`genai_client.Client.generate`)."""
        request = _convert.generate_request(prompt, **options)
        response = await self._unary(self._generate.Generate, request, timeout)
        return _convert.result_from_response(response)

    def stream(
        self,
        prompt: str | None = None,
        *,
        timeout: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> AsyncGenerationStream:
        """Start a streamed request (no ``await``); ``async for`` the returned
        :class:`AsyncGenerationStream`, then read ``.result``."""
        request = _convert.generate_request(prompt, **options)
        call = self._generate.GenerateStream(
            request, metadata=self._call_metadata(request), timeout=self._deadline(timeout)
        )
        return AsyncGenerationStream(call)

    def bidi(self, *, timeout: float | None = None) -> AsyncBidiStream:
        """Open a ``GenerateBidi`` call (no ``await``); see :class:`AsyncBidiStream`."""
        return AsyncBidiStream(self._generate, self._metadata, self._deadline(timeout))

    # --- sessions --------------------------------------------------------

    def session(
        self,
        session_id: str | None = None,
        *,
        idle_ttl_seconds: int | None = None,
        metadata: Mapping[str, str] | None = None,
        context_overflow: str | None = None,
        timeout: float | None = None,
    ) -> _SessionOpener:
        """``async with client.session() as s`` (or ``s = await
        client.session()``): a new session, closed when the block exits, or
        the existing ``session_id`` (left open)."""

        async def open_session() -> AsyncSession:
            if session_id is not None:
                info = await self.get_session(session_id, timeout=timeout)
                return AsyncSession(self, info, close_on_exit=False)
            info = await self.create_session(
                idle_ttl_seconds=idle_ttl_seconds,
                metadata=metadata,
                context_overflow=context_overflow,
                timeout=timeout,
            )
            return AsyncSession(self, info, close_on_exit=True)

        return _SessionOpener(open_session)

    async def create_session(
        self,
        *,
        idle_ttl_seconds: int | None = None,
        metadata: Mapping[str, str] | None = None,
        context_overflow: str | None = None,
        timeout: float | None = None,
    ) -> SessionInfo:
        """Create an empty session (``idle_ttl_seconds`` unset: server default;
        ``context_overflow`` "error" or "slide": what its turns do at the
        context window unless a turn says otherwise, unset: server default)."""
        request = _convert.create_session_request(idle_ttl_seconds, metadata, context_overflow)
        response = await self._unary(self._sessions.CreateSession, request, timeout)
        return _convert.session_from_proto(response.session)

    async def get_session(self, session_id: str, *, timeout: float | None = None) -> SessionInfo:
        """Describe a session (``NotFoundError`` if unknown or expired)."""
        request = _convert.get_session_request(session_id)
        response = await self._unary(self._sessions.GetSession, request, timeout)
        return _convert.session_from_proto(response.session)

    async def reset_session(self, session_id: str, *, timeout: float | None = None) -> SessionInfo:
        """Clear a session's history, keeping its id."""
        request = _convert.reset_session_request(session_id)
        response = await self._unary(self._sessions.ResetSession, request, timeout)
        return _convert.session_from_proto(response.session)

    async def rewind_session(
        self,
        session_id: str,
        *,
        turns: int | None = None,
        history_tokens: int | None = None,
        timeout: float | None = None,
    ) -> SessionInfo:
        """Cut a session's history to its first ``turns`` turns or
        ``history_tokens`` tokens (give one); its KV of the rest stays."""
        request = _convert.rewind_session_request(session_id, turns, history_tokens)
        response = await self._unary(self._sessions.RewindSession, request, timeout)
        return _convert.session_from_proto(response.session)

    async def fork_session(
        self,
        session_id: str,
        *,
        turns: int | None = None,
        idle_ttl_seconds: int | None = None,
        metadata: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> SessionInfo:
        """A new session whose history is ``session_id``'s (or its first
        ``turns`` turns), sharing its KV on the server."""
        request = _convert.fork_session_request(session_id, turns, idle_ttl_seconds, metadata)
        response = await self._unary(self._sessions.ForkSession, request, timeout)
        return _convert.session_from_proto(response.session)

    async def close_session(self, session_id: str, *, timeout: float | None = None) -> None:
        """Close a session and free what it holds."""
        request = _convert.close_session_request(session_id)
        await self._unary(self._sessions.CloseSession, request, timeout)

    async def list_sessions(
        self, *, page_size: int = 0, timeout: float | None = None
    ) -> list[SessionInfo]:
        """The caller's open sessions, oldest first: every page, fetched
        ``page_size`` at a time (0: the server's default); ``timeout`` bounds
        each page's call."""
        sessions: list[SessionInfo] = []
        token = ""
        while True:
            request = _convert.list_sessions_request(token, page_size)
            response = await self._unary(self._sessions.ListSessions, request, timeout)
            sessions += [_convert.session_from_proto(s) for s in response.sessions]
            token = response.next_page_token
            if not token:
                return sessions

    # --- model -----------------------------------------------------------

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        """Describe the served model."""
        response = await self._unary(
            self._model.GetModelInfo, _convert.model_info_request(), timeout
        )
        return _convert.model_info_from_proto(response.model_info)

    async def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        add_special_tokens: bool | None = None,
        timeout: float | None = None,
    ) -> list[Token]:
        """Encode ``text`` (or chat ``messages``) as the server would."""
        request = _convert.tokenize_request(text, messages, add_special_tokens)
        response = await self._unary(self._model.Tokenize, request, timeout)
        return _convert.tokens_from_proto(response)

    async def detokenize(
        self,
        token_ids: Sequence[int],
        *,
        skip_special_tokens: bool | None = None,
        timeout: float | None = None,
    ) -> str:
        """Decode token ids to text (special tokens skipped unless asked)."""
        request = _convert.detokenize_request(token_ids, skip_special_tokens)
        response = await self._unary(self._model.Detokenize, request, timeout)
        return str(response.text)

    # --- lifetime --------------------------------------------------------

    async def close(self) -> None:
        """Close the channel; calls still running are cancelled."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
