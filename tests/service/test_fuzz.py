"""Hostile input against live servers: undecodable messages, fuzzed requests, fuzzed kvstore frames.

Every answer is a deliberate status code: never INTERNAL or UNKNOWN (a bug or a
crash), never a hang (every call has a deadline), and the server still serves after.
Examples are bounded and derandomized, so a run is fast on 2 cores and the same
on every machine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from genai_proto.genai.v1 import (
    common_pb2,
    generate_pb2,
    generate_pb2_grpc,
    model_pb2,
    session_pb2,
    session_pb2_grpc,
)
from genai_proto.kvstore.v1 import kvstore_pb2
from genai_service.config import CacheConfig, EngineConfig, ServerConfig
from kvstore.checksum import checksum
from kvstore.protocol import CHANNEL_OPTIONS, SERVICE_NAME
from tests.kvstore_harness import DATA_PLANE_TOKEN, KvStoreProcess
from tests.server_harness import ServerThread, free_port
from tests.tiny_model import VOCAB_SIZE

pytestmark = pytest.mark.e2e

# What the kvstore requires on every KvStore RPC (the data plane is closed by default).
KV_AUTH = (("authorization", f"Bearer {DATA_PLANE_TOKEN}"),)

DEADLINE_S = 30.0  # per call: far above any honest answer here; hitting it is a hang
# Codes that mean the server failed, not the request: a bug (INTERNAL, UNKNOWN),
# a hang (DEADLINE_EXCEEDED), a crashed engine (UNAVAILABLE), a dropped call (CANCELLED).
FAILURES = {
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
}
FAILURE_VALUES = {code.value[0] for code in FAILURES}  # as in a bidi ErrorStatus.code

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,  # the same examples on every run and machine
    database=None,  # nothing written to .hypothesis/
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
GENAI_SERVICES = (generate_pb2, session_pb2, model_pb2)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerThread]:
    srv = ServerThread(
        ServerConfig(
            engine=EngineConfig(model_dir=str(tiny_model_dir), cache=CacheConfig(chunk_size=4)),
            port=free_port(),
            max_input_chars=20_000,  # so a huge text meets the limit without a slow tokenize
        )
    ).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def channel(server: ServerThread) -> Iterator[grpc.Channel]:
    with server.channel() as ch:
        yield ch


@pytest.fixture(scope="module")
def kvstore() -> Iterator[KvStoreProcess]:
    kv = KvStoreProcess("--log-format", "console", "--max-blob-bytes", "1MiB").start()
    yield kv
    kv.stop()


@pytest.fixture(scope="module")
def session_id(channel: grpc.Channel) -> str:
    """A real session, so some fuzzed requests are turns (until its context is full)."""
    sessions = session_pb2_grpc.SessionServiceStub(channel)
    created = sessions.CreateSession(session_pb2.CreateSessionRequest(), timeout=DEADLINE_S)
    return str(created.session.session_id)


def methods(*modules: Any) -> list[tuple[str, Any]]:
    """(full method path, method descriptor) of every RPC the modules' services define."""
    return [
        (f"/{service.full_name}/{method.name}", method)
        for module in modules
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    ]


def raw_call(
    channel: grpc.Channel,
    method: Any,
    path: str,
    payloads: list[bytes],
    metadata: tuple[tuple[str, str], ...] | None = None,
) -> list[bytes]:
    """Send ``payloads`` as the request message(s) of ``path``, unserialized."""
    opts: dict[str, Any] = {"timeout": DEADLINE_S, "metadata": metadata}
    if method.client_streaming and method.server_streaming:
        return list(channel.stream_stream(path)(iter(payloads), **opts))
    if method.client_streaming:
        return [channel.stream_unary(path)(iter(payloads), **opts)]
    if method.server_streaming:
        return list(channel.unary_stream(path)(payloads[0], **opts))
    return [channel.unary_unary(path)(payloads[0], **opts)]


def with_bad_utf8(message: Any, marker: str) -> bytes:
    """``message`` serialized, with the string ``marker`` replaced by as many bytes of bad UTF-8."""
    raw = message.SerializeToString()
    assert raw.count(marker.encode()) == 1
    return raw.replace(marker.encode(), b"\xff\xfe" + b"!" * (len(marker) - 2))


