"""The kvstore's Redis tier against a real redis-server: one node and a 3-master cluster.

Two kvstores sharing one Redis stand for two replicas' sidecars: what one
stores, the other serves through the real KvStore RPC although its own tiers
never saw it. Killing a shard, or the whole cluster, turns reads into misses
and writes into counted errors; no RPC fails.
"""

from __future__ import annotations

import argparse
import random
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import redis
from redis.asyncio.cluster import ClusterNode

from bench.redis_procs import RedisClusterNodes, RedisNode
from kvstore.__main__ import build_parser, config_from_args
from kvstore.checksum import checksum
from kvstore.client import AsyncKvStoreClient, KvStoreClient
from kvstore.redis_tier import REDIS_PASSWORD_ENV, REDIS_URL_ENV, RedisConfig
from kvstore.server import KvStoreConfig, RunningServer, start_server
from tests.conftest import require_tool
from tests.kvstore_harness import DATA_PLANE_TOKEN, KvStoreProcess

MiB = 1 << 20
SPLIT = 64 << 10  # small parts, so split blobs stay small in the tests
StartKv = Callable[..., Awaitable[RunningServer]]


def _blob(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


def _key(i: int) -> bytes:
    return checksum(b"redis-test" + i.to_bytes(4, "little"))  # 16 bytes, like a chunk key


@pytest.fixture
def redis_tools() -> None:
    require_tool("redis-server")
    require_tool("redis-cli")


@pytest.fixture
def redis_node(redis_tools: None, tmp_path: Path) -> Iterator[RedisNode]:
    node = RedisNode(tmp_path / "redis").start()
    try:
        yield node
    finally:
        node.kill()


@pytest.fixture
def redis_cluster(redis_tools: None, tmp_path: Path) -> Iterator[RedisClusterNodes]:
    cluster = RedisClusterNodes(tmp_path / "cluster")
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def test_node_start_survives_a_port_taken_before_redis_binds_it(
    redis_tools: None, tmp_path: Path
) -> None:
    """A free port is only free when chosen: taken before redis binds it (what
    made a cluster fixture flaky), the node starts on fresh ports instead."""
    node = RedisNode(tmp_path / "redis", cluster_bus=True)
    taken = (node.port, node.bus_port)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", node.port))  # as a client's source port would
        node.start()
    try:
        assert node.port != taken[0] and node.bus_port != taken[1]
        assert node.cli("PING").strip() == "PONG"
        assert "Address already in use" in (tmp_path / "redis" / "redis.log").read_text()
    finally:
        node.kill()


@pytest_asyncio.fixture
async def start_kv() -> AsyncIterator[StartKv]:
    """In-process kvstores on free ports whose Redis tier is ``url``; stopped afterwards."""
    servers: list[RunningServer] = []

    async def _start(url: str, **redis: object) -> RunningServer:
        settings: dict[str, object] = {"timeout_ms": 300, "split_bytes": SPLIT, **redis}
        config = KvStoreConfig(
            port=0,
            grace_s=0.0,
            auth_token=DATA_PLANE_TOKEN,
            redis=RedisConfig(url=url, **settings),  # type: ignore[arg-type]
        )
        server = await start_server(config)
        servers.append(server)
        return server

    yield _start
    for server in servers:
        await server.stop(0)


def _client(server: RunningServer) -> AsyncKvStoreClient:
    return AsyncKvStoreClient(
        f"127.0.0.1:{server.port}", auth_token=DATA_PLANE_TOKEN, timeout_s=5.0
    )


async def _read(client: AsyncKvStoreClient, key: bytes) -> bytes | str | None:
    """The blob, None when the store answered it has none, or the status code's
    name when it could not say (Redis down: UNAVAILABLE)."""
    try:
        return await client.get(key)
    except grpc.aio.AioRpcError as exc:
        return exc.code().name


# --- configuration ---------------------------------------------------------------------------


def test_redis_config_is_validated_and_keeps_secrets_out_of_repr() -> None:
    config = RedisConfig(url="redis+cluster://:s3cret@h:7000", password="pw")
    assert config.is_cluster and not config.tls
    assert config.client_url == "redis://:s3cret@h:7000"
    assert config.address == "h:7000"
    assert "s3cret" not in repr(config) and "pw" not in repr(config)
    assert RedisConfig(url="rediss://h", tls_ca_file="ca.pem").tls
    assert RedisConfig(url="redis://h", cluster=True).is_cluster
    for bad, message in [
        ({"url": "http://h"}, "scheme"),
        ({"url": "redis://h", "key_prefix": "{kv}:"}, "hash tags"),
        ({"url": "redis://h", "tls_ca_file": "ca.pem"}, "rediss"),
        ({"url": "redis://h", "timeout_ms": 0}, "timeout_ms"),
        ({"url": "redis://h", "ttl_s": -1}, "ttl_s"),
        ({"url": "redis://h", "split_bytes": 10}, "split_bytes"),
    ]:
        with pytest.raises(ValueError, match=message):
            RedisConfig(**bad)  # type: ignore[arg-type]


def test_cli_reads_the_redis_flags_and_secrets(tmp_path: Path) -> None:
    secret = tmp_path / "redis-password"
    secret.write_text(" from-file \n")

    def parse(argv: list[str], environ: dict[str, str]) -> KvStoreConfig:
        args: argparse.Namespace = build_parser().parse_args(["--insecure", *argv])
        return config_from_args(args, environ)

    assert parse([], {}).redis is None
    config = parse(
        ["--redis", "rediss://h:6380", "--redis-cluster", "--redis-password-file", str(secret)]
        + ["--redis-ttl-s", "3600", "--redis-timeout-ms", "250", "--redis-split-bytes", "2MiB"],
        {REDIS_PASSWORD_ENV: "from-env"},
    ).redis
    assert config == RedisConfig(
        url="rediss://h:6380",
        cluster=True,
        password="from-file",
        ttl_s=3600,
        timeout_ms=250,
        split_bytes=2 * MiB,
    )
    from_env = parse([], {REDIS_URL_ENV: "redis://e:1", REDIS_PASSWORD_ENV: "from-env"}).redis
    assert from_env == RedisConfig(url="redis://e:1", password="from-env")


# --- one node ----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_blob_put_through_one_kvstore_is_a_hit_through_another(
    redis_node: RedisNode, start_kv: StartKv
) -> None:
    a, b = await start_kv(redis_node.url), await start_kv(redis_node.url)
    # Inline, exactly one part's size, split into parts (the last one short).
    blobs = {_key(i): _blob(size, i) for i, size in enumerate([100, SPLIT, 3 * SPLIT + 17])}
    async with _client(a) as client_a, _client(b) as client_b:
        for key, blob in blobs.items():
            assert (await client_a.put(key, blob)).already_present is False
        assert (await client_b.stats()).memory.entries == 0
        assert await client_b.lookup(list(blobs)) == len(blobs)
        for key, blob in blobs.items():
            assert await client_b.get(key) == blob  # byte-identical, verified by the client
        stats = (await client_b.stats()).redis
        assert stats is not None
        assert (stats.hits, stats.misses, stats.errors, stats.checksum_failures) == (3, 0, 0, 0)
        assert (await client_b.stats()).memory.entries == 3  # promoted
        # The head plus 4 parts for the split blob: one value per inline blob.
        assert int(redis_node.cli("DBSIZE")) == 1 + 1 + 4 + 1
        assert await client_b.get(_key(99)) is None
        assert await client_b.lookup([_key(0), _key(99), _key(1)]) == 1
        # Delete removes every tier's copy, the parts too.
        assert await client_a.delete(_key(2)) is True
        assert int(redis_node.cli("DBSIZE")) == 2


