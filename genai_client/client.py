"""Synchronous client for the genai.v1 control plane.

    from genai_client import Client

    with Client("localhost:50051") as client:
        print(client.generate("Hello", max_new_tokens=16).text)

        stream = client.stream("Once upon a time", temperature=0.8, seed=1)
        for delta in stream:
            print(delta.text, end="", flush=True)
        print(stream.result.finish_reason)

        with client.session() as chat:
            chat.generate(messages=[("user", "Hi, I am Ada.")])
            print(chat.generate(messages=[("user", "What is my name?")]).text)

Every failed call raises a :class:`~genai_client.errors.GenAIClientError`
subclass named after its status code; nothing here exposes protobuf.
"""

from __future__ import annotations

import contextlib
import queue
import uuid
from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Unpack

import grpc

from genai_client import _convert
from genai_client._convert import GenerateOptions, MessageLike
from genai_client.errors import GenAIClientError, InternalError, NotFoundError, from_rpc_error
from genai_client.types import (
    BidiEvent,
    Delta,
    GenerationResult,
    ModelInfo,
    SessionInfo,
    Token,
)
from genai_common.metadata import SESSION_ID_HEADER, header_safe
from genai_proto.genai.v1 import generate_pb2_grpc, model_pb2_grpc, session_pb2_grpc

DEFAULT_MAX_MESSAGE_BYTES = 32 * 1024 * 1024
DEFAULT_KEEPALIVE_TIME_MS = 60_000
_KEEPALIVE_TIMEOUT_MS = 20_000