def assert_serving(channel: grpc.Channel) -> None:
    status = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(), timeout=DEADLINE_S
    )
    assert status.status == health_pb2.HealthCheckResponse.SERVING


# --- undecodable messages -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "method"), methods(*GENAI_SERVICES), ids=[p for p, _ in methods(*GENAI_SERVICES)]
)
def test_corrupt_wire_bytes_are_invalid_argument_on_every_rpc(
    channel: grpc.Channel, path: str, method: Any
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        raw_call(channel, method, path, [b"\xff\xff\xff"])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == (
        f"request is not a valid {method.input_type.full_name}: wire format was corrupt"
    )


BAD_UTF8 = {
    "text": generate_pb2.GenerateRequest(text="MARKER-0123"),
    "stop sequence": generate_pb2.GenerateRequest(
        text="hello", stopping=generate_pb2.StoppingCriteria(stop_sequences=["MARKER-0123"])
    ),
    "chat role": generate_pb2.GenerateRequest(
        messages=common_pb2.Messages(
            messages=[common_pb2.ChatMessage(role="MARKER-0123", content="hi")]
        )
    ),
}


@pytest.mark.parametrize("field", BAD_UTF8)
@pytest.mark.parametrize("rpc", ["Generate", "GenerateStream"])
def test_invalid_utf8_is_invalid_argument(channel: grpc.Channel, field: str, rpc: str) -> None:
    method = generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].methods_by_name[rpc]
    payload = with_bad_utf8(BAD_UTF8[field], "MARKER-0123")
    with pytest.raises(grpc.RpcError) as err:
        raw_call(channel, method, f"/genai.v1.GenerateService/{rpc}", [payload])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == (
        "request is not a valid genai.v1.GenerateRequest: string field had bad UTF-8"
    )


def test_a_bad_message_mid_bidi_ends_the_call_invalid_argument(channel: grpc.Channel) -> None:
    start = generate_pb2.BidiRequest(
        start=generate_pb2.GenerateRequest(
            request_id="a",
            text="the cat",
            stopping=generate_pb2.StoppingCriteria(max_new_tokens=100, ignore_eos=True),
        )
    )
    bad = with_bad_utf8(
        generate_pb2.BidiRequest(start=generate_pb2.GenerateRequest(request_id="b", text="XXXXXX")),
        "XXXXXX",
    )
    streaming, done = threading.Event(), threading.Event()

    def messages() -> Iterator[bytes]:
        yield start.SerializeToString()
        streaming.wait(DEADLINE_S)
        yield bad
        done.wait(DEADLINE_S)  # the client keeps the call open: the server ends it

    call = channel.stream_stream("/genai.v1.GenerateService/GenerateBidi")(
        messages(), timeout=DEADLINE_S
    )
    with pytest.raises(grpc.RpcError) as err:
        for _ in call:
            streaming.set()
    done.set()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == (
        "request is not a valid genai.v1.BidiRequest: string field had bad UTF-8"
    )
    assert_serving(channel)


# --- fuzzed GenerateRequests ----------------------------------------------------------------

UINT32 = st.integers(0, 2**32 - 1)
FLOAT32 = st.floats(width=32)  # nan, ±inf, subnormals, huge


def maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), strategy)


TEXT = st.text(min_size=1, max_size=40)
WILD_TEXT = st.sampled_from(["", " ", "a " * 2000, "x" * 30_000, "\x00" * 10, "😀" * 50])