@pytest.mark.asyncio
async def test_session_records_are_shared_and_replaced_in_redis(
    redis_node: RedisNode, start_kv: StartKv
) -> None:
    a, b = await start_kv(redis_node.url), await start_kv(redis_node.url)
    key = b"session:" + checksum(b"id")
    async with _client(a) as client_a, _client(b) as client_b:
        await client_a.put(key, b"turn 1", replace=True)
        assert await client_b.get(key) == b"turn 1"
        await client_a.put(key, b"turn 2" * 30_000, replace=True)  # now split into parts
        assert await client_b.get(key) == b"turn 2" * 30_000  # not a stale local copy
        await client_b.put(key, b"turn 3", replace=True)
        assert await client_a.get(key) == b"turn 3"
        assert int(redis_node.cli("DBSIZE")) == 1  # the old record's parts are gone


@pytest.mark.asyncio
async def test_corrupt_or_incomplete_redis_values_are_counted_misses(
    redis_node: RedisNode, start_kv: StartKv
) -> None:
    a, b = await start_kv(redis_node.url), await start_kv(redis_node.url)
    async with _client(a) as client_a, _client(b) as client_b:
        await client_a.put(_key(1), _blob(100, 1))
        await client_a.put(_key(2), _blob(2 * SPLIT, 2))
        name = f"genai:kv:{_key(1).hex()}"
        with redis.Redis(port=redis_node.port) as raw:
            value = raw.get(name)
            assert isinstance(value, bytes)
            raw.set(name, value[:-1] + bytes([value[-1] ^ 1]))  # one bit of the blob flipped
        # ... and one part of the split blob gone (evicted, say).
        part = redis_node.cli("--scan", "--pattern", f"genai:kv:{_key(2).hex()}:*").split()[0]
        redis_node.cli("DEL", part)
        assert await client_b.get(_key(1)) is None
        assert await client_b.get(_key(2)) is None
        stats = (await client_b.stats()).redis
        assert stats is not None
        assert (stats.hits, stats.misses, stats.checksum_failures) == (0, 2, 1)
        # Both heads were dropped, so the next Put stores the blobs again.
        assert await client_b.lookup([_key(1)]) == 0 and await client_b.lookup([_key(2)]) == 0
        await client_a.delete(_key(1))
        await client_a.put(_key(1), _blob(100, 1))
        assert await client_b.get(_key(1)) == _blob(100, 1)


