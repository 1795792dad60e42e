"""KV chunks and sessions shared through the kvstore: exact tokens, honest cached_tokens, faults."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from genai_common.credentials import channel_credentials
from genai_common.errors import NotFound
from genai_service.config import CacheConfig, EngineConfig, KvStoreConfig, RunnerConfig
from genai_service.contract.request import GenerationRequest, StoppingCriteria
from genai_service.engine.engine import LLMEngine
from genai_service.engine.kv.kv_connector_memory import MemoryKvChunkStore
from kvstore.client import KvStoreClient
from tests.kvstore_harness import DATA_PLANE_TOKEN, KvStoreProcess
from tests.server_harness import free_port
from tests.tiny_model import encode_words, reference_greedy

pytestmark = pytest.mark.e2e

# Engines and servers that share KV through the kvstore trust each other: one secret.
SECRET = b"kvstore-reuse-tests-shared-integrity-secret"
PREFIX = encode_words("the cat sat on the mat and the dog sat in the box under a tree")  # 15
PROMPT = PREFIX + encode_words("with a red hat ?")


@pytest.fixture(scope="module")
def kvstore() -> Iterator[KvStoreProcess]:
    kv = KvStoreProcess("--log-format", "console").start()
    yield kv
    kv.stop()


def make_engine(model_dir: Path, target: str | None, runner: str = "auto", **kw) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model_dir=str(model_dir),
            runner=RunnerConfig(runner=runner),
            cache=CacheConfig(chunk_size=4),
            kvstore=(
                KvStoreConfig(
                    target,
                    timeout_s=kw.pop("timeout_s", 2.0),
                    auth_token=DATA_PLANE_TOKEN,
                    integrity_key=kw.pop("integrity_key", SECRET),
                )
                if target
                else None
            ),
        ),
        **kw,
    )


def greedy(rid: str, ids: list[int], n: int, **kw) -> GenerationRequest:
    return GenerationRequest(
        rid, tuple(ids), stopping=StoppingCriteria(max_new_tokens=n, ignore_eos=True), **kw
    )


@pytest.mark.parametrize(
    ("variant", "runner"), [("rope", "past_present"), ("gqa", "shared_buffer")]
)
def test_kv_from_the_store_gives_the_cold_tokens(
    tiny_models: dict[str, Path], kvstore: KvStoreProcess, variant: str, runner: str
) -> None:
    model_dir = tiny_models[variant]
    cold = reference_greedy(model_dir, PROMPT, 10)
    a = make_engine(model_dir, kvstore.target, runner)
    ra = a.generate(greedy(f"a-{variant}", PROMPT, 10))
    assert list(ra.token_ids) == cold and ra.usage.cached_tokens == 0
    assert a.remote is not None and a.remote.flush(10)
    a.close()
    # a second engine: empty in-process caches, same kvstore
    b = make_engine(model_dir, kvstore.target, runner)
    rb = b.generate(greedy(f"b-{variant}", PROMPT, 10))
    assert list(rb.token_ids) == cold
    assert (
        rb.usage.cached_tokens == (len(PROMPT) - 1) // 4 * 4
    )  # every complete chunk but the last token's
    assert b.counters["kvstore_cached_tokens"] == rb.usage.cached_tokens
    b.close()


def test_kv_round_trips_through_a_kvstore_on_mtls(tiny_model_dir: Path, pki: Path) -> None:
    """The data plane on TLS with client certificates, as the control plane can be:
    the engine's connector dials it with the CA and its certificate, and a second
    engine reuses the first one's chunks."""
    ca, cert, key = (str(pki / name) for name in ("ca.pem", "client.pem", "client.key"))
    tls = ("--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"))
    kv = KvStoreProcess(
        "--log-format", "console", *tls, "--tls-client-ca", ca,
        credentials=channel_credentials(ca, cert, key),
    ).start()  # fmt: skip
    config = kv.config(tls_ca_file=ca, tls_cert_file=cert, tls_key_file=key)
    try:
        cold = reference_greedy(tiny_model_dir, PROMPT, 6)
        engines = [
            LLMEngine(EngineConfig(str(tiny_model_dir), cache=CacheConfig(4), kvstore=config))
            for _ in range(2)
        ]
        first = engines[0].generate(greedy("tls-a", PROMPT, 6))
        assert engines[0].remote is not None and engines[0].remote.flush(10)
        second = engines[1].generate(greedy("tls-b", PROMPT, 6))
        assert list(first.token_ids) == list(second.token_ids) == cold
        reused = (len(PROMPT) - 1) // 4 * 4  # every complete chunk but the last token's
        assert (first.usage.cached_tokens, second.usage.cached_tokens) == (0, reused)
        for engine in engines:
            engine.close()
        # Without a client certificate, or in plain text, nothing gets through.
        for credentials in (channel_credentials(ca), None):
            with (
                KvStoreClient(kv.target, auth_token=kv.token, credentials=credentials) as client,
                pytest.raises(grpc.RpcError) as err,
            ):
                client.stats(timeout_s=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    finally:
        kv.stop()


def test_session_calls_answer_once_their_record_is_visible(
    tiny_model_dir: Path, kvstore: KvStoreProcess
) -> None:
    """Create, fork, rewind, reset and close answer only after the changed session's
    record has landed in the kvstore (as a turn's final output does), so the
    next call may go to any replica; another engine finds it at once."""
    a = make_engine(tiny_model_dir, kvstore.target)
    b = make_engine(tiny_model_dir, kvstore.target)
    assert a.remote is not None
    try:

        def visible(sid: str) -> bool:
            return not a.remote.record_pending(a.session_calls.record_key(sid))  # type: ignore[union-attr]

        sid = a.wait(a.create_session()).session_id
        assert visible(sid)
        a.generate(
            dataclasses.replace(
                greedy("t1", encode_words("hello , who are you ?"), 5), session_id=sid
            )
        )
        fork = a.wait(a.fork_session(sid)).session_id
        assert visible(fork)
        assert (
            b.wait(b.get_session(fork)).history_tokens == a.wait(a.get_session(sid)).history_tokens
        )
        assert a.wait(a.rewind_session(sid, turns=0)).history_tokens == 0
        assert visible(sid) and b.wait(b.get_session(sid)).history_tokens == 0
        a.wait(a.reset_session(fork))
        # (B's copy of the fork was vouched for by its GetSession just now: ask C)
        c = make_engine(tiny_model_dir, kvstore.target)
        try:
            assert visible(fork) and c.wait(c.get_session(fork)).turns == 0
            a.wait(a.close_session(sid))  # its record says closed, for every replica at once
            assert visible(sid)
            with pytest.raises(NotFound):
                c.wait(c.get_session(sid))
        finally:
            c.close()
    finally:
        a.close()
        b.close()


def test_session_migrates_between_engines(tiny_model_dir: Path, kvstore: KvStoreProcess) -> None:
    t1 = encode_words("hello , who are you ?")
    t2 = encode_words("what is the time now ?")
    t3 = encode_words("and who am i ?")
    # reference: every turn on one engine without a kvstore
    ref = make_engine(tiny_model_dir, None)
    sid = ref.create_session().session_id
    r1 = ref.generate(dataclasses.replace(greedy("r1", t1, 7), session_id=sid))
    r2 = ref.generate(dataclasses.replace(greedy("r2", t2, 7), session_id=sid))
    r3 = ref.generate(dataclasses.replace(greedy("r3", t3, 7), session_id=sid))

    a = make_engine(tiny_model_dir, kvstore.target)
    b = make_engine(tiny_model_dir, kvstore.target)
    sid = a.wait(a.create_session()).session_id
    a1 = a.generate(dataclasses.replace(greedy("a1", t1, 7), session_id=sid))
    # The record lands before the answer; the history's chunks are pushed in the
    # background just after it. Wait for them so the reuse below is exact.
    assert a.remote is not None and a.remote.flush(10)
    b2 = b.generate(dataclasses.replace(greedy("b2", t2, 7), session_id=sid))
    assert a1.token_ids == r1.token_ids and b2.token_ids == r2.token_ids
    history = len(t1) + 7
    assert b2.usage.cached_tokens == history // 4 * 4  # the chunk chain came from the store
    assert b.wait(b.get_session(sid)).turns == 2
    # Back on A, whose memory still holds the session as it was after turn 1:
    # the newer record (B's turn) replaces that stale copy.
    assert b.remote is not None and b.remote.flush(10)
    a3 = a.generate(dataclasses.replace(greedy("a3", t3, 7), session_id=sid))
    assert a3.token_ids == r3.token_ids
    assert a.sessions.replaced == 1 and a.wait(a.get_session(sid)).turns == 3
    # closing on B removes the record: A cannot restore it after eviction either
    assert a.remote is not None and a.remote.flush(10)
    b.wait(b.close_session(sid))
    assert b.remote.flush(10)
    a.sessions.close(sid)  # evict from A's memory

    with pytest.raises(NotFound):
        a.wait(a.get_session(sid))
    a.close()
    b.close()


def test_evicted_session_is_restored_from_its_record(
    tiny_model_dir: Path, kvstore: KvStoreProcess
) -> None:
    eng = LLMEngine(
        EngineConfig(
            model_dir=str(tiny_model_dir),
            cache=CacheConfig(chunk_size=4),
            sessions=dataclasses.replace(EngineConfig("x").sessions, max_sessions=1),
            kvstore=kvstore.config(),
        )
    )
    first = eng.wait(eng.create_session()).session_id
    t1 = encode_words("the cat sat on the mat")
    r1 = eng.generate(dataclasses.replace(greedy("x1", t1, 5), session_id=first))
    second = eng.wait(
        eng.create_session()
    ).session_id  # table full: the idle first session is evicted
    assert eng.sessions.evicted == 1 and second in eng.sessions and first not in eng.sessions
    eng.remote.flush(10)  # type: ignore[union-attr]
    t2 = encode_words("and the dog ?")
    r2 = eng.generate(dataclasses.replace(greedy("x2", t2, 5), session_id=first))
    history = t1 + list(r1.token_ids)
    assert list(r2.token_ids) == reference_greedy(tiny_model_dir, history + t2, 5)
    assert r2.usage.cached_tokens == len(history) // 4 * 4
    eng.close()


def test_kvstore_down_or_slow_is_only_a_miss(tiny_model_dir: Path) -> None:
    cold = reference_greedy(tiny_model_dir, PROMPT, 8)
    down = make_engine(tiny_model_dir, f"127.0.0.1:{free_port()}", timeout_s=0.5)
    r = down.generate(greedy("down", PROMPT, 8))
    assert list(r.token_ids) == cold and r.usage.cached_tokens == 0
    down.close()
    # a slow store: the fetch times out, the request is computed cold
    store = MemoryKvChunkStore(dtype="float32", timeout_s=0.2)
    make_engine(tiny_model_dir, None, chunk_store=store).generate(greedy("seed", PROMPT, 2))
    store.delay_s = 0.5  # from now on every fetch outlasts the timeout
    slow = make_engine(tiny_model_dir, None, chunk_store=store)
    r = slow.generate(greedy("slow", PROMPT, 8))
    assert list(r.token_ids) == cold and r.usage.cached_tokens == 0
    assert store.stats()["timeouts"] >= 1
    # failing store
    failing = make_engine(
        tiny_model_dir, None, chunk_store=MemoryKvChunkStore(dtype="float32", fail=True)
    )
    r = failing.generate(greedy("fail", PROMPT, 8))
    assert list(r.token_ids) == cold and r.usage.cached_tokens == 0


def test_kvstore_stopped_mid_stream(tiny_model_dir: Path) -> None:
    kv = KvStoreProcess("--log-format", "console").start()
    eng = make_engine(tiny_model_dir, kv.target, timeout_s=0.5)
    prompt = encode_words("the old house was big and red and the tree was small")
    eng.add_request(greedy("m", prompt, 30))
    outs: list = []
    deadline = time.monotonic() + 30
    while not (outs and outs[-1].finished) and time.monotonic() < deadline:
        step = eng.step()
        if step and len(outs) < 3 <= len(outs) + len(step):
            kv.stop()  # after the first tokens streamed
        outs += step
        if eng.last_step_idle:
            time.sleep(0.001)  # waiting on the kvstore
    tokens = [t for o in outs for t in o.token_ids]
    assert tokens == reference_greedy(tiny_model_dir, prompt, 30)
    # the next request still works, and reuses only what is in memory
    r = eng.generate(greedy("n", prompt, 5))
    assert list(r.token_ids) == reference_greedy(tiny_model_dir, prompt, 5)
    eng.close()


def test_session_migrates_between_server_processes(
    long_context_model_dir: Path, kvstore: KvStoreProcess
) -> None:
    """Two genai-servers (each with its own engine process) sharing one kvstore."""

    from genai_proto.genai.v1 import (
        generate_pb2,
        generate_pb2_grpc,
        session_pb2,
        session_pb2_grpc,
    )
    from genai_service.config import ServerConfig
    from tests.server_harness import ServerThread

    def config() -> ServerConfig:
        return ServerConfig(
            engine=EngineConfig(
                model_dir=str(long_context_model_dir),
                cache=CacheConfig(chunk_size=4),
                kvstore=kvstore.config(integrity_key=SECRET),
            ),
            port=free_port(),
        )

    def turn(ch: grpc.Channel, sid: str, text: str) -> generate_pb2.GenerateResponse:
        return generate_pb2_grpc.GenerateServiceStub(ch).Generate(
            generate_pb2.GenerateRequest(
                text=text,
                session_id=sid,
                stopping=generate_pb2.StoppingCriteria(max_new_tokens=6, ignore_eos=True),
            )
        )

    servers = [ServerThread(config()).start(), ServerThread(config()).start()]
    try:
        with servers[0].channel() as a, servers[1].channel() as b:
            sessions_a = session_pb2_grpc.SessionServiceStub(a)
            # both turns on A
            ref = sessions_a.CreateSession(session_pb2.CreateSessionRequest()).session.session_id
            ref1, ref2 = turn(a, ref, "hello , who are you ?"), turn(a, ref, "what is my name ?")
            # turn 1 on A, turn 2 on B
            sid = sessions_a.CreateSession(session_pb2.CreateSessionRequest()).session.session_id
            t1, t2 = turn(a, sid, "hello , who are you ?"), turn(b, sid, "what is my name ?")
            assert list(t1.token_ids) == list(ref1.token_ids)
            assert list(t2.token_ids) == list(ref2.token_ids)
            assert t2.session_tokens == ref2.session_tokens
            assert t2.usage.cached_tokens > 0
    finally:
        for srv in servers:
            srv.stop()
