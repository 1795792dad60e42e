"""Clients of kvstore.v1.KvStore: ``AsyncKvStoreClient`` and ``KvStoreClient`` (blocking).

Both split blobs into frames of at most 1 MiB, verify the checksum of every
blob they receive, put a deadline on every call and use data-plane channel
options (large messages, no compression). RPC failures surface as
``grpc.RpcError`` (``grpc.aio.AioRpcError`` for the async client) and a blob
that arrives corrupt as ``ChecksumError``; the engine's connector treats any
of them as a cache miss (docs/design.md, "Processes and planes").
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator, Sequence
from types import TracebackType
from typing import Any

import grpc

from genai_proto.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from kvstore.checksum import ChecksumError, checksum, verify_checksum
from kvstore.protocol import CHANNEL_OPTIONS, key_error, split_frames
from kvstore.stats import PutResult, StoreStats, TierStats

DEFAULT_TIMEOUT_S = 10.0


def _check_key(key: bytes) -> None:
    message = key_error(key)
    if message is not None:
        raise ValueError(message)


def _metadata(auth_token: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {auth_token}"),) if auth_token else None


def _put_frames(
    key: bytes, blob: bytes, digest_size: int, replace: bool
) -> Iterator[kvstore_pb2.PutRequest]:
    header = kvstore_pb2.BlobHeader(
        key=key,
        total_size_bytes=len(blob),
        checksum=checksum(blob, digest_size),
        replace=replace,
    )
    yield kvstore_pb2.PutRequest(header=header)
    for data in split_frames(blob):
        yield kvstore_pb2.PutRequest(data=data)


class _BlobAssembler:
    """Collects Get frames into one blob and verifies it against the header."""

    def __init__(self, key: bytes, verify: bool) -> None:
        self._key = key
        self._verify = verify
        self._header: kvstore_pb2.BlobHeader | None = None
        self._chunks: list[bytes] = []

    def add(self, frame: kvstore_pb2.GetResponse) -> None:
        if self._header is None:
            if frame.WhichOneof("frame") != "header":
                raise ChecksumError(f"Get {self._key.hex()}: first frame is not a header")
            self._header = frame.header
        else:
            self._chunks.append(frame.data)

    def blob(self) -> bytes:
        if self._header is None:
            raise ChecksumError(f"Get {self._key.hex()}: stream ended without a header")
        blob = b"".join(self._chunks)
        if len(blob) != self._header.total_size_bytes:
            raise ChecksumError(
                f"Get {self._key.hex()}: {len(blob)} bytes received, "
                f"{self._header.total_size_bytes} announced"
            )
        if self._verify and not verify_checksum(blob, self._header.checksum):
            raise ChecksumError(f"Get {self._key.hex()}: checksum mismatch")
        return blob


def _tier(stats: kvstore_pb2.TierStats) -> TierStats:
    return TierStats(
        entries=stats.entries,
        size_bytes=stats.size_bytes,
        capacity_bytes=stats.capacity_bytes,
        hits=stats.hits,
        misses=stats.misses,
        evictions=stats.evictions,
        checksum_failures=stats.checksum_failures,
        errors=stats.errors,
    )


def _store_stats(response: kvstore_pb2.StatsResponse) -> StoreStats:
    return StoreStats(
        memory=_tier(response.memory),
        disk=_tier(response.disk) if response.HasField("disk") else None,
        put_checksum_failures=response.put_checksum_failures,
        redis=_tier(response.redis) if response.HasField("redis") else None,
    )


def _put_result(response: kvstore_pb2.PutResponse) -> PutResult:
    return PutResult(
        already_present=response.already_present,
        stored_in_memory=response.stored_in_memory,
        stored_on_disk=response.stored_on_disk,
    )


class _ClientBase:
    """The channel, stub, metadata and defaults that both clients hold;
    ``_grpc`` is the module that makes the channel (``grpc`` or ``grpc.aio``)."""

    _grpc: Any = grpc

    def __init__(
        self,
        target: str,
        *,
        auth_token: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        credentials: grpc.ChannelCredentials | None = None,
        verify: bool = True,
        digest_size: int = 16,
    ) -> None:
        options = list(CHANNEL_OPTIONS)
        compression = grpc.Compression.NoCompression
        if credentials is None:
            self._channel = self._grpc.insecure_channel(target, options, compression)
        else:
            self._channel = self._grpc.secure_channel(target, credentials, options, compression)
        self._stub = kvstore_pb2_grpc.KvStoreStub(self._channel)
        self._metadata = _metadata(auth_token)
        self._timeout_s = timeout_s
        self._verify = verify
        self._digest_size = digest_size


class AsyncKvStoreClient(_ClientBase):
    """grpc.aio client of one kvstore server.

    ``target`` is "host:port"; ``auth_token`` is sent as a bearer token;
    ``timeout_s`` is the default deadline of each call (each method takes a
    ``timeout_s`` override); ``credentials`` selects TLS; ``verify`` turns off
    the client-side checksum check (the KV payload has its own, see
    genai_service/engine/kv/kv_codec.py).
    """

    _grpc = grpc.aio
    _channel: grpc.aio.Channel

    async def wait_ready(self, timeout_s: float | None = None) -> None:
        """Wait until the channel is connected; raises TimeoutError."""
        async with asyncio.timeout(timeout_s or self._timeout_s):
            await self._channel.channel_ready()

    async def lookup(self, keys: Sequence[bytes], *, timeout_s: float | None = None) -> int:
        """How many leading ``keys`` of a chain are present, in one round trip."""
        for key in keys:
            _check_key(key)
        response = await self._stub.Lookup(
            kvstore_pb2.LookupRequest(keys=keys),
            timeout=timeout_s or self._timeout_s,
            metadata=self._metadata,
        )
        return response.present_prefix_count

    async def get(self, key: bytes, *, timeout_s: float | None = None) -> bytes | None:
        """The blob stored under ``key``, or None when it is not there."""
        _check_key(key)
        call = self._stub.Get(
            kvstore_pb2.GetRequest(key=key),
            timeout=timeout_s or self._timeout_s,
            metadata=self._metadata,
        )
        assembler = _BlobAssembler(key, self._verify)
        try:
            async for frame in call:
                assembler.add(frame)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise
        return assembler.blob()

    async def put(
        self, key: bytes, blob: bytes, *, replace: bool = False, timeout_s: float | None = None
    ) -> PutResult:
        """Store ``blob`` under ``key``: a no-op when ``key`` is already present,
        unless ``replace`` (readers then see the old blob or the new one)."""
        _check_key(key)
        response = await self._stub.Put(
            _put_frames(key, blob, self._digest_size, replace),
            timeout=timeout_s or self._timeout_s,
            metadata=self._metadata,
        )
        return _put_result(response)

    async def delete(self, key: bytes, *, timeout_s: float | None = None) -> bool:
        """Remove ``key`` from every tier; True when it was present."""
        _check_key(key)
        response = await self._stub.Delete(
            kvstore_pb2.DeleteRequest(key=key),
            timeout=timeout_s or self._timeout_s,
            metadata=self._metadata,
        )
        return response.deleted

    async def stats(self, *, timeout_s: float | None = None) -> StoreStats:
        """Per-tier occupancy and counters."""
        response = await self._stub.Stats(
            kvstore_pb2.StatsRequest(),
            timeout=timeout_s or self._timeout_s,
            metadata=self._metadata,
        )
        return _store_stats(response)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncKvStoreClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class KvStoreClient(_ClientBase):
    """Blocking client of one kvstore server; same arguments as ``AsyncKvStoreClient``."""

    _grpc = grpc
    _channel: grpc.Channel

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Wait until the channel is connected; raises grpc.FutureTimeoutError."""
        grpc.channel_ready_future(self._channel).result(timeout=timeout_s or self._timeout_s)

    def lookup(self, keys: Sequence[bytes], *, timeout_s: float | None = None) -> int:
        """How many leading ``keys`` of a chain are present, in one round trip."""
        for key in keys:
            _check_key(key)
        response = self._stub.Lookup(
            kvstore_pb2.LookupRequest(keys=keys),
            timeout=timeout_s or self._timeout_s,
            metadata=self._metadata,
        )
        return response.present_prefix_count

    def get(self, key: bytes, *, timeout_s: float | None = None) -> bytes | None:
        """The blob stored under ``key``, or None when it is not there."""
        _check_key(key)
        frames: Iterable[kvstore_pb2.GetResponse] = self._stub.Get(
            kvstore_pb2.GetRequest(key=key),
            timeout=timeout_s or self._timeout_s,
            metadata=self._metadata,
        )
        assembler = _BlobAssembler(key, self._verify)
        try:
            for frame in frames:
                assembler.add(frame)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:  # type: ignore[attr-defined]
                return None
            raise
        return assembler.blob()

    def put(
        self, key: bytes, blob: bytes, *, replace: bool = False, timeout_s: float | None = None
    ) -> PutResult:
        """Store ``blob`` under ``key``: a no-op when ``key`` is already present,
        unless ``replace`` (readers then see the old blob or the new one)."""
        _check_key(key)
        response = self._stub.Put(
            _put_frames(key, blob, self._digest_size, replace),
            timeout=timeout_s or self._timeout_s,
            metadata=self._metadata,
        )
        return _put_result(response)

    def delete(self, key: bytes, *, timeout_s: float | None = None) -> bool:
        """Remove ``key`` from every tier; True when it was present."""
        _check_key(key)
        response = self._stub.Delete(
            kvstore_pb2.DeleteRequest(key=key),
            timeout=timeout_s or self._timeout_s,
            metadata=self._metadata,
        )
        return response.deleted

    def stats(self, *, timeout_s: float | None = None) -> StoreStats:
        """Per-tier occupancy and counters."""
        response = self._stub.Stats(
            kvstore_pb2.StatsRequest(),
            timeout=timeout_s or self._timeout_s,
            metadata=self._metadata,
        )
        return _store_stats(response)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> KvStoreClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