@pytest.mark.asyncio
async def test_values_carry_the_ttl(redis_node: RedisNode, start_kv: StartKv) -> None:
    a = await start_kv(redis_node.url, ttl_s=600)
    async with _client(a) as client:
        await client.put(_key(1), _blob(3 * SPLIT, 1))
        await client.put(_key(2), b"record", replace=True)
    names = redis_node.cli("--scan", "--pattern", "genai:kv:*").split()
    assert len(names) == 5
    for name in names:
        assert 590 <= int(redis_node.cli("TTL", name)) <= 600


def test_genai_kvstore_serves_from_redis_given_the_flag(redis_node: RedisNode) -> None:
    """The real ``genai-kvstore`` process with ``--redis``: two of them share one Redis."""
    first = KvStoreProcess("--redis", redis_node.url)
    second = KvStoreProcess("--redis", redis_node.url)
    try:
        first.start()
        second.start()
        with (
            KvStoreClient(first.target, auth_token=DATA_PLANE_TOKEN) as one,
            KvStoreClient(second.target, auth_token=DATA_PLANE_TOKEN) as two,
        ):
            blob = _blob(3 * MiB + 5, 7)  # split at the default 1 MiB
            one.put(_key(7), blob)
            assert two.lookup([_key(7)]) == 1
            assert two.get(_key(7)) == blob
            assert two.stats().redis is not None
    finally:
        first.stop()
        second.stop()


@pytest.mark.asyncio
async def test_a_dead_redis_is_unavailable_for_what_only_it_holds_and_a_counted_error(
    redis_node: RedisNode, start_kv: StartKv
) -> None:
    a = await start_kv(redis_node.url)
    async with _client(a) as client:
        await client.put(_key(1), b"kept locally")
        redis_node.kill()
        started = time.monotonic()
        assert (await client.put(_key(2), b"also kept")).stored_in_memory  # no failed RPC
        assert await client.get(_key(1)) == b"kept locally"  # the memory tier still serves
        # Not held locally, and Redis cannot say: UNAVAILABLE, not NOT_FOUND, so a
        # session record is "retry", never "no such session" (the engine takes
        # a chunk as a miss either way).
        assert await _read(client, _key(3)) == "UNAVAILABLE"
        assert await client.lookup([_key(1), _key(2), _key(3)]) == 2
        # A record replacement Redis did not take fails, and is kept nowhere
        # (a local copy would later be served over newer ones in Redis).
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.put(_key(4), b"record v2", replace=True)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert await _read(client, _key(4)) == "UNAVAILABLE"
        assert time.monotonic() - started < 3.0
        stats = (await client.stats()).redis
        assert stats is not None and stats.errors >= 3