# Each request draws a few of these fields to be wild (out of range, huge, empty,
# unknown); the others stay plausible, so most requests reach the engine.
FIELDS: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {
    "request_id": (st.text(min_size=1, max_size=20), st.just("")),
    "input": (st.sampled_from(["text", "token_ids", "messages"]), st.just("none")),
    "text": (TEXT, WILD_TEXT),
    "token_ids": (
        st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=40),
        st.lists(UINT32, max_size=200),
    ),
    "role": (st.sampled_from(["system", "user", "assistant"]), st.text(max_size=8)),
    "session_id": (st.just(""), st.sampled_from(["0" * 32, "x", "é" * 40])),  # see below
    "temperature": (maybe(st.floats(0, 2, width=32)), FLOAT32),
    "top_p": (maybe(st.floats(0.125, 1, width=32)), FLOAT32),
    "min_p": (maybe(st.floats(0, 1, width=32)), FLOAT32),
    "repetition_penalty": (maybe(st.floats(0.5, 2, width=32)), FLOAT32),
    "frequency_penalty": (maybe(st.floats(-2, 2, width=32)), FLOAT32),
    "presence_penalty": (maybe(st.floats(-2, 2, width=32)), FLOAT32),
    "top_k": (maybe(st.integers(0, 100)), UINT32),
    "seed": (maybe(st.integers(0, 2**64 - 1)), st.just(2**64 - 1)),
    "max_new_tokens": (maybe(st.integers(1, 20)), UINT32),
    "min_new_tokens": (st.integers(0, 5), UINT32),
    "stop_sequences": (
        st.lists(st.text(min_size=1, max_size=5), max_size=3),
        st.sampled_from([[""], ["a"] * 100, ["b" * 1000]]),
    ),
    "stop_token_ids": (
        st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=3),
        st.lists(UINT32, max_size=100),
    ),
    "time_limit_ms": (maybe(st.integers(1, 2000)), UINT32),
    "top_logprobs": (st.integers(0, 5), UINT32),
    "priority": (st.integers(0, 3), st.integers(-(2**31), 2**31 - 1)),
}
SAMPLING = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty")
SAMPLING += ("presence_penalty", "top_k", "seed")


@st.composite
def generate_requests(draw: st.DrawFn, session_id: str) -> generate_pb2.GenerateRequest:
    wild = set(draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=3)))

    def field(name: str) -> Any:
        valid, wild_values = FIELDS[name]
        return draw(wild_values if name in wild else valid)

    r = generate_pb2.GenerateRequest(request_id=field("request_id"))
    kind = field("input")
    if kind == "text":
        r.text = field("text")
    elif kind == "token_ids":
        r.token_ids.ids.extend(field("token_ids"))
    elif kind == "messages":
        for _ in range(draw(st.integers(1, 3))):
            r.messages.messages.add(role=field("role"), content=field("text"))
    # Plausible: no session, or a turn of the real one (until its context is full).
    r.session_id = (
        field("session_id") if "session_id" in wild else draw(st.sampled_from(["", session_id]))
    )
    for name in SAMPLING:
        if (value := field(name)) is not None:
            setattr(r.sampling, name, value)
    for name in ("max_new_tokens", "min_new_tokens", "time_limit_ms"):
        if (value := field(name)) is not None:
            setattr(r.stopping, name, value)
    r.stopping.stop_sequences.extend(field("stop_sequences"))
    r.stopping.stop_token_ids.extend(field("stop_token_ids"))
    r.stopping.ignore_eos = draw(st.booleans())
    r.stopping.include_stop_sequence = draw(st.booleans())
    r.top_logprobs = field("top_logprobs")
    r.priority = field("priority")
    for name in ("add_special_tokens", "skip_special_tokens"):
        if (value := draw(maybe(st.booleans()))) is not None:
            setattr(r, name, value)
    return r


def check_call(fn: Any, *args: Any, **kw: Any) -> list[Any]:
    try:
        result = fn(*args, timeout=DEADLINE_S, **kw)
        return list(result) if hasattr(result, "__next__") else [result]
    except grpc.RpcError as err:
        assert err.code() not in FAILURES, (err.code(), err.details())
        return []


