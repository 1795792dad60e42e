"""Sessions at the trust boundary, through a real server on a tiny model.

Any caller can send huge metadata or look up made-up session ids: metadata is
bounded before it reaches the engine, every ListSessions response is bounded
in bytes, and a stalled kvstore delays only the lookups that need it, never
another caller's stream (docs/design.md "Sessions").
"""

from __future__ import annotations

import os
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from genai_client.errors import from_rpc_error
from genai_proto.genai.v1 import (
    generate_pb2,
    generate_pb2_grpc,
    session_pb2,
    session_pb2_grpc,
)
from genai_service.config import (
    SESSION_LIST_PAGE_BYTES,
    CacheConfig,
    EngineConfig,
    LimitsConfig,
    ServerConfig,
    SessionConfig,
)
from genai_service.contract.sessions import SessionInfo
from genai_service.engine.sessions.sessions import Session, listed_bytes
from genai_service.server import convert
from tests.kvstore_harness import KvStoreProcess
from tests.server_harness import ServerThread, free_port
from tests.tiny_model import TinyModelSpec, build_tiny_model

pytestmark = pytest.mark.e2e

MAX_SESSIONS = 80  # enough sessions with the most metadata to fill more than a page


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerThread]:
    srv = ServerThread(
        ServerConfig(
            engine=EngineConfig(
                model_dir=str(tiny_model_dir),
                sessions=SessionConfig(max_sessions=MAX_SESSIONS),
            ),
            port=free_port(),
        )
    ).start()
    yield srv
    srv.stop()


@pytest.fixture()
def sessions(server: ServerThread) -> Iterator[session_pb2_grpc.SessionServiceStub]:
    with server.channel() as ch:
        stub = session_pb2_grpc.SessionServiceStub(ch)
        yield stub
        for s in list_all(stub):  # each test starts from an empty table
            stub.CloseSession(session_pb2.CloseSessionRequest(session_id=s.session_id))


def list_all(stub: session_pb2_grpc.SessionServiceStub) -> list[session_pb2.Session]:
    out, token = [], ""
    while True:
        page = stub.ListSessions(session_pb2.ListSessionsRequest(page_token=token))
        out += page.sessions
        token = page.next_page_token
        if not token:
            return out


def rpc_error(fn, request) -> grpc.RpcError:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as err:
        fn(request)
    return err.value


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        (
            {"user": "x" * 12_000_000},
            "metadata: the value of key 'user' is 12000000 bytes; at most 4096",
        ),
        ({f"k{i}": "" for i in range(100_000)}, "metadata: 100000 entries; at most 64 allowed"),
        ({"k" * 300: ""}, "is 300 bytes; at most 256 allowed"),
        ({f"k{i}": "v" * 4000 for i in range(5)}, "bytes of keys and values; at most 16384"),
    ],
    ids=["12MB-value", "100k-keys", "key", "total"],
)
def test_oversized_metadata_is_invalid_argument(
    sessions: session_pb2_grpc.SessionServiceStub, metadata: dict[str, str], message: str
) -> None:
    err = rpc_error(sessions.CreateSession, session_pb2.CreateSessionRequest(metadata=metadata))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.details()
    # The google.rpc.BadRequest names the field (it was empty for the value limit).
    assert [v.field for v in from_rpc_error(err).field_violations] == ["metadata"]
    assert list_all(sessions) == []  # nothing was created
    ok = sessions.CreateSession(session_pb2.CreateSessionRequest(metadata={"user": "ada"}))
    assert dict(ok.session.metadata) == {"user": "ada"}


