"""The Python client and the ``genai`` CLI against a fake genai.v1 server.

The fake (a ``grpc.aio`` server in a background thread, on a free port) is
deterministic: its "model" echoes the prompt, one token per character
(token id = code point), so every expected value is known exactly. It only
exists to test the client; the real servicers are tested elsewhere.
"""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
import pytest
from google.protobuf import json_format
from google.rpc import status_pb2

import genai_client
from genai_client import (
    AsyncClient,
    Client,
    Delta,
    GenAIClientError,
    GenerationResult,
    SessionInfo,
)
from genai_client.cli import main as cli_main
from genai_proto.genai.v1 import (
    common_pb2,
    generate_pb2,
    generate_pb2_grpc,
    model_pb2,
    model_pb2_grpc,
    session_pb2,
    session_pb2_grpc,
)

pytestmark = pytest.mark.timeout(60)

SEED = 42
SLOW_TOKEN_S = 0.01  # per-token delay of prompts starting with "slow"
TOKEN = "s3cret"


# --- the fake server -----------------------------------------------------------


class FakeError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class FakeSession:
    session_id: str
    ttl: int
    metadata: dict[str, str]
    history: int = 0
    turns: int = 0
    created: float = field(default_factory=time.time)


@dataclass
class Plan:
    """What the echo model will produce for a request."""

    tokens: list[int]
    finish: int
    stop_sequence: str
    prompt_tokens: int
    delay_s: float


@dataclass
class FakeState:
    auth: list[str | None] = field(default_factory=list)
    session_headers: list[str | None] = field(default_factory=list)  # x-session-id
    requests: list[generate_pb2.GenerateRequest] = field(default_factory=list)
    sessions: dict[str, FakeSession] = field(default_factory=dict)

    def record(self, context: grpc.aio.ServicerContext) -> None:
        metadata = dict(context.invocation_metadata() or ())
        self.auth.append(metadata.get("authorization"))
        self.session_headers.append(metadata.get("x-session-id"))

    def prompt_text(self, request: Any) -> str:
        kind = request.WhichOneof("input")
        if kind == "text":
            return str(request.text)
        if kind == "token_ids":
            return "".join(chr(i) for i in request.token_ids.ids)
        if kind == "messages":
            return "".join(f"{m.role}:{m.content}|" for m in request.messages.messages)
        raise FakeError(grpc.StatusCode.INVALID_ARGUMENT, "input: must be set")

    def plan(self, request: generate_pb2.GenerateRequest) -> Plan:
        self.requests.append(request)
        text = self.prompt_text(request)
        if text.startswith("!"):  # "!NOT_FOUND" fails with that status
            code = grpc.StatusCode[text[1:]]
            raise FakeError(code, f"fake {code.name}")
        if request.session_id and request.session_id not in self.sessions:
            raise FakeError(grpc.StatusCode.NOT_FOUND, "session not found")
        out, finish, stop = text, common_pb2.FINISH_REASON_EOS_TOKEN, ""
        for s in request.stopping.stop_sequences:
            if (i := out.find(s)) >= 0:
                keep = len(s) if request.stopping.include_stop_sequence else 0
                out, finish, stop = out[: i + keep], common_pb2.FINISH_REASON_STOP_SEQUENCE, s
                break
        if request.stopping.HasField("max_new_tokens") and len(out) > (
            limit := request.stopping.max_new_tokens
        ):
            out, finish, stop = out[:limit], common_pb2.FINISH_REASON_MAX_TOKENS, ""
        delay = SLOW_TOKEN_S if text.startswith("slow") else 0.0
        return Plan([ord(c) for c in out], finish, stop, len(text), delay)

    def logprobs(self, request: Any, tokens: list[int]) -> list[common_pb2.TokenLogprob]:
        if not request.top_logprobs:
            return []
        return [
            common_pb2.TokenLogprob(
                token_id=t,
                text=chr(t),
                logprob=-0.5,
                top=[common_pb2.TopLogprob(token_id=t, text=chr(t), logprob=-0.5)]
                * request.top_logprobs,
            )
            for t in tokens
        ]

    def final(self, request: Any, plan: Plan, tokens: list[int], finish: int) -> generate_pb2.Final:
        session_tokens = 0
        if request.session_id:
            session = self.sessions[request.session_id]
            session.history += plan.prompt_tokens + len(tokens)
            session.turns += 1
            session_tokens = session.history
        return generate_pb2.Final(
            token_ids=tokens,
            finish_reason=finish,  # type: ignore[arg-type]
            stop_sequence=plan.stop_sequence if finish == plan.finish else "",
            logprobs=self.logprobs(request, tokens),
            usage=common_pb2.Usage(
                prompt_tokens=plan.prompt_tokens, completion_tokens=len(tokens), cached_tokens=1
            ),
            seed=request.sampling.seed if request.sampling.HasField("seed") else SEED,
            session_id=request.session_id,
            session_tokens=session_tokens,
            request_id=request.request_id or "srv-1",
        )

    def session_proto(self, s: FakeSession) -> session_pb2.Session:
        proto = session_pb2.Session(
            session_id=s.session_id,
            history_tokens=s.history,
            turns=s.turns,
            idle_ttl_seconds=s.ttl,
            metadata=s.metadata,
        )
        proto.created_at.FromSeconds(int(s.created))
        proto.last_used_at.FromSeconds(int(s.created))
        return proto