@FUZZ
@given(
    data=st.data(),
    rpc=st.sampled_from(["Generate", "GenerateStream", "GenerateBidi"]),
    cancel=st.booleans(),
)
def test_fuzzed_requests_get_deliberate_answers(
    channel: grpc.Channel, session_id: str, data: st.DataObject, rpc: str, cancel: bool
) -> None:
    request = data.draw(generate_requests(session_id))
    stub = generate_pb2_grpc.GenerateServiceStub(channel)
    if rpc != "GenerateBidi":
        check_call(getattr(stub, rpc), request)
        return
    messages = [generate_pb2.BidiRequest(start=request)]
    if cancel:
        messages.append(
            generate_pb2.BidiRequest(
                cancel=generate_pb2.CancelRequest(request_id=request.request_id)
            )
        )
    for event in check_call(stub.GenerateBidi, iter(messages)):
        if event.HasField("error"):
            assert event.error.code not in FAILURE_VALUES, event.error


def mutations(valid: bytes) -> st.SearchStrategy[bytes]:
    """Random bytes, and ``valid`` with bytes flipped, cut short or spliced with junk."""
    positions = st.integers(0, max(0, len(valid) - 1))
    return st.one_of(
        st.binary(max_size=200),
        st.builds(
            lambda i, b: valid[:i] + bytes([b]) + valid[i + 1 :], positions, st.integers(0, 255)
        ),
        st.builds(lambda i: valid[:i], positions),
        st.builds(lambda i, junk: valid[:i] + junk + valid[i:], positions, st.binary(max_size=20)),
    )


VALID = generate_pb2.GenerateRequest(
    request_id="fuzz",
    text="the cat sat",
    stopping=generate_pb2.StoppingCriteria(max_new_tokens=3, stop_sequences=["mat"]),
    sampling=generate_pb2.SamplingParams(temperature=0.5, seed=7),
).SerializeToString()
PATHS = {
    rpc: (f"/genai.v1.GenerateService/{rpc}", method)
    for rpc, method in generate_pb2.DESCRIPTOR.services_by_name[
        "GenerateService"
    ].methods_by_name.items()
}


@FUZZ
@given(payload=mutations(VALID), rpc=st.sampled_from(sorted(PATHS)))
def test_fuzzed_wire_bytes_get_deliberate_answers(
    channel: grpc.Channel, payload: bytes, rpc: str
) -> None:
    path, method = PATHS[rpc]
    if method.client_streaming:  # a BidiRequest whose `start` is the mutated request
        payload = b"\x0a" + _varint(len(payload)) + payload
    try:
        replies = raw_call(channel, method, path, [payload])
    except grpc.RpcError as err:
        assert err.code() not in FAILURES, (err.code(), err.details())
        return
    for raw in replies if method.client_streaming else ():
        event = generate_pb2.BidiResponse.FromString(raw)
        if event.HasField("error"):
            assert event.error.code not in FAILURE_VALUES, event.error


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def test_the_server_serves_after_the_fuzz(channel: grpc.Channel) -> None:
    # Runs after the fuzz tests above (file order): the engine survived them.
    assert_serving(channel)
    r = generate_pb2_grpc.GenerateServiceStub(channel).Generate(
        generate_pb2.GenerateRequest(
            text="hello", stopping=generate_pb2.StoppingCriteria(max_new_tokens=3, ignore_eos=True)
        ),
        timeout=DEADLINE_S,
    )
    assert len(r.token_ids) == 3
    sessions = session_pb2_grpc.SessionServiceStub(channel)
    assert sessions.CreateSession(session_pb2.CreateSessionRequest(), timeout=DEADLINE_S).session


# --- fuzzed kvstore frames ------------------------------------------------------------------

KEYS = st.one_of(
    st.binary(max_size=300), st.binary(min_size=16, max_size=16), st.sampled_from([b"", b"k"])
)