def test_list_sessions_pages(sessions: session_pb2_grpc.SessionServiceStub) -> None:
    ids = [
        sessions.CreateSession(
            session_pb2.CreateSessionRequest(metadata={"n": str(i)})
        ).session.session_id
        for i in range(7)
    ]
    pages, token = [], ""
    while True:
        page = sessions.ListSessions(session_pb2.ListSessionsRequest(page_size=3, page_token=token))
        pages.append([s.session_id for s in page.sessions])
        token = page.next_page_token
        if not token:
            break
    assert pages == [ids[:3], ids[3:6], ids[6:]]  # oldest first, then the end
    everything = sessions.ListSessions(session_pb2.ListSessionsRequest())  # page_size 0: 50
    assert [s.session_id for s in everything.sessions] == ids and not everything.next_page_token
    err = rpc_error(sessions.ListSessions, session_pb2.ListSessionsRequest(page_size=-1))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "page_size: -1 is negative; allowed [0, 1000] (0: 50)"
    err = rpc_error(sessions.ListSessions, session_pb2.ListSessionsRequest(page_token="forged"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "page_token: 'forged' is not a next_page_token of ListSessions"


def test_every_list_response_fits_a_default_client(
    sessions: session_pb2_grpc.SessionServiceStub,
) -> None:
    """MAX_SESSIONS sessions with the most metadata the defaults allow (~1.3 MB
    together) list in pages of at most SESSION_LIST_PAGE_BYTES, far under the
    4 MiB a default client accepts; listed_bytes bounds each one's wire size."""
    limits = SessionConfig()
    biggest = {f"{i:02}" + "k" * 254: "v" * 4096 for i in range(3)}
    biggest["pad"] = "p" * (limits.max_metadata_bytes - 3 * (256 + 4096) - 3)
    for _ in range(MAX_SESSIONS):
        sessions.CreateSession(session_pb2.CreateSessionRequest(metadata=biggest))
    sizes, token, seen = [], "", 0
    while True:
        page = sessions.ListSessions(
            session_pb2.ListSessionsRequest(page_size=1000, page_token=token)
        )
        sizes.append(page.ByteSize())
        seen += len(page.sessions)
        token = page.next_page_token
        if not token:
            break
    assert seen == MAX_SESSIONS and len(sizes) == 2
    assert max(sizes) <= SESSION_LIST_PAGE_BYTES <= 4 * 1024 * 1024 // 4
    # the bound the pages are cut by is an upper bound of the real size, even
    # with the largest timestamps and counters
    proto, late = page.sessions[0], 4.0e9 + 0.999999
    session = Session(proto.session_id, late, late, 2.0**32 - 1, metadata=dict(proto.metadata))
    info = SessionInfo(
        proto.session_id, late, late, 2.0**32 - 1, 2**32 - 1, 2**32 - 1, True, session.metadata
    )
    assert convert.session(info).ByteSize() + 4 <= listed_bytes(session)


@pytest.fixture(scope="module")
def very_long_context_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """16,384 positions: a stream that outlasts several kvstore timeouts."""
    return build_tiny_model(tmp_path_factory.mktemp("vlong"), TinyModelSpec(max_seq_len=16384))


def test_a_stalled_kvstore_never_stalls_another_stream(very_long_context_model_dir: Path) -> None:
    """The kvstore stopped (SIGSTOP): GetSession for well-formed unknown ids
    each wait out --kvstore-timeout and end UNAVAILABLE (the store cannot say they
    do not exist: retry, not "no such session"), while a concurrent
    stream's deltas keep coming (worst gap < 100 ms: a correctness bound, ~20x
    the usual gap, not a speed target)."""
    timeout_s = 1.0
    kv = KvStoreProcess("--log-format", "console").start()
    srv: ServerThread | None = None
    assert kv.proc is not None
    stopped = False
    try:
        srv = ServerThread(
            ServerConfig(
                engine=EngineConfig(
                    model_dir=str(very_long_context_model_dir),
                    cache=CacheConfig(chunk_size=4),
                    limits=LimitsConfig(max_new_tokens_limit=16000),
                    kvstore=kv.config(timeout_s=timeout_s),
                ),
                port=free_port(),
            )
        ).start()
        with srv.channel() as ch:
            stub = generate_pb2_grpc.GenerateServiceStub(ch)
            sessions = session_pb2_grpc.SessionServiceStub(ch)
            stream = stub.GenerateStream(
                generate_pb2.GenerateRequest(
                    text="the cat sat on the mat",
                    stopping=generate_pb2.StoppingCriteria(max_new_tokens=16000, ignore_eos=True),
                )
            )
            arrivals: list[float] = []

            def consume() -> None:
                try:
                    for msg in stream:
                        if msg.HasField("delta"):
                            arrivals.append(time.monotonic())
                except grpc.RpcError:
                    pass  # cancelled below

            reader = threading.Thread(target=consume, daemon=True)
            reader.start()
            deadline = time.monotonic() + 30
            while len(arrivals) < 20 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(arrivals) >= 20, "the stream did not start"
            os.kill(kv.proc.pid, signal.SIGSTOP)
            stopped = True
            results: list[tuple[grpc.StatusCode, float]] = []

            def lookup() -> None:
                started = time.monotonic()
                try:
                    sessions.GetSession(
                        session_pb2.GetSessionRequest(session_id=secrets.token_hex(16)),
                        timeout=30,
                    )
                    code = grpc.StatusCode.OK
                except grpc.RpcError as err:
                    code = err.code()
                results.append((code, time.monotonic() - started))

            window_start = time.monotonic()
            for _ in range(2):  # two rounds of concurrent lookups
                lookups = [threading.Thread(target=lookup) for _ in range(3)]
                for t in lookups:
                    t.start()
                for t in lookups:
                    t.join(30)
            window_end = time.monotonic()
            time.sleep(0.1)
            still_streaming = bool(arrivals) and arrivals[-1] > window_end
            stream.cancel()
            reader.join(10)
        assert [code for code, _ in results] == [grpc.StatusCode.UNAVAILABLE] * 6
        assert all(elapsed >= timeout_s * 0.9 for _, elapsed in results)
        assert still_streaming, "the stream ended before the lookups did"
        during = [t for t in arrivals if window_start <= t <= window_end]
        gaps = [b - a for a, b in zip(during, during[1:], strict=False)]
        assert len(during) > 20 and max(gaps) < 0.1, f"worst gap {max(gaps):.3f}s"
    finally:
        if stopped:
            os.kill(kv.proc.pid, signal.SIGCONT)
        if srv is not None:
            srv.stop()
        kv.stop()
