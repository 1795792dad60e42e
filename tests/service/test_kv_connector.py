"""The engine's kvstore connector: against a real kvstore server, a stalling stub and in memory."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import numpy as np
import pytest

from genai_proto.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from genai_service.engine.kv.kv_chunk_store import STAT_NAMES, KvChunkStore
from genai_service.engine.kv.kv_codec import pack_kv
from genai_service.engine.kv.kv_connector import GrpcKvChunkStore
from genai_service.engine.kv.kv_connector_memory import MemoryKvChunkStore
from genai_service.engine.kv.kv_integrity import TAG_BYTES, KvIntegrity
from genai_service.engine.kv.prefix_cache import KvLayers, chunk_keys, make_namespace
from kvstore.client import KvStoreClient
from kvstore.server import KvStoreConfig, RunningServer, start_server
from tests.server_harness import free_port

WAIT_S = 10.0  # upper bound on any wait in these tests, never a speed assertion
TOKEN = "test-data-plane-token"  # the data-plane token of KvStoreThread
# The replicas of these tests trust each other: one integrity secret.
INTEGRITY = KvIntegrity(b"connector-tests-integrity-secret-0123")
NAMESPACE = make_namespace("test-model", "float32", "L2.H2.D4.hnd", 4, key_id=INTEGRITY.key_id)


def _sealed(key: bytes, layers: KvLayers, dtype: str = "float32") -> bytes:
    """What a replica holding INTEGRITY stores under ``key``."""
    return INTEGRITY.seal(key, pack_kv(layers, dtype))


def _keys(n: int, first_token: int = 1) -> list[bytes]:
    return chunk_keys(NAMESPACE, list(range(first_token, first_token + 4 * n)), 4)


def _chunk(seed: int, dtype: str = "float32", num_layers: int = 2) -> KvLayers:
    rng = np.random.default_rng(seed)
    shape = (2, 4, 4)  # [kv_heads, chunk tokens, head_dim]
    return [
        (rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype))
        for _ in range(num_layers)
    ]


def _assert_same(got: list[KvLayers], want: list[KvLayers]) -> None:
    assert len(got) == len(want)
    for chunk_got, chunk_want in zip(got, want, strict=True):
        assert len(chunk_got) == len(chunk_want)
        for (k, v), (k2, v2) in zip(chunk_got, chunk_want, strict=True):
            assert k.dtype == k2.dtype and v.dtype == v2.dtype
            np.testing.assert_array_equal(k, k2, strict=True)
            np.testing.assert_array_equal(v, v2, strict=True)


class KvStoreThread:
    """A real kvstore server on a free 127.0.0.1 port, served by its own loop thread."""

    def __init__(self, port: int = 0) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.start(port)
        self.target = f"127.0.0.1:{self.server.port}"

    def start(self, port: int) -> None:
        config = KvStoreConfig(host="127.0.0.1", port=port, grace_s=0.0, auth_token=TOKEN)
        self.server: RunningServer = asyncio.run_coroutine_threadsafe(
            start_server(config), self.loop
        ).result(WAIT_S)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(WAIT_S)

    def close(self) -> None:
        self.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(WAIT_S)
        self.loop.close()


class StallingKvStore(kvstore_pb2_grpc.KvStoreServicer):
    """A KvStore whose ``stall``ed RPCs wait until ``release`` is set (or 10 s pass)."""

    def __init__(self, stall: set[str], present: bool) -> None:
        self.stall = stall
        self.present = present  # Lookup answers "all present" or "none present"
        self.release = threading.Event()

    def _maybe_stall(self, rpc: str) -> None:
        if rpc in self.stall:
            self.release.wait(WAIT_S)

    def Lookup(
        self, request: kvstore_pb2.LookupRequest, context: grpc.ServicerContext
    ) -> kvstore_pb2.LookupResponse:
        self._maybe_stall("Lookup")
        count = len(request.keys) if self.present else 0
        return kvstore_pb2.LookupResponse(present_prefix_count=count)

    def Get(
        self, request: kvstore_pb2.GetRequest, context: grpc.ServicerContext
    ) -> Iterator[kvstore_pb2.GetResponse]:
        self._maybe_stall("Get")
        context.abort(grpc.StatusCode.NOT_FOUND, "stub holds nothing")
        yield kvstore_pb2.GetResponse()  # unreachable; makes this a stream handler

    def Put(
        self, request_iterator: Iterator[kvstore_pb2.PutRequest], context: grpc.ServicerContext
    ) -> kvstore_pb2.PutResponse:
        for _ in request_iterator:
            pass
        self._maybe_stall("Put")
        return kvstore_pb2.PutResponse(stored_in_memory=True)


@pytest.fixture
def kvstore() -> Iterator[KvStoreThread]:
    server = KvStoreThread()
    yield server
    server.close()


StubFactory = Callable[..., tuple[str, StallingKvStore]]


@pytest.fixture
def stalling_stub() -> Iterator[StubFactory]:
    started: list[tuple[grpc.Server, StallingKvStore]] = []

    def _start(stall: set[str], present: bool = True) -> tuple[str, StallingKvStore]:
        servicer = StallingKvStore(stall, present)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        kvstore_pb2_grpc.add_KvStoreServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        started.append((server, servicer))
        return f"127.0.0.1:{port}", servicer

    yield _start
    for server, servicer in started:
        servicer.release.set()
        server.stop(0).wait(WAIT_S)


ConnectorFactory = Callable[..., GrpcKvChunkStore]


@pytest.fixture
def connect() -> Iterator[ConnectorFactory]:
    """GrpcKvChunkStore instances, all closed afterwards."""
    made: list[GrpcKvChunkStore] = []

    def _connect(target: str, **kwargs: object) -> GrpcKvChunkStore:
        settings: dict[str, object] = {
            "dtype": "float32",
            "timeout_s": 5.0,
            "auth_token": TOKEN,
            "integrity": INTEGRITY,
        }
        settings.update(kwargs)
        store = GrpcKvChunkStore(target, **settings)  # type: ignore[arg-type]
        made.append(store)
        return store

    yield _connect
    for store in made:
        store.close()


def _prefetch(store: KvChunkStore, keys: list[bytes]) -> list[KvLayers]:
    return store.prefetch(keys).result(WAIT_S)


# --- real kvstore server --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "dtype"), [(1, "float32"), (2, "float32"), (3, "float32"), (3, "float16")]
)
def test_push_then_prefetch_is_byte_identical(
    kvstore: KvStoreThread, connect: ConnectorFactory, n: int, dtype: str
) -> None:
    writer = connect(kvstore.target, dtype=dtype)
    keys = _keys(n)
    chunks = [_chunk(i, dtype) for i in range(n)]
    for key, layers in zip(keys, chunks, strict=True):
        writer.push(key, layers)
    assert writer.flush(WAIT_S)
    assert writer.stats()["pushed_chunks"] == n

    reader = connect(kvstore.target, dtype=dtype)  # another process: nothing cached locally
    _assert_same(_prefetch(reader, keys), chunks)
    stats = reader.stats()
    assert stats["hits_chunks"] == n
    assert stats["misses"] == 0
    assert stats["fetched_bytes"] == sum(len(pack_kv(c, dtype)) + TAG_BYTES for c in chunks)
    assert stats["errors"] == stats["timeouts"] == stats["checksum_failures"] == 0


def test_prefetch_returns_only_the_leading_run(
    kvstore: KvStoreThread, connect: ConnectorFactory
) -> None:
    store = connect(kvstore.target)
    keys = _keys(3)
    chunks = [_chunk(i) for i in range(3)]
    store.push(keys[0], chunks[0])
    store.push(keys[2], chunks[2])  # the middle chunk is missing
    assert store.flush(WAIT_S)

    _assert_same(_prefetch(store, keys), chunks[:1])
    _assert_same(_prefetch(store, keys[1:]), [])
    stats = store.stats()
    assert (stats["hits_chunks"], stats["misses"]) == (1, 2)
    assert stats["errors"] == stats["checksum_failures"] == 0
    assert store.prefetch([]).result(0) == []


def test_corrupt_blob_in_the_store_stops_the_chain(
    kvstore: KvStoreThread, connect: ConnectorFactory
) -> None:
    keys = _keys(3)
    chunks = [_chunk(i) for i in range(3)]
    corrupt = bytearray(pack_kv(chunks[1], "float32"))
    corrupt[40] ^= 0xFF  # a body byte: the payload's own trailer no longer matches
    with KvStoreClient(
        kvstore.target, auth_token=TOKEN
    ) as raw:  # the store accepts it: it is opaque bytes
        raw.put(keys[0], _sealed(keys[0], chunks[0]))
        raw.put(keys[1], INTEGRITY.seal(keys[1], corrupt))  # rot before sealing: MAC passes
        raw.put(keys[2], _sealed(keys[2], chunks[2]))

    store = connect(kvstore.target)
    _assert_same(_prefetch(store, keys), chunks[:1])
    stats = store.stats()
    assert stats["checksum_failures"] == 1
    assert (stats["hits_chunks"], stats["misses"]) == (1, 1)


def test_chunk_of_another_dtype_is_a_miss(
    kvstore: KvStoreThread, connect: ConnectorFactory
) -> None:
    keys = _keys(2)
    with KvStoreClient(kvstore.target, auth_token=TOKEN) as raw:
        raw.put(keys[0], _sealed(keys[0], _chunk(0)))
        raw.put(keys[1], _sealed(keys[1], _chunk(1, "float16"), "float16"))
    store = connect(kvstore.target)
    _assert_same(_prefetch(store, keys), [_chunk(0)])
    assert store.stats()["errors"] == 1


def test_push_skips_keys_already_pushed_or_present(
    kvstore: KvStoreThread, connect: ConnectorFactory
) -> None:
    keys = _keys(2)
    first = connect(kvstore.target)
    first.push(keys[0], _chunk(0))
    first.push(keys[0], _chunk(0))  # in flight or remembered: never sent twice
    assert first.flush(WAIT_S)
    first.push(keys[0], _chunk(0))
    assert first.flush(WAIT_S)
    assert (first.stats()["pushed_chunks"], first.stats()["push_skipped"]) == (1, 2)

    second = connect(kvstore.target)
    second.push(keys[0], _chunk(0))  # the store reports it present
    assert second.flush(WAIT_S)
    assert (second.stats()["pushed_chunks"], second.stats()["push_skipped"]) == (0, 1)

    first.push(keys[1], _chunk(1))
    assert first.flush(WAIT_S)
    _assert_same(_prefetch(second, keys), [_chunk(0), _chunk(1)])
    second.push(keys[1], _chunk(1))  # just fetched: known present without a round trip
    assert second.stats()["push_skipped"] == 2


def test_stopped_kvstore_is_a_miss_and_push_does_not_raise(
    kvstore: KvStoreThread, connect: ConnectorFactory
) -> None:
    store = connect(kvstore.target, timeout_s=2.0)
    keys = _keys(2)
    store.push(keys[0], _chunk(0))
    assert store.flush(WAIT_S)
    _assert_same(_prefetch(store, keys[:1]), [_chunk(0)])

    kvstore.stop()
    assert store.prefetch(keys).result(2.0 + WAIT_S) == []
    store.push(keys[1], _chunk(1))
    store.put_record(b"session:gone", b"x")
    assert store.flush(2.0 + WAIT_S)
    assert store.get_record(b"session:other", timeout_s=1.0) is None
    stats = store.stats()
    assert stats["pushed_chunks"] == 1 and stats["hits_chunks"] == 1
    assert stats["errors"] + stats["timeouts"] >= 4  # prefetch, push, record write, record get
    assert stats["pending_pushes"] == stats["pending_records"] == 0


def test_pushes_resume_promptly_when_the_kvstore_comes_back(connect: ConnectorFactory) -> None:
    """Issue 31: after an outage, gRPC's default reconnect backoff (up to
    120 s) kept the channel failing for seconds after the kvstore was back
    (12.3 s after a 30 s outage). With the data plane's backoff (at most 1 s)
    the first push after the restart lands within about a second; 4 s is the
    bound here, far below what the default gives after a long outage."""
    kvstore = KvStoreThread(free_port())
    port = kvstore.server.port
    try:
        store = connect(kvstore.target, timeout_s=0.5)
        counter = iter(range(1, 10_000))
        store.push(_keys(1, next(counter))[0], _chunk(0))
        assert store.flush(WAIT_S) and store.stats()["pushed_chunks"] == 1
        kvstore.stop()
        outage_ends = time.monotonic() + 5.0
        while time.monotonic() < outage_ends:  # failing pushes drive the backoff up
            store.push(_keys(1, next(counter))[0], _chunk(0))
            time.sleep(0.1)
        assert store.stats()["errors"] >= 1
        kvstore.start(port)
        back = time.monotonic()
        while store.stats()["pushed_chunks"] == 1 and time.monotonic() - back < WAIT_S:
            store.push(_keys(1, next(counter))[0], _chunk(0))
            time.sleep(0.05)
        assert store.stats()["pushed_chunks"] > 1
        assert time.monotonic() - back < 4.0
    finally:
        kvstore.close()


def test_nothing_listening_is_a_miss(connect: ConnectorFactory) -> None:
    store = connect(f"127.0.0.1:{free_port()}", timeout_s=1.0)
    assert store.prefetch(_keys(2)).result(1.0 + WAIT_S) == []
    store.push(_keys(1)[0], _chunk(0))
    assert store.flush(1.0 + WAIT_S)
    assert store.stats()["errors"] + store.stats()["timeouts"] == 2


# --- a store that stalls ------------------------------------------------------------------


def test_slow_get_times_out_as_a_miss(
    stalling_stub: StubFactory, connect: ConnectorFactory
) -> None:
    target, _ = stalling_stub({"Get"})
    store = connect(target, timeout_s=0.5)
    started = time.monotonic()
    assert store.prefetch(_keys(2)).result(0.5 + WAIT_S) == []
    assert time.monotonic() - started >= 0.4  # it did wait for the deadline
    stats = store.stats()
    assert stats["timeouts"] == 1
    assert (stats["hits_chunks"], stats["misses"], stats["errors"]) == (0, 1, 0)


def test_push_queue_is_bounded(stalling_stub: StubFactory, connect: ConnectorFactory) -> None:
    target, stub = stalling_stub({"Put"}, present=False)
    store = connect(target, max_pending_pushes=2, workers=1)
    keys = _keys(5)
    for i, key in enumerate(keys):
        store.push(key, _chunk(i))
    store.push(keys[0], _chunk(0))  # already pending
    stats = store.stats()
    assert (stats["pending_pushes"], stats["push_dropped"], stats["push_skipped"]) == (2, 3, 1)
    assert not store.flush(0.2)

    stub.release.set()
    assert store.flush(WAIT_S)
    stats = store.stats()
    assert (stats["pending_pushes"], stats["pushed_chunks"]) == (0, 2)
    store.push(keys[2], _chunk(2))  # room again
    assert store.flush(WAIT_S)
    assert store.stats()["pushed_chunks"] == 3


def test_close_stops_threads_and_resolves_pending_prefetches(
    stalling_stub: StubFactory, connect: ConnectorFactory
) -> None:
    target, _ = stalling_stub({"Get"})
    store = connect(target, timeout_s=WAIT_S)
    pending = store.prefetch(_keys(1))
    assert not pending.done()
    store.close()
    assert pending.result(WAIT_S) == []
    assert not store._thread.is_alive()
    names = [t.name for t in threading.enumerate() if t.is_alive()]
    assert not [n for n in names if n.startswith("kv-connector")], names

    # Closed: misses and no-ops, never exceptions.
    assert store.prefetch(_keys(1)).result(0) == []
    store.push(_keys(1)[0], _chunk(0))
    store.put_record(b"session:a", b"x")
    store.delete_record(b"session:a")
    assert store.get_record(b"session:a", timeout_s=0.1) is None
    assert store.flush(0.1)
    store.close()  # idempotent
    assert set(STAT_NAMES) <= set(store.stats())


# --- records ----------------------------------------------------------------------------------


def test_records_put_get_replace_delete(kvstore: KvStoreThread, connect: ConnectorFactory) -> None:
    owner = connect(kvstore.target)
    other = connect(kvstore.target)  # another replica sharing the store
    key = b"session:0123456789abcdef"
    assert owner.get_record(key, timeout_s=2.0) is None

    owner.put_record(key, b"v1")
    assert owner.get_record(key, timeout_s=2.0) == b"v1"  # read-your-writes, landed or not
    assert owner.flush(WAIT_S)
    assert other.get_record(key, timeout_s=2.0) == b"v1"

    owner.put_record(key, b"v2")  # one Put that replaces v1
    assert owner.flush(WAIT_S)
    assert other.get_record(key, timeout_s=2.0) == b"v2"

    for version in (b"v3", b"v4", b"v5"):
        owner.put_record(key, version)
    assert owner.get_record(key, timeout_s=2.0) == b"v5"
    assert owner.flush(WAIT_S)
    assert other.get_record(key, timeout_s=2.0) == b"v5"

    owner.delete_record(key)
    assert owner.get_record(key, timeout_s=2.0) is None
    assert owner.flush(WAIT_S)
    assert other.get_record(key, timeout_s=2.0) is None
    for store in (owner, other):
        stats = store.stats()
        assert stats["errors"] == stats["timeouts"] == stats["records_dropped"] == 0


def test_blobs_not_sealed_under_our_secret_are_counted_misses(
    kvstore: KvStoreThread, connect: ConnectorFactory
) -> None:
    keys = _keys(1)
    ours = connect(kvstore.target)
    foreign = connect(kvstore.target, integrity=KvIntegrity.generate())  # another secret
    foreign.push(keys[0], _chunk(0))
    foreign.put_record(b"session:x", b"theirs")
    ours.put_record(b"session:a", b"mine")
    assert foreign.flush(WAIT_S) and ours.flush(WAIT_S)
    assert _prefetch(ours, keys) == []
    assert ours.get_record(b"session:x", timeout_s=2.0) is None
    with KvStoreClient(
        kvstore.target, auth_token=TOKEN
    ) as raw:  # our own sealed record, replayed elsewhere
        raw.put(b"session:b", raw.get(b"session:a") or b"")
    assert ours.get_record(b"session:b", timeout_s=2.0) is None
    assert ours.get_record(b"session:a", timeout_s=2.0) == b"mine"
    stats = ours.stats()
    assert stats["mac_failures"] == 3
    assert stats["errors"] == stats["checksum_failures"] == stats["hits_chunks"] == 0


def test_slow_record_get_returns_none(
    stalling_stub: StubFactory, connect: ConnectorFactory
) -> None:
    target, _ = stalling_stub({"Get"})
    store = connect(target)
    assert store.get_record(b"session:x", timeout_s=0.3) is None
    assert store.stats()["timeouts"] == 1


# --- in memory --------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3])
def test_memory_store_round_trip_and_leading_run(n: int) -> None:
    store = MemoryKvChunkStore(dtype="float32")
    keys = _keys(n + 1)
    chunks = [_chunk(i) for i in range(n + 1)]
    for key, layers in zip(keys[:n], chunks[:n], strict=True):
        store.push(key, layers)
    store.push(keys[0], chunks[0])
    future = store.prefetch(keys)
    assert future.done()  # no delay: resolved at once
    _assert_same(future.result(), chunks[:n])
    stats = store.stats()
    assert (stats["pushed_chunks"], stats["push_skipped"]) == (n, 1)
    assert (stats["hits_chunks"], stats["misses"]) == (n, 1)
    store.close()


def test_memory_store_corruption_delay_and_failure() -> None:
    store = MemoryKvChunkStore(dtype="float32", timeout_s=0.5)
    keys = _keys(3)
    chunks = [_chunk(i) for i in range(3)]
    for key, layers in zip(keys, chunks, strict=True):
        store.push(key, layers)
    blob = bytearray(store.blobs[keys[1]])
    blob[30] ^= 1  # after sealing: the MAC catches it before the payload checksum
    store.blobs[keys[1]] = bytes(blob)
    _assert_same(_prefetch(store, keys), chunks[:1])
    assert store.stats()["mac_failures"] == 1

    store.delay_s = 0.05
    future = store.prefetch(keys[:1])
    _assert_same(future.result(WAIT_S), chunks[:1])

    store.delay_s = 5.0  # longer than timeout_s
    assert store.prefetch(keys[:1]).result(WAIT_S) == []
    assert store.get_record(b"session:a", timeout_s=0.05) is None
    assert store.stats()["timeouts"] == 2

    store.delay_s = 0.0
    store.fail = True
    assert _prefetch(store, keys) == []
    store.push(_keys(1, first_token=100)[0], chunks[0])
    store.put_record(b"session:a", b"x")
    assert store.get_record(b"session:a", timeout_s=0.1) is None
    assert store.stats()["errors"] == 4

    store.fail = False
    store.delay_s = 5.0
    pending = store.prefetch(keys[:1])
    store.close()
    assert pending.result(WAIT_S) == []


def test_memory_store_records() -> None:
    store = MemoryKvChunkStore()
    store.put_record(b"session:a", b"v1")
    store.put_record(b"session:a", b"v2")
    assert store.get_record(b"session:a", timeout_s=0.1) == b"v2"
    store.delete_record(b"session:a")
    assert store.get_record(b"session:a", timeout_s=0.1) is None
    assert store.flush(0.1)


def test_memory_store_refuses_records_it_did_not_seal() -> None:
    store = MemoryKvChunkStore()
    store.put_record(b"session:a", b"v1")
    store.blobs[b"session:b"] = store.blobs[b"session:a"]  # replayed under another key
    store.blobs[b"session:c"] = KvIntegrity.generate().seal(b"session:c", b"forged")
    store.blobs[b"session:d"] = b"not sealed at all"
    for key in (b"session:b", b"session:c", b"session:d"):
        assert store.get_record(key, timeout_s=0.1) is None
    assert store.get_record(b"session:a", timeout_s=0.1) == b"v1"
    assert store.stats()["mac_failures"] == 3


@pytest.mark.parametrize("bad", [{"dtype": "int8"}, {"timeout_s": 0.0}])
def test_invalid_settings_are_rejected(bad: dict[str, object]) -> None:
    settings: dict[str, object] = {"dtype": "float32"}
    settings.update(bad)
    with pytest.raises(ValueError, match=next(iter(bad))):
        MemoryKvChunkStore(**settings)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="workers"):
        GrpcKvChunkStore("127.0.0.1:1", dtype="float32", workers=0)