@st.composite
def put_streams(draw: st.DrawFn) -> list[bytes]:
    """A Put's frames: mostly plausible (a header, then data), with every part drawn wild."""
    frames: list[bytes] = []
    blob = draw(st.binary(max_size=3000))
    if draw(st.booleans()):
        size = draw(st.one_of(st.just(len(blob)), st.integers(0, 2**64 - 1)))
        digest = draw(
            st.one_of(st.just(checksum(blob)), st.binary(max_size=40), st.just(b"\x00" * 16))
        )
        header = kvstore_pb2.BlobHeader(
            key=draw(KEYS), total_size_bytes=size, checksum=digest, replace=draw(st.booleans())
        )
        frames.append(kvstore_pb2.PutRequest(header=header).SerializeToString())
    cut = draw(st.integers(0, len(blob)))
    for part in (blob[:cut], blob[cut:]):
        if part or draw(st.booleans()):
            frames.append(kvstore_pb2.PutRequest(data=part).SerializeToString())
    for _ in range(draw(st.integers(0, 2))):  # stray frames: junk, or a second header
        frames.insert(
            draw(st.integers(0, len(frames))),
            draw(
                st.one_of(
                    st.binary(max_size=50),
                    st.just(
                        kvstore_pb2.PutRequest(header=kvstore_pb2.BlobHeader()).SerializeToString()
                    ),
                )
            ),
        )
    return frames


@st.composite
def kvstore_calls(draw: st.DrawFn) -> tuple[str, list[bytes]]:
    rpc = draw(st.sampled_from(["Put", "Get", "Lookup", "Delete", "Stats", "raw"]))
    if rpc == "Put":
        return rpc, draw(put_streams())
    if rpc in ("Get", "Delete"):
        message = getattr(kvstore_pb2, f"{rpc}Request")(key=draw(KEYS))
        return rpc, [message.SerializeToString()]
    if rpc == "Lookup":
        keys = draw(st.one_of(st.lists(KEYS, max_size=10), st.just([b"k"] * 65537)))
        return rpc, [kvstore_pb2.LookupRequest(keys=keys).SerializeToString()]
    if rpc == "Stats":
        return rpc, [draw(st.binary(max_size=20))]
    return draw(st.sampled_from(["Put", "Get", "Lookup", "Delete"])), [
        draw(st.binary(max_size=100))
    ]


@pytest.mark.parametrize(
    ("path", "method"), methods(kvstore_pb2), ids=[p for p, _ in methods(kvstore_pb2)]
)
def test_corrupt_kvstore_messages_are_invalid_argument(
    kvstore: KvStoreProcess, path: str, method: Any
) -> None:
    payloads = [b"\xff\xff\xff"]
    if method.client_streaming:  # a good header, then a frame that does not decode
        header = kvstore_pb2.BlobHeader(
            key=b"k" * 16, total_size_bytes=3, checksum=checksum(b"abc")
        )
        payloads.insert(0, kvstore_pb2.PutRequest(header=header).SerializeToString())
    with grpc.insecure_channel(kvstore.target) as ch, pytest.raises(grpc.RpcError) as err:
        raw_call(ch, method, path, payloads, KV_AUTH)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == (
        f"request is not a valid {method.input_type.full_name}: wire format was corrupt"
    )


KV_METHODS = {
    method.name: (f"/{SERVICE_NAME}/{method.name}", method)
    for method in kvstore_pb2.DESCRIPTOR.services_by_name["KvStore"].methods
}


@FUZZ
@given(call=kvstore_calls())
def test_fuzzed_kvstore_frames_get_deliberate_answers(
    kvstore: KvStoreProcess, call: tuple[str, list[bytes]]
) -> None:
    rpc, payloads = call
    path, method = KV_METHODS[rpc]
    with grpc.insecure_channel(kvstore.target, options=list(CHANNEL_OPTIONS)) as ch:
        try:
            raw_call(ch, method, path, payloads or [b""], KV_AUTH)
        except grpc.RpcError as err:
            assert err.code() not in FAILURES, (err.code(), err.details())


def test_the_kvstore_serves_after_the_fuzz(kvstore: KvStoreProcess) -> None:
    from kvstore.client import KvStoreClient

    assert kvstore.proc is not None and kvstore.proc.poll() is None
    with KvStoreClient(kvstore.target, auth_token=DATA_PLANE_TOKEN) as client:
        key = checksum(b"after the fuzz")
        client.put(key, b"still here", replace=True)
        assert client.get(key) == b"still here"
    with grpc.insecure_channel(kvstore.target) as ch:
        deadline = time.monotonic() + DEADLINE_S
        assert_serving(ch)
        assert time.monotonic() < deadline