def channel_options(
    options: Sequence[tuple[str, Any]] | None,
    keepalive_time_ms: int | None,
    max_message_bytes: int,
) -> list[tuple[str, Any]]:
    """gRPC channel arguments; explicit ``options`` come last and win."""
    args: list[tuple[str, Any]] = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]
    if keepalive_time_ms:
        args += [
            ("grpc.keepalive_time_ms", keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", _KEEPALIVE_TIMEOUT_MS),
        ]
    return args + list(options or ())


def channel_credentials(
    tls: bool,
    root_certificates: bytes | None,
    private_key: bytes | None,
    certificate_chain: bytes | None,
) -> grpc.ChannelCredentials | None:
    """TLS credentials (mTLS with a key and chain), or ``None`` for plaintext."""
    if not (tls or root_certificates or private_key or certificate_chain):
        return None
    return grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying the bearer token, if any."""
    return (("authorization", f"Bearer {token}"),) if token else ()


class GenerationStream(_convert.StreamState):
    """A streamed request: iterate it for :class:`Delta` objects.

    After the iteration ends, :attr:`result` holds the whole
    :class:`GenerationResult` (its ``text`` is the deltas' text joined).
    :meth:`collect` consumes what is left and returns the result. Leaving a
    ``with`` block, or :meth:`cancel`, cancels the request if it is still
    running. Failures raise :class:`GenAIClientError` from the iteration.
    """

    def __iter__(self) -> Iterator[Delta]:
        try:
            for response in self._call:
                delta = self._absorb(response)
                if delta is not None:
                    yield delta
        except grpc.RpcError as error:
            raise from_rpc_error(error) from error
        self._check_finished()

    def collect(self) -> GenerationResult:
        """Consume the remaining deltas and return the whole result."""
        for _ in self:
            pass
        return self.result

    def cancel(self) -> None:
        """Cancel the request; further iteration raises ``CancelledError``."""
        self._call.cancel()

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._result is None:
            self._call.cancel()


class BidiStream:
    """Several requests multiplexed on one ``GenerateBidi`` call.

    :meth:`start` sends a request and returns its request id; :meth:`cancel`
    cancels one (it then ends with ``finish_reason="CANCELLED"``). Iterating
    yields :class:`BidiEvent` objects of all requests, interleaved, until every
    started request has ended; start more and iterate again as needed. A
    request's failure is an event with ``error`` set; a failure of the whole
    call raises :class:`GenAIClientError`. :meth:`close` (or leaving a
    ``with`` block) ends the call, cancelling requests still running.
    """

    def __init__(
        self, stub: generate_pb2_grpc.GenerateServiceStub, metadata: Any, timeout: float | None
    ) -> None:
        self._requests: queue.Queue[Any] = queue.Queue()
        self._call = stub.GenerateBidi(
            iter(self._requests.get, None), metadata=metadata, timeout=timeout
        )
        self._texts: dict[str, list[str]] = {}  # running request id -> delta texts
        self._closed = False

    @property
    def pending(self) -> list[str]:
        """Ids of the started requests that have not ended yet."""
        return list(self._texts)

    def start(self, prompt: str | None = None, **options: Unpack[GenerateOptions]) -> str:
        """Start a request (options as :meth:`Client.generate`); returns its
        request id (``request_id`` if given, else a fresh random one)."""
        if self._closed:
            raise RuntimeError("the bidi stream is closed")
        request_id = options["request_id"] = options.get("request_id") or uuid.uuid4().hex
        if request_id in self._texts:
            raise ValueError(f"request_id {request_id!r} is already running on this stream")
        request = _convert.generate_request(prompt, **options)
        self._texts[request_id] = []
        self._requests.put(_convert.bidi_start(request))
        return request_id

    def cancel(self, request_id: str) -> None:
        """Cancel a started request (ignored by the server once it ended)."""
        if not self._closed:
            self._requests.put(_convert.bidi_cancel(request_id))

    def __iter__(self) -> Iterator[BidiEvent]:
        while self._texts:
            try:
                response = next(self._call)
            except StopIteration:
                raise InternalError(
                    f"the stream ended with requests still running: {self.pending}"
                ) from None
            except grpc.RpcError as error:
                raise from_rpc_error(error) from error
            event = _convert.bidi_event(response, self._texts)
            if event is not None:
                yield event

    def results(self) -> dict[str, GenerationResult | GenAIClientError]:
        """Consume events until every started request has ended; returns each
        request's result, or its error, by request id."""
        out: dict[str, GenerationResult | GenAIClientError] = {}
        for event in self:
            if event.result is not None:
                out[event.request_id] = event.result
            elif event.error is not None:
                out[event.request_id] = event.error
        return out

    def close(self) -> None:
        """Half-close the call and wait for it to end; requests still running
        are cancelled with the call."""
        if self._closed:
            return
        self._closed = True
        self._requests.put(None)  # ends the request iterator: half-close
        if self._texts:
            self._call.cancel()
            self._texts.clear()
            return
        try:
            for _ in self._call:  # the server ends the call once it saw half-close
                pass
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.CANCELLED:
                raise from_rpc_error(error) from error

    def __enter__(self) -> BidiStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Session:
    """A server-side session; each :meth:`generate`/:meth:`stream` is a turn.

    Made by :meth:`Client.session`. Used as a context manager it closes the
    session on exit when it created it (not when it attached to an existing
    id); a session that already expired closes silently.
    """

    def __init__(self, client: Client, info: SessionInfo, *, close_on_exit: bool) -> None:
        self._client = client
        self._info = info
        self.close_on_exit = close_on_exit

    @property
    def id(self) -> str:
        """The session id."""
        return self._info.session_id

    def generate(
        self,
        prompt: str | None = None,
        *,
        timeout: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> GenerationResult:
        """Run one turn to completion (options as :meth:`Client.generate`)."""
        options["session_id"] = self.id  # a fresh dict per call
        return self._client.generate(prompt, timeout=timeout, **options)

    def stream(
        self,
        prompt: str | None = None,
        *,
        timeout: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> GenerationStream:
        """Run one turn, streaming (see :meth:`Client.stream`)."""
        options["session_id"] = self.id  # a fresh dict per call
        return self._client.stream(prompt, timeout=timeout, **options)

    def info(self) -> SessionInfo:
        """The session's current state."""
        self._info = self._client.get_session(self.id)
        return self._info

    def reset(self) -> SessionInfo:
        """Clear the history (the id stays valid)."""
        self._info = self._client.reset_session(self.id)
        return self._info

    def rewind(self, *, turns: int | None = None, history_tokens: int | None = None) -> SessionInfo:
        """Step back to the first ``turns`` turns or ``history_tokens`` tokens
        (one of them); the KV of what is kept stays on the server."""
        self._info = self._client.rewind_session(
            self.id, turns=turns, history_tokens=history_tokens
        )
        return self._info

    def fork(
        self,
        *,
        turns: int | None = None,
        idle_ttl_seconds: int | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> Session:
        """A new session with this one's history (or its first ``turns``
        turns), its KV shared on the server; closed when its ``with`` block exits."""
        info = self._client.fork_session(
            self.id, turns=turns, idle_ttl_seconds=idle_ttl_seconds, metadata=metadata
        )
        return Session(self._client, info, close_on_exit=True)

    def close(self) -> None:
        """Close the session on the server; an expired one is ignored."""
        with contextlib.suppress(NotFoundError):
            self._client.close_session(self.id)

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self.close_on_exit:
            return
        try:
            self.close()
        except GenAIClientError:
            if exc is None:  # do not hide the exception that ended the block
                raise


class _ClientBase:
    """The channel, auth metadata, default deadline and stubs that both clients
    hold; ``_grpc`` is the module that makes the channel (``grpc`` or ``grpc.aio``)."""

    _grpc: Any = grpc

    def __init__(
        self,
        target: str,
        *,
        tls: bool = False,
        root_certificates: bytes | None = None,
        private_key: bytes | None = None,
        certificate_chain: bytes | None = None,
        token: str | None = None,
        options: Sequence[tuple[str, Any]] | None = None,
        keepalive_time_ms: int | None = DEFAULT_KEEPALIVE_TIME_MS,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        timeout: float | None = None,
    ) -> None:
        args = channel_options(options, keepalive_time_ms, max_message_bytes)
        creds = channel_credentials(tls, root_certificates, private_key, certificate_chain)
        self._channel = (
            self._grpc.secure_channel(target, creds, options=args)
            if creds is not None
            else self._grpc.insecure_channel(target, options=args)
        )
        self._metadata = auth_metadata(token)
        self._timeout = timeout
        self._generate = generate_pb2_grpc.GenerateServiceStub(self._channel)
        self._sessions = session_pb2_grpc.SessionServiceStub(self._channel)
        self._model = model_pb2_grpc.ModelServiceStub(self._channel)

    def _deadline(self, timeout: float | None) -> float | None:
        return self._timeout if timeout is None else timeout

    def _call_metadata(self, request: Any) -> tuple[tuple[str, str], ...]:
        """The call's metadata: the bearer token, and the session id of a
        request that names one as ``x-session-id`` too, so that a proxy in
        front of several replicas can hash on it (the server reads the id
        from the message; the header is for routing only)."""
        session_id = getattr(request, "session_id", "")
        if not session_id or not header_safe(session_id):
            return self._metadata  # the server answers an id it never made
        return (*self._metadata, (SESSION_ID_HEADER, session_id))


class Client(_ClientBase):
    """Synchronous client of GenerateService, SessionService and ModelService.

    Args:
        target: ``host:port`` of the server.
        tls: use TLS (implied by any certificate argument).
        root_certificates: PEM CA bundle to verify the server (default: the
            system roots).
        private_key, certificate_chain: PEM client key and chain for mTLS.
        token: bearer token, sent as ``authorization: Bearer <token>``.
        options: extra gRPC channel arguments (they override the defaults).
        keepalive_time_ms: interval of HTTP/2 keepalive pings on active calls;
            ``None`` or 0 disables them.
        max_message_bytes: largest message sent or received.
        timeout: default deadline in seconds of every call (``None``: none);
            each method's ``timeout`` overrides it.

    Use as a context manager, or call :meth:`close`.
    """

    _channel: grpc.Channel

    def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        try:
            return method(
                request, metadata=self._call_metadata(request), timeout=self._deadline(timeout)
            )
        except grpc.RpcError as error:
            raise from_rpc_error(error) from error

    # --- generation ------------------------------------------------------

    def generate(
        self,
        prompt: str | None = None,
        *,
        timeout: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> GenerationResult:
        """Generate to completion and return the whole result.

        Give the input as ``prompt`` (text), ``token_ids=[...]`` or
        ``messages=[...]`` (exactly one). Keyword options (all optional; unset
        means the server's default): ``session_id``, ``max_new_tokens``,
        ``min_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``min_p``,
        ``repetition_penalty``, ``frequency_penalty``, ``presence_penalty``,
        ``seed``, ``stop`` (str or list), ``stop_token_ids``, ``ignore_eos``,
        ``include_stop_sequence``, ``time_limit_ms``, ``top_logprobs``,
        ``priority`` ("low"|"normal"|"high"), ``add_special_tokens``,
        ``skip_special_tokens``, ``request_id``, ``cache_salt``, ``truncate_prompt_tokens``,
        ``context_overflow`` ("error"|"slide"); see
        :class:`~genai_client._convert.GenerateOptions`. ``timeout`` is the
        call's deadline in seconds.
        """
        request = _convert.generate_request(prompt, **options)
        response = self._unary(self._generate.Generate, request, timeout)
        return _convert.result_from_response(response)

    def stream(
        self,
        prompt: str | None = None,
        *,
        timeout: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> GenerationStream:
        """Start a streamed request (arguments as :meth:`generate`); iterate the
        returned :class:`GenerationStream` for deltas, then read ``.result``."""
        request = _convert.generate_request(prompt, **options)
        call = self._generate.GenerateStream(
            request, metadata=self._call_metadata(request), timeout=self._deadline(timeout)
        )
        return GenerationStream(call)

    def bidi(self, *, timeout: float | None = None) -> BidiStream:
        """Open a ``GenerateBidi`` call for several concurrent requests; see
        :class:`BidiStream`. ``timeout`` bounds the whole call."""
        return BidiStream(self._generate, self._metadata, self._deadline(timeout))

    # --- sessions --------------------------------------------------------

    def session(
        self,
        session_id: str | None = None,
        *,
        idle_ttl_seconds: int | None = None,
        metadata: Mapping[str, str] | None = None,
        context_overflow: str | None = None,
        timeout: float | None = None,
    ) -> Session:
        """A :class:`Session` to run turns in: a new one (closed when a
        ``with`` block exits), or the existing ``session_id`` (left open)."""
        if session_id is not None:
            return Session(self, self.get_session(session_id, timeout=timeout), close_on_exit=False)
        info = self.create_session(
            idle_ttl_seconds=idle_ttl_seconds,
            metadata=metadata,
            context_overflow=context_overflow,
            timeout=timeout,
        )
        return Session(self, info, close_on_exit=True)

    def create_session(
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
        response = self._unary(self._sessions.CreateSession, request, timeout)
        return _convert.session_from_proto(response.session)

    def get_session(self, session_id: str, *, timeout: float | None = None) -> SessionInfo:
        """Describe a session (``NotFoundError`` if unknown or expired)."""
        request = _convert.get_session_request(session_id)
        response = self._unary(self._sessions.GetSession, request, timeout)
        return _convert.session_from_proto(response.session)

    def reset_session(self, session_id: str, *, timeout: float | None = None) -> SessionInfo:
        """Clear a session's history, keeping its id."""
        request = _convert.reset_session_request(session_id)
        response = self._unary(self._sessions.ResetSession, request, timeout)
        return _convert.session_from_proto(response.session)

    def rewind_session(
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
        response = self._unary(self._sessions.RewindSession, request, timeout)
        return _convert.session_from_proto(response.session)

    def fork_session(
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
        response = self._unary(self._sessions.ForkSession, request, timeout)
        return _convert.session_from_proto(response.session)

    def close_session(self, session_id: str, *, timeout: float | None = None) -> None:
        """Close a session and free what it holds."""
        request = _convert.close_session_request(session_id)
        self._unary(self._sessions.CloseSession, request, timeout)

    def list_sessions(
        self, *, page_size: int = 0, timeout: float | None = None
    ) -> list[SessionInfo]:
        """The caller's open sessions, oldest first: every page, fetched
        ``page_size`` at a time (0: the server's default); ``timeout`` bounds
        each page's call."""
        sessions: list[SessionInfo] = []
        token = ""
        while True:
            request = _convert.list_sessions_request(token, page_size)
            response = self._unary(self._sessions.ListSessions, request, timeout)
            sessions += [_convert.session_from_proto(s) for s in response.sessions]
            token = response.next_page_token
            if not token:
                return sessions

    # --- model -----------------------------------------------------------

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        """Describe the served model."""
        response = self._unary(self._model.GetModelInfo, _convert.model_info_request(), timeout)
        return _convert.model_info_from_proto(response.model_info)

    def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        add_special_tokens: bool | None = None,
        timeout: float | None = None,
    ) -> list[Token]:
        """Encode ``text`` (or chat ``messages``) as the server would; each
        token with its vocabulary string and character span."""
        request = _convert.tokenize_request(text, messages, add_special_tokens)
        return _convert.tokens_from_proto(self._unary(self._model.Tokenize, request, timeout))

    def detokenize(
        self,
        token_ids: Sequence[int],
        *,
        skip_special_tokens: bool | None = None,
        timeout: float | None = None,
    ) -> str:
        """Decode token ids to text (special tokens skipped unless asked)."""
        request = _convert.detokenize_request(token_ids, skip_special_tokens)
        return str(self._unary(self._model.Detokenize, request, timeout).text)

    # --- lifetime --------------------------------------------------------

    def close(self) -> None:
        """Close the channel; calls still running are cancelled."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