# --- a 3-master cluster ------------------------------------------------------------------------


def _names_by_node(cluster: RedisClusterNodes) -> list[set[str]]:
    return [set(node.cli("--scan", "--pattern", "genai:kv:*").split()) for node in cluster.nodes]


@pytest.mark.asyncio
async def test_cluster_spreads_chunks_and_looks_up_in_one_round_trip_per_shard(
    redis_cluster: RedisClusterNodes, start_kv: StartKv, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = await start_kv(redis_cluster.url), await start_kv(redis_cluster.url)
    chain = [_key(i) for i in range(30)]
    async with _client(a) as client_a, _client(b) as client_b:
        for i, key in enumerate(chain):
            await client_a.put(key, _blob(1000 + i, i))
        await client_a.put(_key(100), _blob(6 * SPLIT, 100))  # its parts spread too
        counts = redis_cluster.keys_per_node()
        assert sum(counts) == 30 + 1 + 6 and all(count > 0 for count in counts)

        round_trips = 0
        execute_pipeline = ClusterNode.execute_pipeline

        async def counted(self: ClusterNode, commands: list[object]) -> bool:
            nonlocal round_trips
            round_trips += 1
            return await execute_pipeline(self, commands)  # type: ignore[arg-type]

        monkeypatch.setattr(ClusterNode, "execute_pipeline", counted)
        assert await client_b.lookup(chain) == 30
        assert round_trips == 3  # one pipeline per shard for 30 keys
        for i, key in enumerate(chain):
            assert await client_b.get(key) == _blob(1000 + i, i)
        assert await client_b.get(_key(100)) == _blob(6 * SPLIT, 100)


@pytest.mark.asyncio
async def test_killing_a_shard_then_the_cluster_makes_its_keys_unavailable(
    redis_cluster: RedisClusterNodes, start_kv: StartKv
) -> None:
    a = await start_kv(redis_cluster.url)
    chain = [_key(i) for i in range(30)]
    async with _client(a) as client_a:
        for i, key in enumerate(chain):
            await client_a.put(key, _blob(500, i))
    by_node = _names_by_node(redis_cluster)
    dead = redis_cluster.nodes[1]
    dead_names = by_node[1]
    assert dead_names and len(dead_names) < 30
    dead.kill()

    b = await start_kv(redis_cluster.url)  # its own tiers never saw the chunks
    async with _client(b) as client_b:
        started = time.monotonic()
        for i, key in enumerate(chain):
            on_dead = f"genai:kv:{key.hex()}" in dead_names
            assert await _read(client_b, key) == ("UNAVAILABLE" if on_dead else _blob(500, i)), i
        first_dead = next(i for i, k in enumerate(chain) if f"genai:kv:{k.hex()}" in dead_names)
        fresh = [_key(1000 + i) for i in range(30)]
        for key in fresh:
            assert (await client_b.put(key, b"new")).stored_in_memory  # never a failed Put
        stats = (await client_b.stats()).redis
        assert stats is not None and stats.errors >= len(dead_names)
        assert stats.hits == 30 - len(dead_names)
        # Lookup asks Redis about keys b does not hold: the first dead-shard key ends the chain.
        c = await start_kv(redis_cluster.url)
        async with _client(c) as client_c:
            assert await client_c.lookup(chain) == first_dead
            elapsed = time.monotonic() - started
            assert elapsed < 30.0

            redis_cluster.stop()  # the whole cluster
            for key in chain + fresh:
                assert await _read(client_c, key) == "UNAVAILABLE"
            assert await client_c.lookup(chain) == 0
            assert (await client_c.put(_key(5000), b"x")).stored_in_memory
            assert await client_c.get(_key(5000)) == b"x"
            stats = (await client_c.stats()).redis
            assert stats is not None
            assert stats.misses == 60 and stats.errors >= 60
