"""kvstore: blob payloads, tiers and the KvStore service on a real grpc.aio server."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from genai_common.flags import parse_bytes
from genai_proto.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from genai_service.engine.kv.kv_codec import BlobError, pack_kv, unpack_kv
from kvstore.checksum import ChecksumError, checksum
from kvstore.client import AsyncKvStoreClient, KvStoreClient
from kvstore.disk_tier import file_name
from kvstore.protocol import CHANNEL_OPTIONS, MAX_FRAME_BYTES
from kvstore.server import KvStoreConfig, RunningServer, start_server

MiB = 1 << 20
TOKEN = "test-data-plane-token"  # what the servers of ``start`` require by default
AUTH = (("authorization", f"Bearer {TOKEN}"),)  # metadata of raw stub calls
StartServer = Callable[..., Awaitable[RunningServer]]


def _blob(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


def _key(i: int) -> bytes:
    return checksum(i.to_bytes(4, "little"))  # 16 bytes, like a chunk key


@pytest_asyncio.fixture
async def start() -> AsyncIterator[StartServer]:
    """Start kvstore servers on free 127.0.0.1 ports; all are stopped afterwards."""
    servers: list[RunningServer] = []

    async def _start(**overrides: object) -> RunningServer:
        settings: dict[str, object] = {
            "host": "127.0.0.1",
            "port": 0,
            "grace_s": 0.0,
            "auth_token": TOKEN,
        }
        settings.update(overrides)
        server = await start_server(KvStoreConfig(**settings))  # type: ignore[arg-type]
        servers.append(server)
        return server

    yield _start
    for server in servers:
        await server.stop(0)


def _client(server: RunningServer, **kwargs: object) -> AsyncKvStoreClient:
    settings: dict[str, object] = {"auth_token": TOKEN, **kwargs}
    return AsyncKvStoreClient(f"127.0.0.1:{server.port}", **settings)  # type: ignore[arg-type]


def _channel(server: RunningServer) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=list(CHANNEL_OPTIONS))


async def _put_raw(
    server: RunningServer, frames: list[kvstore_pb2.PutRequest]
) -> kvstore_pb2.PutResponse:
    async with _channel(server) as channel:
        return await kvstore_pb2_grpc.KvStoreStub(channel).Put(
            iter(frames), timeout=10, metadata=AUTH
        )


def _frames(key: bytes, blob: bytes, digest: bytes | None = None) -> list[kvstore_pb2.PutRequest]:
    header = kvstore_pb2.BlobHeader(
        key=key, total_size_bytes=len(blob), checksum=digest or checksum(blob)
    )
    out = [kvstore_pb2.PutRequest(header=header)]
    for offset in range(0, len(blob), MAX_FRAME_BYTES):
        out.append(kvstore_pb2.PutRequest(data=blob[offset : offset + MAX_FRAME_BYTES]))
    return out


# --- blob payloads -------------------------------------------------------------------------


def _layers(num_layers: int, dtype: str, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    shape = (3, 5, 8)  # [kv_heads, num_tokens, head_dim]
    return [
        (rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype))
        for _ in range(num_layers)
    ]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_pack_unpack_round_trip(dtype: str) -> None:
    layers = _layers(4, dtype)
    blob = pack_kv(layers, dtype)
    itemsize = np.dtype(dtype).itemsize
    assert len(blob) == 24 + 2 * 4 * 3 * 5 * 8 * itemsize + 16
    assert blob[:4] == b"GKV1"
    header, out = unpack_kv(blob)
    assert (header.dtype, header.num_layers, header.layer_shape) == (dtype, 4, (3, 5, 8))
    for (k, v), (k2, v2) in zip(layers, out, strict=True):
        assert k2.tobytes() == k.tobytes() and v2.tobytes() == v.tobytes()
    assert pack_kv(out, dtype) == blob  # byte-identical


def test_pack_accepts_strided_views() -> None:
    # A token range sliced out of a larger [kv_heads, max_len, head_dim] buffer.
    rng = np.random.default_rng(1)
    big = [(rng.standard_normal((2, 16, 4), dtype=np.float32),) * 2 for _ in range(2)]
    views = [(k[:, 3:7, :], v[:, 3:7, :]) for k, v in big]
    _, out = unpack_kv(pack_kv(views, np.float32))
    for (k, _), (k2, _) in zip(views, out, strict=True):
        np.testing.assert_array_equal(k, k2)


def test_unpack_detects_corruption() -> None:
    blob = bytearray(pack_kv(_layers(2, "float32"), "float32"))
    for position in (0, 30, len(blob) - 20, len(blob) - 1):  # header, body, body end, trailer
        corrupt = bytearray(blob)
        corrupt[position] ^= 0x01
        with pytest.raises(ChecksumError):
            unpack_kv(bytes(corrupt))
    with pytest.raises(BlobError):
        unpack_kv(bytes(blob[:20]))
    with pytest.raises(ValueError, match="dtype"):
        pack_kv(_layers(1, "float32"), "int64")


# --- service ---------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_round_trips_byte_identical(start: StartServer) -> None:
    server = await start(memory_bytes=256 * MiB, max_blob_bytes=128 * MiB)
    sizes = [1, MiB - 1, MiB, MiB + 1, 5 * MiB, 64 * MiB]
    async with _client(server, timeout_s=30.0) as client:
        for i, size in enumerate(sizes):
            blob = _blob(size, seed=i)
            result = await client.put(_key(i), blob)
            assert not result.already_present and result.stored_in_memory
            assert await client.get(_key(i)) == blob, size
        assert await client.lookup([_key(i) for i in range(len(sizes))]) == len(sizes)
        stats = await client.stats()
    assert stats.memory.entries == len(sizes)
    assert stats.memory.size_bytes == sum(sizes)
    assert stats.memory.hits == len(sizes) and stats.disk is None


@pytest.mark.asyncio
async def test_get_frames_are_at_most_one_mib(start: StartServer) -> None:
    server = await start()
    sizes = {_key(1): MiB, _key(2): 5 * MiB + 3, _key(3): 0}
    async with _client(server) as client:
        for key, size in sizes.items():
            await client.put(key, _blob(size))
    async with _channel(server) as channel:
        stub = kvstore_pb2_grpc.KvStoreStub(channel)
        for key, size in sizes.items():
            frames = [
                f
                async for f in stub.Get(kvstore_pb2.GetRequest(key=key), timeout=10, metadata=AUTH)
            ]
            assert frames[0].WhichOneof("frame") == "header"
            assert frames[0].header.total_size_bytes == size
            assert frames[0].header.checksum == checksum(_blob(size))
            data = frames[1:]
            assert all(f.WhichOneof("frame") == "data" for f in data)
            assert all(len(f.data) <= MAX_FRAME_BYTES for f in data)
            assert all(f.ByteSize() <= MAX_FRAME_BYTES + 16 for f in frames)
            assert len(data) == -(-size // MAX_FRAME_BYTES)  # ceil: 1, 6, 0 frames
            assert b"".join(f.data for f in data) == _blob(size)


@pytest.mark.asyncio
async def test_put_checksum_or_size_mismatch_is_data_loss(start: StartServer) -> None:
    server = await start()
    blob = _blob(3 * MiB + 5)
    frames = _frames(_key(7), blob)
    frames[2] = kvstore_pb2.PutRequest(data=b"\x00" + frames[2].data[1:])  # one corrupt frame
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _put_raw(server, frames)
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    with pytest.raises(grpc.aio.AioRpcError) as err:  # a frame missing
        await _put_raw(server, _frames(_key(7), blob)[:-1])
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    with pytest.raises(grpc.aio.AioRpcError) as err:  # more data than announced
        await _put_raw(server, _frames(_key(7), blob) + [kvstore_pb2.PutRequest(data=b"x")])
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    async with _client(server) as client:
        assert await client.get(_key(7)) is None
        assert await client.lookup([_key(7)]) == 0
        stats = await client.stats()
    assert stats.put_checksum_failures == 3 and stats.memory.entries == 0


@pytest.mark.asyncio
async def test_invalid_frames_and_keys(start: StartServer) -> None:
    server = await start(max_blob_bytes=8 * MiB)
    big_frame = _blob(MiB + 1)
    cases = {
        "oversized frame": _frames(_key(1), big_frame)[:1]
        + [kvstore_pb2.PutRequest(data=big_frame)],
        "no header": [kvstore_pb2.PutRequest(data=b"abc")],
        "two headers": _frames(_key(1), b"abc") + _frames(_key(1), b"abc")[:1],
        "key too long": _frames(b"k" * 257, b"abc"),
        "empty key": _frames(b"", b"abc"),
        "bad checksum length": _frames(_key(1), b"abc", digest=b"\x00" * 8),
        "blob over max_blob_bytes": _frames(_key(1), b"")[:1],
        "empty stream": [],
    }
    cases["blob over max_blob_bytes"][0].header.total_size_bytes = 9 * MiB
    for name, frames in cases.items():
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _put_raw(server, frames)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
    async with _client(server) as client:
        assert await client.lookup([_key(1)]) == 0
    async with _channel(server) as channel:
        stub = kvstore_pb2_grpc.KvStoreStub(channel)
        for call in (
            stub.Lookup(kvstore_pb2.LookupRequest(keys=[_key(1), b"k" * 257]), metadata=AUTH),
            stub.Delete(kvstore_pb2.DeleteRequest(key=b""), metadata=AUTH),
            stub.Get(kvstore_pb2.GetRequest(key=b"k" * 300), metadata=AUTH).read(),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "256" in (err.value.details() or "")
    async with _client(server) as client:  # a 256-byte key is fine
        assert (await client.put(b"k" * 256, b"v")).stored_in_memory
        assert await client.get(b"k" * 256) == b"v"


@pytest.mark.asyncio
async def test_lookup_counts_leading_present_keys(start: StartServer) -> None:
    server = await start()
    chain = [_key(i) for i in range(5)]
    async with _client(server) as client:
        for i in (0, 1, 3):
            await client.put(chain[i], _blob(100, seed=i))
        assert await client.lookup(chain) == 2
        assert await client.lookup(chain[:2]) == 2
        assert await client.lookup(chain[3:4]) == 1
        assert await client.lookup(chain[2:]) == 0
        assert await client.lookup([]) == 0
        await client.put(chain[2], b"x")
        assert await client.lookup(chain) == 4
        assert await client.delete(chain[0]) is True
        assert await client.delete(chain[0]) is False
        assert await client.lookup(chain) == 0
        assert await client.get(chain[0]) is None


@pytest.mark.asyncio
async def test_memory_lru_eviction_by_bytes(start: StartServer) -> None:
    server = await start(memory_bytes=300_000)
    a, b, c, d = (_key(i) for i in range(4))
    async with _client(server) as client:
        for key in (a, b, c):
            await client.put(key, _blob(100_000))
        assert await client.get(a) is not None  # a becomes most recently used
        await client.put(d, _blob(100_000))  # evicts b, the least recently used
        assert [await client.lookup([k]) for k in (a, b, c, d)] == [1, 0, 1, 1]
        await client.put(_key(9), _blob(250_000))  # evicts c, a, d (LRU order)
        assert await client.lookup([d]) == 0
        stats = (await client.stats()).memory
        assert (stats.entries, stats.size_bytes, stats.capacity_bytes) == (1, 250_000, 300_000)
        assert stats.evictions == 4 and stats.hits == 1 and stats.misses == 0
        with pytest.raises(grpc.aio.AioRpcError) as err:  # larger than the whole tier
            await client.put(_key(10), _blob(300_001))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await client.get(b"absent") is None
        assert (await client.stats()).memory.misses == 1


@pytest.mark.asyncio
async def test_put_existing_key_is_a_noop(start: StartServer) -> None:
    server = await start()
    async with _client(server) as client:
        first, second = _blob(5 * MiB, seed=1), _blob(5 * MiB, seed=2)
        assert not (await client.put(_key(1), first)).already_present
        again = await client.put(_key(1), second)  # answered before the data is read
        assert again.already_present and not again.stored_in_memory
        assert await client.get(_key(1)) == first
        assert (await client.stats()).memory.entries == 1


@pytest.mark.asyncio
async def test_replace_swaps_the_blob_in_every_tier_and_survives_restart(
    start: StartServer, tmp_path: Path
) -> None:
    settings = {"memory_bytes": 4 * MiB, "disk_dir": str(tmp_path), "disk_bytes": 16 * MiB}
    key = b"session:" + b"0f" * 16
    server = await start(**settings)
    async with _client(server) as client:
        assert not (await client.put(key, b"v1")).already_present
        assert (await client.put(key, b"v2")).already_present  # no replace: kept as first stored
        result = await client.put(key, b"version 3", replace=True)
        assert not result.already_present and result.stored_in_memory and result.stored_on_disk
        assert await client.get(key) == b"version 3"
        stats = await client.stats()
    assert stats.memory.entries == 1 and stats.memory.size_bytes == len(b"version 3")
    assert stats.disk is not None and stats.disk.size_bytes == len(b"version 3")
    await server.stop(0)
    server = await start(**settings)
    async with _client(server) as client:
        assert await client.get(key) == b"version 3"  # from the disk tier


@pytest.mark.asyncio
async def test_a_replacement_too_large_for_the_disk_drops_the_old_disk_copy(
    start: StartServer, tmp_path: Path
) -> None:
    settings = {"memory_bytes": 8 * MiB, "disk_dir": str(tmp_path), "disk_bytes": MiB}
    key = b"session:" + b"ef" * 16
    server = await start(**settings)
    async with _client(server) as client:
        assert (await client.put(key, b"old")).stored_on_disk
        result = await client.put(key, _blob(2 * MiB), replace=True)  # memory only
        assert result.stored_in_memory and not result.stored_on_disk
    await server.stop(0)
    server = await start(**settings)
    async with _client(server) as client:
        assert await client.get(key) is None  # never the replaced b"old"


@pytest.mark.asyncio
@pytest.mark.parametrize("memory_bytes", [4 * MiB, 0])  # 0: every Get reads the disk file
async def test_readers_never_miss_a_record_being_replaced(
    start: StartServer, tmp_path: Path, memory_bytes: int
) -> None:
    server = await start(memory_bytes=memory_bytes, disk_dir=str(tmp_path))
    key = b"session:" + b"ab" * 16
    versions = [_blob(64 * 1024, seed=i) for i in range(20)]
    async with _client(server) as client:
        await client.put(key, versions[0])

        async def writer() -> None:
            for blob in versions[1:]:
                await client.put(key, blob, replace=True)

        async def reader() -> list[bytes | None]:
            return [await client.get(key) for _ in range(40)]

        _, *reads = await asyncio.gather(writer(), reader(), reader())
        assert await client.get(key) == versions[-1]
        stats = await client.stats()
    seen = [blob for r in reads for blob in r]
    assert all(blob in versions for blob in seen)  # never None, never a torn blob
    assert stats.disk is not None and stats.disk.checksum_failures == 0


@pytest.mark.asyncio
async def test_sync_client(start: StartServer) -> None:
    server = await start()

    def work() -> None:
        with KvStoreClient(f"127.0.0.1:{server.port}", auth_token=TOKEN, timeout_s=10) as client:
            client.wait_ready()
            blob = _blob(2 * MiB + 1)
            assert not client.put(_key(1), blob).already_present
            assert client.put(_key(1), blob).already_present
            assert client.get(_key(1)) == blob
            assert client.get(_key(2)) is None
            assert client.lookup([_key(1), _key(2)]) == 1
            assert client.delete(_key(1))
            assert client.stats().memory.entries == 0

    await asyncio.wait_for(asyncio.to_thread(work), timeout=20)


def _blob_files(directory: Path) -> Iterator[Path]:
    return directory.glob("*.kv")


@pytest.mark.asyncio
async def test_disk_tier_survives_restart(start: StartServer, tmp_path: Path) -> None:
    settings = {"memory_bytes": 4 * MiB, "disk_dir": str(tmp_path), "disk_bytes": 64 * MiB}
    blobs = {_key(i): _blob(MiB // 2 + i, seed=i) for i in range(4)}
    blobs[_key(10)] = _blob(5 * MiB, seed=10)  # too large for memory: disk only
    blobs[b"session:" + b"ab" * 40] = b'{"tokens": [1, 2, 3]}'  # long key: hashed file name
    server = await start(**settings)
    async with _client(server) as client:
        for key, blob in blobs.items():
            result = await client.put(key, blob)
            assert result.stored_on_disk and result.stored_in_memory == (key != _key(10))
    await server.stop(0)
    assert len(list(_blob_files(tmp_path))) == len(blobs)
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))

    server = await start(**settings)
    async with _client(server) as client:
        stats = await client.stats()
        assert stats.disk is not None and stats.disk.entries == len(blobs)
        assert stats.memory.entries == 0
        assert await client.lookup(list(blobs)) == len(blobs)
        for key, blob in blobs.items():
            assert await client.get(key) == blob
        assert await client.get(_key(0)) == blobs[_key(0)]  # promoted: a memory hit now
        stats = await client.stats()
    assert stats.disk is not None
    assert stats.disk.hits == len(blobs) and stats.disk.checksum_failures == 0
    assert stats.memory.hits == 1


@pytest.mark.asyncio
async def test_disk_corruption_is_a_counted_miss(start: StartServer, tmp_path: Path) -> None:
    settings = {"memory_bytes": 0, "disk_dir": str(tmp_path)}  # every Get reads the disk
    blobs = {_key(i): _blob(200_000, seed=i) for i in range(4)}
    server = await start(**settings)
    async with _client(server) as client:
        for key, blob in blobs.items():
            assert (await client.put(key, blob)).stored_on_disk
    await server.stop(0)

    def flip(key: bytes, offset_from_end: int) -> None:
        path = tmp_path / file_name(key)
        raw = bytearray(path.read_bytes())
        raw[-offset_from_end] ^= 0xFF
        path.write_bytes(bytes(raw))

    flip(_key(1), 1000)  # found by the start-up re-index
    (tmp_path / ".stale.tmp").write_bytes(b"half a write")  # left by a crash
    server = await start(**settings)
    assert not (tmp_path / file_name(_key(1))).exists()
    assert not (tmp_path / ".stale.tmp").exists()
    flip(_key(2), 5)  # found when read
    async with _client(server) as client:
        assert await client.get(_key(1)) is None
        assert await client.get(_key(2)) is None
        assert await client.get(_key(0)) == blobs[_key(0)]
        assert await client.get(_key(3)) == blobs[_key(3)]
        assert await client.lookup([_key(0)]) == 1 and await client.lookup([_key(2)]) == 0
        stats = await client.stats()
    assert stats.disk is not None
    assert stats.disk.checksum_failures == 2 and stats.disk.entries == 2
    assert not (tmp_path / file_name(_key(2))).exists()


@pytest.mark.asyncio
async def test_disk_lru_eviction(start: StartServer, tmp_path: Path) -> None:
    server = await start(memory_bytes=0, disk_dir=str(tmp_path), disk_bytes=250_000)
    async with _client(server) as client:
        for i in range(3):
            await client.put(_key(i), _blob(100_000, seed=i))
        stats = await client.stats()
    assert stats.disk is not None
    assert (stats.disk.entries, stats.disk.evictions, stats.disk.size_bytes) == (2, 1, 200_000)
    assert not (tmp_path / file_name(_key(0))).exists()
    assert len(list(_blob_files(tmp_path))) == 2


@pytest.mark.asyncio
async def test_auth_token_enforced(start: StartServer) -> None:
    server = await start(auth_token="s3cret")
    for token in (None, "wrong"):
        async with _client(server, auth_token=token) as client:
            for call in (
                client.lookup([_key(1)]),
                client.get(_key(1)),
                client.put(_key(1), b"x"),
                client.delete(_key(1)),
                client.stats(),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    async with _client(server, auth_token="s3cret") as client:
        assert not (await client.put(_key(1), b"x")).already_present
        assert await client.get(_key(1)) == b"x"
    async with _channel(server) as channel:  # health stays open
        health = health_pb2_grpc.HealthStub(channel)
        response = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.asyncio
async def test_health_and_reflection(start: StartServer) -> None:
    server = await start()
    async with _channel(server) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvstore.v1.KvStore"):
            response = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert response.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        responses = [r async for r in stub.ServerReflectionInfo(iter([request]), timeout=5)]
        v1 = channel.stream_stream(  # grpc.reflection.v1: the same messages on the wire
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        v1_responses = [r async for r in v1(iter([request]), timeout=5)]
    for response in (responses[0], v1_responses[0]):
        names = {s.name for s in response.list_services_response.service}
        assert {
            "kvstore.v1.KvStore",
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
        } <= names


@pytest.mark.asyncio
async def test_concurrent_puts_and_gets(start: StartServer, tmp_path: Path) -> None:
    server = await start(memory_bytes=3 * MiB, disk_dir=str(tmp_path), disk_bytes=6 * MiB)
    blobs = {_key(i): _blob(MiB, seed=i) for i in range(8)}
    async with _client(server) as client:
        results = await asyncio.gather(
            *(client.put(key, blob) for key, blob in blobs.items() for _ in range(3))
        )
        assert sum(not r.already_present for r in results) == len(blobs)  # one winner per key
        fetched = await asyncio.gather(*(client.get(key) for key in blobs))
        stats = await client.stats()
    assert stats.disk is not None and stats.disk.entries == 6 and stats.disk.evictions == 2
    assert stats.memory.entries == 3
    for (key, blob), got in zip(blobs.items(), fetched, strict=True):
        assert got is None or got == blob, key.hex()
    # 6 on disk; a key still in memory may have lost its disk copy to eviction.
    assert sum(got is not None for got in fetched) >= 6
    assert len(list(_blob_files(tmp_path))) == 6


def test_parse_bytes() -> None:
    assert parse_bytes("1073741824") == 1 << 30
    assert parse_bytes("512MiB") == 512 * MiB
    assert parse_bytes("2G") == 2 * 10**9
    assert parse_bytes("1.5gib") == 3 << 29
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes("lots")


def test_cli_serves_until_sigterm(tmp_path: Path) -> None:
    env = {**os.environ, "GENAI_KVSTORE_AUTH_TOKEN": "from-env"}
    command = [sys.executable, "-m", "kvstore", "--port", "0", "--disk-dir", str(tmp_path)]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stderr is not None
        port = None
        for _ in range(50):  # bounded: the JSON log lines before "kvstore serving"
            event = json.loads(proc.stderr.readline() or "{}")
            if event.get("event") == "kvstore serving":
                port = int(event["port"])
                break
        assert port is not None
        with KvStoreClient(f"127.0.0.1:{port}", auth_token="from-env", timeout_s=10) as client:
            assert client.put(b"session:abc", b"{}").stored_on_disk
            assert client.stats().disk is not None
        with (
            KvStoreClient(f"127.0.0.1:{port}", timeout_s=10) as client,
            pytest.raises(grpc.RpcError) as err,
        ):
            client.get(b"session:abc")
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
        if proc.stderr is not None:
            proc.stderr.close()


@pytest.mark.asyncio
async def test_concurrent_replacements_leave_both_tiers_agreeing(
    start: StartServer, tmp_path: Path
) -> None:
    settings = {"memory_bytes": 4 * MiB, "disk_dir": str(tmp_path)}
    key = b"session:" + b"cd" * 16
    server = await start(**settings)
    async with _client(server) as client:
        await asyncio.gather(
            *(client.put(key, _blob(32 * 1024, seed=i), replace=True) for i in range(12))
        )
        in_memory = await client.get(key)
    await server.stop(0)
    server = await start(**settings)  # memory empty: the disk tier's copy
    async with _client(server) as client:
        assert await client.get(key) == in_memory
