"""Faults through the whole stack (server + engine process + kvstore process): an engine
killed between a session's turns, a kvstore whose blobs are corrupted, one that stalls,
one killed mid-stream. Every answer keeps the exact greedy tokens of a cold run.

(Engine death mid-stream and SIGTERM drains are in test_server.py; the kvstore
faults against an in-process engine are in test_kvstore_reuse.py.)
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from genai_proto.genai.v1 import (
    common_pb2,
    generate_pb2,
    generate_pb2_grpc,
    session_pb2,
    session_pb2_grpc,
)
from genai_service.config import CacheConfig, EngineConfig, ServerConfig
from kvstore.client import KvStoreClient
from kvstore.disk_tier import _HEADER
from tests.kvstore_harness import KvStoreProcess
from tests.server_harness import ServerThread, free_port
from tests.tiny_model import encode_words, reference_greedy

pytestmark = pytest.mark.e2e

CHUNK = 4
DEADLINE_S = 60.0


def start_server(model_dir: Path, kvstore: KvStoreProcess) -> ServerThread:
    return ServerThread(
        ServerConfig(
            engine=EngineConfig(
                model_dir=str(model_dir),
                cache=CacheConfig(chunk_size=CHUNK),
                kvstore=kvstore.config(timeout_s=0.5),
            ),
            port=free_port(),
        )
    ).start()


def greedy(ids: list[int], n: int, **kw: object) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=ids),
        stopping=generate_pb2.StoppingCriteria(max_new_tokens=n, ignore_eos=True),
        **kw,
    )


def wait_for(condition: object, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise TimeoutError(what)


def stored_entries(kvstore: KvStoreProcess) -> int:
    with KvStoreClient(kvstore.target, auth_token=kvstore.token) as client:
        return int(client.stats().memory.entries)


@pytest.fixture()
def kvstore(tmp_path: Path) -> Iterator[KvStoreProcess]:
    kv = KvStoreProcess("--log-format", "console", "--disk-dir", str(tmp_path / "kv")).start()
    yield kv
    if kv.proc is not None and kv.proc.poll() is None:
        kv.proc.send_signal(signal.SIGCONT)  # in case a test stopped it
    kv.stop()


def test_a_session_continues_exactly_after_the_engine_is_killed(
    tiny_model_dir: Path, kvstore: KvStoreProcess
) -> None:
    t1 = encode_words("hello , who are you ?")
    t2 = encode_words("what is the time now ?")
    srv = start_server(tiny_model_dir, kvstore)
    try:
        with srv.channel() as ch:
            stub = generate_pb2_grpc.GenerateServiceStub(ch)
            sessions = session_pb2_grpc.SessionServiceStub(ch)
            sid = sessions.CreateSession(session_pb2.CreateSessionRequest()).session.session_id
            r1 = stub.Generate(greedy(t1, 6, session_id=sid), timeout=DEADLINE_S)
            history = t1 + list(r1.token_ids)
            # the record lands before the answer; the history's chunks just after
            wait_for(
                lambda: stored_entries(kvstore) >= 1 + len(history) // CHUNK,
                "the session's chunks reach the kvstore",
            )
            assert srv.server is not None
            old_pid = srv.server.engine.pid
            srv.server.engine.kill()  # SIGKILL: the engine's session table is gone
            health = health_pb2_grpc.HealthStub(ch)
            wait_for(
                lambda: (
                    srv.server.engine.pid != old_pid
                    and srv.server.engine.ready
                    and health.Check(health_pb2.HealthCheckRequest()).status
                    == health_pb2.HealthCheckResponse.SERVING
                ),
                "the engine restarts",
                60,
            )
            r2 = stub.Generate(greedy(t2, 6, session_id=sid), timeout=DEADLINE_S)
        assert list(r1.token_ids) == reference_greedy(tiny_model_dir, t1, 6)
        assert list(r2.token_ids) == reference_greedy(tiny_model_dir, history + t2, 6)
        assert r2.session_tokens == len(history) + len(t2) + 6
        assert r2.usage.cached_tokens == len(history) // CHUNK * CHUNK  # from the kvstore
    finally:
        srv.stop()


def corrupt_every_chunk(kvstore: KvStoreProcess, disk_dir: Path) -> int:
    """Overwrite every KV chunk in the store with a copy that has one byte flipped,
    stored through the API (so the transport checksum, computed by the writer, holds)."""
    count = 0
    with KvStoreClient(kvstore.target, auth_token=kvstore.token) as client:
        for path in disk_dir.glob("*.kv"):
            raw = path.read_bytes()
            key_len = _HEADER.unpack(raw[: _HEADER.size])[3]
            key = raw[_HEADER.size : _HEADER.size + key_len]
            if key.startswith(b"session:"):
                continue
            blob = client.get(key)
            assert blob is not None
            forged = bytearray(blob)
            forged[len(forged) // 2] ^= 0xFF
            client.put(key, bytes(forged), replace=True)
            count += 1
    return count


def test_a_corrupted_stalled_or_killed_kvstore_never_changes_a_token(
    tiny_model_dir: Path, kvstore: KvStoreProcess, tmp_path: Path
) -> None:
    prompt = encode_words("the cat sat on the mat and the dog sat in the box under a tree")
    cold = reference_greedy(tiny_model_dir, prompt, 8)
    writer = start_server(tiny_model_dir, kvstore)
    try:
        with writer.channel() as ch:
            r = generate_pb2_grpc.GenerateServiceStub(ch).Generate(
                greedy(prompt, 8), timeout=DEADLINE_S
            )
        assert list(r.token_ids) == cold
        wait_for(lambda: stored_entries(kvstore) >= len(prompt) // CHUNK, "chunks stored")
    finally:
        writer.stop()
    assert corrupt_every_chunk(kvstore, tmp_path / "kv") >= len(prompt) // CHUNK

    # A fresh server (empty in-process caches) reads only corrupted chunks: all misses.
    reader = start_server(tiny_model_dir, kvstore)
    try:
        with reader.channel() as ch:
            stub = generate_pb2_grpc.GenerateServiceStub(ch)
            r = stub.Generate(greedy(prompt, 8), timeout=DEADLINE_S)
            assert list(r.token_ids) == cold and r.usage.cached_tokens == 0

            # Stalled (SIGSTOP): lookups time out; the answer is computed, exactly.
            stalled = encode_words("a red hat and a big tree in the old house")
            assert kvstore.proc is not None
            kvstore.proc.send_signal(signal.SIGSTOP)
            try:
                r = stub.Generate(greedy(stalled, 8), timeout=DEADLINE_S)
            finally:
                kvstore.proc.send_signal(signal.SIGCONT)
            assert list(r.token_ids) == reference_greedy(tiny_model_dir, stalled, 8)

            # Killed mid-stream: the stream ends normally with the cold tokens.
            killed = encode_words("the small dog was in the house under the tree")
            stream = stub.GenerateStream(greedy(killed, 30), timeout=DEADLINE_S)
            events = [next(stream)]
            kvstore.proc.kill()
            events += list(stream)
            assert events[-1].final.finish_reason == common_pb2.FINISH_REASON_MAX_TOKENS
            assert list(events[-1].final.token_ids) == reference_greedy(tiny_model_dir, killed, 30)
            # and the next request, with no kvstore at all, too
            r = stub.Generate(greedy(stalled, 8), timeout=DEADLINE_S)
            assert list(r.token_ids) == reference_greedy(tiny_model_dir, stalled, 8)
    finally:
        reader.stop()