class FakeGenerate(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(self, state: FakeState) -> None:
        self.state = state

    async def Generate(self, request: Any, context: Any) -> generate_pb2.GenerateResponse:
        self.state.record(context)
        try:
            plan = self.state.plan(request)
        except FakeError as e:
            await context.abort(e.code, e.message)
        await asyncio.sleep(plan.delay_s * len(plan.tokens))
        final = self.state.final(request, plan, plan.tokens, plan.finish)
        # Final has every GenerateResponse field but the text, under the same names.
        response = json_format.ParseDict(
            json_format.MessageToDict(final), generate_pb2.GenerateResponse()
        )
        response.text = "".join(map(chr, plan.tokens))
        return response

    async def GenerateStream(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.state.record(context)
        try:
            plan = self.state.plan(request)
        except FakeError as e:
            await context.abort(e.code, e.message)
        for t in plan.tokens:
            await asyncio.sleep(plan.delay_s)
            yield generate_pb2.GenerateStreamResponse(
                delta=generate_pb2.Delta(
                    text=chr(t), token_ids=[t], logprobs=self.state.logprobs(request, [t])
                )
            )
        final = self.state.final(request, plan, plan.tokens, plan.finish)
        yield generate_pb2.GenerateStreamResponse(final=final)

    async def GenerateBidi(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        self.state.record(context)
        out: asyncio.Queue[generate_pb2.BidiResponse | None] = asyncio.Queue()
        tasks: dict[str, asyncio.Task[None]] = {}

        async def run(request: generate_pb2.GenerateRequest) -> None:
            rid = request.request_id
            try:
                plan = self.state.plan(request)
            except FakeError as e:
                status = status_pb2.Status(code=e.code.value[0], message=e.message)
                await out.put(generate_pb2.BidiResponse(request_id=rid, error=status))
                return
            sent: list[int] = []
            finish = plan.finish
            try:
                for t in plan.tokens:
                    await asyncio.sleep(plan.delay_s)
                    sent.append(t)
                    await out.put(
                        generate_pb2.BidiResponse(
                            request_id=rid, delta=generate_pb2.Delta(text=chr(t), token_ids=[t])
                        )
                    )
            except asyncio.CancelledError:
                finish = common_pb2.FINISH_REASON_CANCELLED
            final = self.state.final(request, plan, sent, finish)
            await out.put(generate_pb2.BidiResponse(request_id=rid, final=final))

        async def read() -> None:
            async for message in request_iterator:
                if message.WhichOneof("action") == "start":
                    tasks[message.start.request_id] = asyncio.create_task(run(message.start))
                else:
                    task = tasks.get(message.cancel.request_id)
                    if task is not None and not task.done():
                        task.cancel()
            await out.put(None)  # the client half-closed

        reader = asyncio.create_task(read())
        reading = True
        try:
            while reading or not all(t.done() for t in tasks.values()) or not out.empty():
                item = await out.get()
                if item is None:
                    reading = False
                else:
                    yield item
        finally:
            reader.cancel()
            for task in tasks.values():
                task.cancel()


class FakeSessions(session_pb2_grpc.SessionServiceServicer):
    def __init__(self, state: FakeState) -> None:
        self.state = state

    async def _get(self, session_id: str, context: Any) -> FakeSession:
        self.state.record(context)
        if session_id not in self.state.sessions:
            await context.abort(grpc.StatusCode.NOT_FOUND, "session not found")
        return self.state.sessions[session_id]

    async def CreateSession(self, request: Any, context: Any) -> Any:
        self.state.record(context)
        ttl = request.idle_ttl_seconds if request.HasField("idle_ttl_seconds") else 300
        s = FakeSession(uuid.uuid4().hex, ttl, dict(request.metadata))
        self.state.sessions[s.session_id] = s
        return session_pb2.CreateSessionResponse(session=self.state.session_proto(s))

    async def GetSession(self, request: Any, context: Any) -> Any:
        s = await self._get(request.session_id, context)
        return session_pb2.GetSessionResponse(session=self.state.session_proto(s))

    async def ResetSession(self, request: Any, context: Any) -> Any:
        s = await self._get(request.session_id, context)
        s.history = s.turns = 0
        return session_pb2.ResetSessionResponse(session=self.state.session_proto(s))

    async def CloseSession(self, request: Any, context: Any) -> Any:
        await self._get(request.session_id, context)
        del self.state.sessions[request.session_id]
        return session_pb2.CloseSessionResponse()

    async def ListSessions(self, request: Any, context: Any) -> Any:
        return session_pb2.ListSessionsResponse(
            sessions=[self.state.session_proto(s) for s in self.state.sessions.values()]
        )


class FakeModel(model_pb2_grpc.ModelServiceServicer):
    def __init__(self, state: FakeState) -> None:
        self.state = state

    async def GetModelInfo(self, request: Any, context: Any) -> Any:
        return model_pb2.GetModelInfoResponse(
            model_info=model_pb2.ModelInfo(
                model_id="echo",
                context_length=2048,
                vocab_size=0x110000,
                eos_token_ids=[0],
                kv_layout=model_pb2.KvLayout(
                    num_layers=2, num_kv_heads=4, head_dim=16, dtype="float16"
                ),
                runner_kind=model_pb2.RUNNER_KIND_SHARED_BUFFER,
                has_chat_template=True,
                kv_chunk_size=16,
            )
        )

    async def Tokenize(self, request: Any, context: Any) -> Any:
        text = self.state.prompt_text(request)
        response = model_pb2.TokenizeResponse(token_ids=[ord(c) for c in text], prompt_text=text)
        if request.return_tokens:
            response.tokens.extend(
                model_pb2.Token(id=ord(c), text=c, char_start=i, char_end=i + 1)
                for i, c in enumerate(text)
            )
        return response

    async def Detokenize(self, request: Any, context: Any) -> Any:
        return model_pb2.DetokenizeResponse(text="".join(map(chr, request.token_ids)))


@dataclass
class Fake:
    target: str
    state: FakeState


@pytest.fixture(scope="module")
def fake() -> Iterator[Fake]:
    state = FakeState()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        generate_pb2_grpc.add_GenerateServiceServicer_to_server(FakeGenerate(state), server)
        session_pb2_grpc.add_SessionServiceServicer_to_server(FakeSessions(state), server)
        model_pb2_grpc.add_ModelServiceServicer_to_server(FakeModel(state), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=10)
    try:
        yield Fake(f"127.0.0.1:{port}", state)
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(grace=None), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


@pytest.fixture
def client(fake: Fake) -> Iterator[Client]:
    with Client(fake.target, timeout=10) as c:
        yield c


# Every status code the server uses (docs/design.md, "Status codes") and its exception type.
CODES = [
    (grpc.StatusCode.INVALID_ARGUMENT, genai_client.InvalidArgumentError),
    (grpc.StatusCode.NOT_FOUND, genai_client.NotFoundError),
    (grpc.StatusCode.FAILED_PRECONDITION, genai_client.FailedPreconditionError),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, genai_client.ResourceExhaustedError),
    (grpc.StatusCode.UNAVAILABLE, genai_client.UnavailableError),
    (grpc.StatusCode.DEADLINE_EXCEEDED, genai_client.DeadlineExceededError),
    (grpc.StatusCode.CANCELLED, genai_client.CancelledError),
    (grpc.StatusCode.UNAUTHENTICATED, genai_client.UnauthenticatedError),
    (grpc.StatusCode.PERMISSION_DENIED, genai_client.PermissionDeniedError),
    (grpc.StatusCode.INTERNAL, genai_client.InternalError),
    (grpc.StatusCode.UNIMPLEMENTED, genai_client.GenAIClientError),
]


def ids(text: str) -> tuple[int, ...]:
    return tuple(ord(c) for c in text)


# --- sync client -------------------------------------------------------------------


def test_generate_returns_dataclasses(client: Client, fake: Fake) -> None:
    result = client.generate(
        "hello world",
        max_new_tokens=5,
        temperature=0.5,
        top_k=3,
        seed=7,
        stop_token_ids=[1, 2],
        priority="high",
        add_special_tokens=False,
        request_id="r-1",
    )
    assert result == GenerationResult(
        text="hello",
        token_ids=ids("hello"),
        finish_reason="MAX_TOKENS",
        usage=genai_client.Usage(prompt_tokens=11, completion_tokens=5, cached_tokens=1),
        seed=7,
        request_id="r-1",
    )
    sent = fake.state.requests[-1]
    assert sent.text == "hello world" and sent.request_id == "r-1"
    assert sent.sampling.temperature == 0.5 and sent.sampling.top_k == 3
    assert not sent.sampling.HasField("top_p")  # unset stays unset
    assert list(sent.stopping.stop_token_ids) == [1, 2]
    assert sent.priority == common_pb2.PRIORITY_HIGH
    assert sent.HasField("add_special_tokens") and not sent.add_special_tokens
    assert not sent.HasField("skip_special_tokens")


def test_generate_inputs_stops_and_logprobs(client: Client, fake: Fake) -> None:
    result = client.generate(token_ids=list(ids("abc. def")), stop=".", top_logprobs=2)
    assert (result.text, result.finish_reason, result.stop_sequence) == (
        "abc",
        "STOP_SEQUENCE",
        ".",
    )
    assert result.seed == SEED and result.session_id is None
    assert [lp.token_id for lp in result.logprobs] == list(ids("abc"))
    assert len(result.logprobs[0].top) == 2 and result.logprobs[0].top[0].logprob == -0.5
    chat = client.generate(
        messages=[
            ("system", "s"),
            {"role": "user", "content": "hi"},
            genai_client.ChatMessage("assistant", "yo"),
        ]
    )
    assert chat.text == "system:s|user:hi|assistant:yo|"
    with pytest.raises(ValueError, match="exactly one"):
        client.generate("a", token_ids=[1])
    with pytest.raises(ValueError, match="priority"):
        client.generate("a", priority="urgent")


def test_stream_deltas_concatenate(client: Client) -> None:
    stream = client.stream("streaming!", stop=["!"], include_stop_sequence=True)
    deltas = list(stream)
    assert all(isinstance(d, Delta) for d in deltas) and len(deltas) == 10
    assert "".join(d.text for d in deltas) == stream.result.text == "streaming!"
    assert tuple(t for d in deltas for t in d.token_ids) == stream.result.token_ids
    assert stream.result.finish_reason == "STOP_SEQUENCE"
    assert client.stream("collect me").collect().text == "collect me"
    with pytest.raises(RuntimeError):
        _ = client.stream("not consumed").result


def test_stream_cancel(client: Client) -> None:
    with pytest.raises(genai_client.CancelledError), client.stream("slow" + "x" * 200) as stream:
        for _ in stream:
            stream.cancel()


def test_bidi_two_requests_and_cancel(client: Client) -> None:
    with client.bidi() as bidi:
        fast = bidi.start("hello", request_id="fast")
        slow = bidi.start("slow" + "x" * 200, max_new_tokens=150)
        failing = bidi.start("!RESOURCE_EXHAUSTED")
        assert fast == "fast" and len(slow) == 32
        events = []
        for event in bidi:
            events.append(event)
            if event.request_id == slow and event.delta is not None and len(events) < 50:
                bidi.cancel(slow)
        assert bidi.pending == []
    by_id: dict[str, list[genai_client.BidiEvent]] = {}
    for event in events:
        by_id.setdefault(event.request_id, []).append(event)
    assert set(by_id) == {fast, slow, failing}
    for rid, evs in by_id.items():  # deltas, then exactly one terminal event
        assert [e.done for e in evs] == [False] * (len(evs) - 1) + [True], rid
    fast_result = by_id[fast][-1].result
    assert fast_result is not None
    assert (fast_result.text, fast_result.finish_reason) == ("hello", "EOS_TOKEN")
    slow_result = by_id[slow][-1].result
    assert slow_result is not None and slow_result.finish_reason == "CANCELLED"
    assert 0 < len(slow_result.token_ids) < 150
    assert slow_result.text == "".join(e.delta.text for e in by_id[slow][:-1] if e.delta)
    assert isinstance(by_id[failing][-1].error, genai_client.ResourceExhaustedError)


def test_bidi_results_and_reuse(client: Client) -> None:
    with client.bidi() as bidi:
        first = bidi.start("one")
        assert bidi.results()[first].text == "one"  # type: ignore[union-attr]
        second = bidi.start(token_ids=list(ids("two")))
        results = bidi.results()
    assert set(results) == {second} and results[second].text == "two"  # type: ignore[union-attr]


def test_session_context_manager(client: Client, fake: Fake) -> None:
    with client.session(idle_ttl_seconds=60, metadata={"user": "ada"}) as session:
        sid = session.id
        assert sid in fake.state.sessions
        first = session.generate("hi")
        assert (first.session_id, first.session_tokens) == (sid, 4)
        second = session.stream(messages=[("user", "x")]).collect()
        assert second.session_tokens == 4 + 2 * len("user:x|")
        info = session.info()
        assert isinstance(info, SessionInfo)
        assert (info.turns, info.history_tokens, info.idle_ttl_seconds) == (2, 18, 60)
        assert info.metadata == {"user": "ada"} and info.created_at.tzinfo is not None
        assert sid in [s.session_id for s in client.list_sessions()]
        assert session.reset().history_tokens == 0
    assert sid not in fake.state.sessions
    with pytest.raises(genai_client.NotFoundError):
        client.get_session(sid)
    with pytest.raises(genai_client.NotFoundError):
        client.generate("x", session_id=sid)


def test_attached_session_stays_open(client: Client, fake: Fake) -> None:
    created = client.create_session()
    with client.session(created.session_id) as session:
        session.generate("a")
    assert created.session_id in fake.state.sessions
    client.close_session(created.session_id)
    with pytest.raises(genai_client.NotFoundError):
        client.close_session(created.session_id)


@pytest.mark.parametrize(("code", "exc_type"), CODES, ids=[c.name for c, _ in CODES])
def test_status_codes_map_to_exceptions(
    client: Client, code: grpc.StatusCode, exc_type: type[GenAIClientError]
) -> None:
    with pytest.raises(exc_type) as caught:
        client.generate(f"!{code.name}")
    assert type(caught.value) is exc_type
    assert caught.value.code == code and caught.value.details == f"fake {code.name}"
    with pytest.raises(exc_type):
        list(client.stream(f"!{code.name}"))


def test_client_deadline(client: Client) -> None:
    with pytest.raises(genai_client.DeadlineExceededError):
        client.generate("slow" + "x" * 100, timeout=0.05)


def test_bearer_token_sent(fake: Fake) -> None:
    with Client(fake.target, token=TOKEN, timeout=10) as c:
        c.generate("a")
        assert fake.state.auth[-1] == f"Bearer {TOKEN}"
        list(c.stream("a"))
        assert fake.state.auth[-1] == f"Bearer {TOKEN}"
        c.create_session()
        assert fake.state.auth[-1] == f"Bearer {TOKEN}"
    with Client(fake.target, timeout=10) as c:
        c.generate("a")
        assert fake.state.auth[-1] is None


def test_session_id_sent_as_routing_header(fake: Fake) -> None:
    """Every call that names a session carries it as x-session-id metadata
    too (docs/design.md, "Routing a session's turns"); the others do not."""
    with Client(fake.target, timeout=10) as c:
        c.generate("a")
        assert fake.state.session_headers[-1] is None
        with c.session() as chat:
            assert fake.state.session_headers[-1] is None  # CreateSession names none
            chat.generate("turn one")
            assert fake.state.session_headers[-1] == chat.id
            list(chat.stream("turn two"))
            assert fake.state.session_headers[-1] == chat.id
            c.get_session(chat.id)
            assert fake.state.session_headers[-1] == chat.id
            session_id = chat.id
        assert fake.state.session_headers[-1] == session_id  # CloseSession


def test_a_session_id_that_cannot_be_a_header_is_left_to_the_server(fake: Fake) -> None:
    """Not printable ASCII: no x-session-id (gRPC would refuse the metadata in
    the client, as INTERNAL); the server answers such an id itself."""
    with Client(fake.target, timeout=10) as c:
        with pytest.raises(genai_client.NotFoundError):
            c.generate("a", session_id="sessi\u00f3n\n")
        assert fake.state.session_headers[-1] is None


@pytest.mark.asyncio
async def test_async_session_id_sent_as_routing_header(fake: Fake) -> None:
    async with AsyncClient(fake.target, timeout=10) as c, c.session() as chat:
        await chat.generate("turn one")
        assert fake.state.session_headers[-1] == chat.id
        await chat.stream("turn two").collect()
        assert fake.state.session_headers[-1] == chat.id


def test_model_service(client: Client) -> None:
    info = client.model_info()
    assert (info.model_id, info.runner_kind, info.kv_layout.dtype) == (
        "echo",
        "SHARED_BUFFER",
        "float16",
    )
    assert info.eos_token_ids == (0,) and info.kv_chunk_size == 16
    tokens = client.tokenize("héllo")
    assert [t.id for t in tokens] == list(ids("héllo"))
    assert (tokens[1].text, tokens[1].char_start, tokens[1].char_end) == ("é", 1, 2)
    assert client.detokenize(list(ids("héllo"))) == "héllo"


def test_unreachable_server_is_unavailable() -> None:
    with (
        socket_free_port() as port,
        Client(f"127.0.0.1:{port}", timeout=2) as c,
        pytest.raises(genai_client.UnavailableError),
    ):
        c.generate("a")


class socket_free_port:  # noqa: N801 - used as a context manager
    """A port with nothing listening on it (bound, never listened)."""

    def __enter__(self) -> int:
        import socket

        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        return int(self._sock.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        self._sock.close()


# --- async client -------------------------------------------------------------------


@pytest.mark.asyncio
async def test_async_generate_and_stream(fake: Fake) -> None:
    async with AsyncClient(fake.target, token=TOKEN, timeout=10) as c:
        result = await c.generate("async!", max_new_tokens=5)
        assert (result.text, result.finish_reason) == ("async", "MAX_TOKENS")
        assert fake.state.auth[-1] == f"Bearer {TOKEN}"
        stream = c.stream("deltas", top_logprobs=1)
        deltas = [d async for d in stream]
        assert "".join(d.text for d in deltas) == stream.result.text == "deltas"
        assert [lp.token_id for d in deltas for lp in d.logprobs] == list(ids("deltas"))
        assert (await c.stream("again").collect()).token_ids == ids("again")


@pytest.mark.asyncio
async def test_async_stream_cancel(fake: Fake) -> None:
    async with AsyncClient(fake.target, timeout=10) as c:
        with pytest.raises(genai_client.CancelledError):
            async with c.stream("slow" + "x" * 200) as stream:
                async for _ in stream:
                    stream.cancel()


@pytest.mark.asyncio
async def test_async_bidi_two_requests_and_cancel(fake: Fake) -> None:
    async with AsyncClient(fake.target, timeout=10) as c, c.bidi() as bidi:
        fast = await bidi.start("hello")
        slow = await bidi.start("slow" + "x" * 200)
        results: dict[str, GenerationResult] = {}
        async for event in bidi:
            if event.request_id == slow and event.delta is not None:
                await bidi.cancel(slow)
            if event.result is not None:
                results[event.request_id] = event.result
        assert results[fast].text == "hello"
        assert results[slow].finish_reason == "CANCELLED"
        assert 0 < len(results[slow].token_ids) < 204
        failing = await bidi.start("!NOT_FOUND")
        outcome = await bidi.results()
        assert isinstance(outcome[failing], genai_client.NotFoundError)


@pytest.mark.asyncio
async def test_async_session_context_manager(fake: Fake) -> None:
    async with AsyncClient(fake.target, timeout=10) as c:
        async with c.session(metadata={"k": "v"}) as session:
            sid = session.id
            turn = await session.generate("hey")
            assert (turn.session_id, turn.session_tokens) == (sid, 6)
            streamed = await session.stream("yo").collect()
            assert streamed.session_tokens == 10
            assert (await session.info()).turns == 2
            assert (await session.reset()).turns == 0
        assert sid not in fake.state.sessions
        with pytest.raises(genai_client.NotFoundError):
            await c.get_session(sid)
        awaited = await c.session()
        assert awaited.id in fake.state.sessions
        await awaited.close()
        assert awaited.id not in fake.state.sessions


@pytest.mark.asyncio
@pytest.mark.parametrize(("code", "exc_type"), CODES, ids=[c.name for c, _ in CODES])
async def test_async_status_codes_map_to_exceptions(
    fake: Fake, code: grpc.StatusCode, exc_type: type[GenAIClientError]
) -> None:
    async with AsyncClient(fake.target, timeout=10) as c:
        with pytest.raises(exc_type) as caught:
            await c.generate(f"!{code.name}")
        assert type(caught.value) is exc_type and caught.value.code == code
        with pytest.raises(exc_type):
            await c.stream(f"!{code.name}").collect()


@pytest.mark.asyncio
async def test_async_model_service(fake: Fake) -> None:
    async with AsyncClient(fake.target, timeout=10) as c:
        assert (await c.model_info()).context_length == 2048
        assert [t.id for t in await c.tokenize("ab")] == [97, 98]
        assert await c.detokenize([97, 98]) == "ab"


# --- CLI ------------------------------------------------------------------------------


def test_cli_generate_json(fake: Fake, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli_main(
        [
            "--target",
            fake.target,
            "--token",
            TOKEN,
            "generate",
            "hello there",
            "--max-new-tokens",
            "5",
            "--temperature",
            "0.7",
            "--stop",
            "zz",
            "--stop",
            "q",
            "--seed",
            "9",
            "--top-logprobs",
            "1",
            "--json",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    response = json_format.Parse(out, generate_pb2.GenerateResponse())
    assert response.text == "hello" and list(response.token_ids) == list(ids("hello"))
    assert response.finish_reason == common_pb2.FINISH_REASON_MAX_TOKENS
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (11, 5)
    assert response.seed == 9 and len(response.logprobs) == 5
    assert json.loads(out)["finishReason"] == "FINISH_REASON_MAX_TOKENS"
    sent = fake.state.requests[-1]
    assert list(sent.stopping.stop_sequences) == ["zz", "q"]
    assert abs(sent.sampling.temperature - 0.7) < 1e-6
    assert fake.state.auth[-1] == f"Bearer {TOKEN}"


def test_cli_generate_streams_text(fake: Fake, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["--target", fake.target, "generate", "streamed text"]) == 0
    assert capsys.readouterr().out == "streamed text\n"
    assert cli_main(["--target", fake.target, "generate", "--token-ids", "104,105"]) == 0
    assert capsys.readouterr().out == "hi\n"


def test_cli_error_exit_code(fake: Fake, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["--target", fake.target, "generate", "!RESOURCE_EXHAUSTED"]) == 1
    assert "RESOURCE_EXHAUSTED: fake RESOURCE_EXHAUSTED" in capsys.readouterr().err
    assert cli_main(["--target", fake.target, "generate", "!INVALID_ARGUMENT", "--json"]) == 1
    assert cli_main(["--target", fake.target, "session", "get", "nope"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def test_cli_session_info_tokenize(fake: Fake, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--target", fake.target]
    assert (
        cli_main([*base, "session", "create", "--idle-ttl-seconds", "30", "--metadata", "a=b"]) == 0
    )
    created = json.loads(capsys.readouterr().out)
    sid = created["session_id"]
    assert created["idle_ttl_seconds"] == 30 and created["metadata"] == {"a": "b"}
    assert cli_main([*base, "session", "list"]) == 0
    assert sid in [s["session_id"] for s in json.loads(capsys.readouterr().out)]
    assert cli_main([*base, "generate", "turn", "--session", sid]) == 0
    assert capsys.readouterr().out == "turn\n"
    assert cli_main([*base, "session", "get", sid]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["session_id"], got["turns"], got["history_tokens"]) == (sid, 1, 8)
    assert cli_main([*base, "session", "reset", sid]) == 0
    assert json.loads(capsys.readouterr().out)["history_tokens"] == 0
    assert cli_main([*base, "session", "close", sid]) == 0
    assert sid not in fake.state.sessions
    assert cli_main([*base, "info"]) == 0
    assert json.loads(capsys.readouterr().out)["runner_kind"] == "SHARED_BUFFER"
    assert cli_main([*base, "tokenize", "ab"]) == 0
    assert capsys.readouterr().out == '97\t"a"\n98\t"b"\n'
    assert cli_main([*base, "detokenize", "97,98"]) == 0
    assert capsys.readouterr().out == "ab\n"


def test_cli_chat(
    fake: Fake, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n\n/reset\nyo\n/exit\nnever\n"))
    before = set(fake.state.sessions)
    assert cli_main(["--target", fake.target, "chat", "--system", "S"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "system:S|user:hi|\nsystem:S|user:yo|\n"  # system again after reset
    assert captured.err.count("tokens/s") == 2 and "(history cleared)" in captured.err
    assert set(fake.state.sessions) == before  # the chat's session was closed


def test_the_decoding_surface_reaches_the_wire_from_the_client_and_the_cli(
    client: Client, fake: Fake, capsys: pytest.CaptureFixture[str]
) -> None:
    client.generate(
        "x",
        typical_p=0.9,
        top_a=0.2,
        xtc_threshold=0.1,
        xtc_probability=0.5,
        dry_multiplier=0.8,
        dry_base=1.75,
        dry_allowed_length=2,
        dry_penalty_last_n=64,
        dry_sequence_breakers=["\n", ":"],
        mirostat=2,
        mirostat_tau=5.0,
        mirostat_eta=0.1,
        repetition_penalty_last_n=32,
        logit_bias={42: -100, 7: 2.5},
        banned_token_ids=[1, 2],
        allowed_token_ids=[3, 4, 5],
        bad_words=["foo bar"],
    )
    s = fake.state.requests[-1].sampling
    assert (s.mirostat, s.dry_allowed_length, s.dry_penalty_last_n) == (2, 2, 64)
    assert s.repetition_penalty_last_n == 32
    assert abs(s.typical_p - 0.9) < 1e-6 and abs(s.xtc_probability - 0.5) < 1e-6
    assert dict(s.logit_bias) == {42: -100.0, 7: 2.5}
    assert list(s.dry_sequence_breakers) == ["\n", ":"]
    assert (list(s.banned_token_ids), list(s.allowed_token_ids)) == ([1, 2], [3, 4, 5])
    assert list(s.bad_words) == ["foo bar"]
    argv = ["--target", fake.target, "generate", "hi", "--typical-p", "0.8", "--mirostat", "2"]
    argv += ["--logit-bias", "42:-100", "--logit-bias", "9:1.5", "--bad-word", "no"]
    argv += ["--dry-multiplier", "0.5", "--dry-sequence-breaker", "|", "--banned-token-ids", "3,4"]
    assert cli_main(argv) == 0
    capsys.readouterr()
    s = fake.state.requests[-1].sampling
    assert dict(s.logit_bias) == {42: -100.0, 9: 1.5} and s.mirostat == 2
    assert list(s.bad_words) == ["no"] and list(s.dry_sequence_breakers) == ["|"]
    assert list(s.banned_token_ids) == [3, 4] and abs(s.dry_multiplier - 0.5) < 1e-6
    with pytest.raises(SystemExit):
        cli_main(["--target", fake.target, "generate", "hi", "--logit-bias", "42"])


def test_chat_template_kwargs_go_with_the_messages(client: Client, fake: Fake) -> None:
    client.generate(
        messages=[("user", "hi")], max_new_tokens=2, chat_template_kwargs={"enable_thinking": False}
    )
    sent = fake.state.requests[-1]
    assert sent.WhichOneof("input") == "messages"
    assert json.loads(sent.chat_template_kwargs) == {"enable_thinking": False}
    client.generate("plain", max_new_tokens=2)
    sent = fake.state.requests[-1]
    assert sent.WhichOneof("input") == "text" and sent.chat_template_kwargs == ""
