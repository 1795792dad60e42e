"""The kvstore.v1.KvStore gRPC server: a thin servicer over ``BlobStore``.

Health (``grpc.health.v1``, for "" and "kvstore.v1.KvStore") and server
reflection share the port and stay open; the KvStore RPCs require a bearer
token unless the server was started insecure (docs/design.md, "Processes and planes").
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from genai_common.credentials import server_credentials
from genai_common.decoding import TolerantDecoding, Undecodable
from genai_common.errors import DataLoss, GenAIError, InvalidArgument, NotFound
from genai_common.flags import flag, parse_bytes, tls_server_fields
from genai_common.reflection import enable_reflection
from genai_common.status import abort
from genai_proto.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from kvstore.checksum import DIGEST_SIZES
from kvstore.checksum import hasher as new_hasher
from kvstore.disk_tier import DiskTier
from kvstore.memory_tier import MemoryTier, StoredBlob
from kvstore.protocol import (
    CHANNEL_OPTIONS,
    MAX_FRAME_BYTES,
    MAX_LOOKUP_KEYS,
    SERVICE_NAME,
    key_error,
)
from kvstore.redis_tier import RedisConfig, RedisTier
from kvstore.stats import TierStats
from kvstore.store import BlobStore

log = structlog.get_logger(__name__)

_Response = TypeVar("_Response")


_TLS = tls_server_fields(client_ca_help="require client certificates (mTLS)")


@dataclass(frozen=True)
class KvStoreConfig:
    """How the kvstore server runs (``genai-kvstore`` flags, declared with the fields)."""

    host: str = flag("127.0.0.1", help="address to bind")
    port: int = flag(50052, help="port to bind")  # 0: any free port (RunningServer.port)
    memory_bytes: int = flag(  # the sum of blob sizes
        1 << 30, help="memory tier capacity, e.g. 4GiB", parse=parse_bytes
    )
    disk_dir: str | None = flag(  # None: memory only
        None, help="directory of the disk tier (default: no disk tier)"
    )
    disk_bytes: int = flag(10 << 30, help="disk tier capacity", parse=parse_bytes)
    max_blob_bytes: int = flag(  # a Put is buffered in memory
        256 << 20, help="largest blob a Put may store", parse=parse_bytes
    )
    # KvStore RPCs need "authorization: Bearer <auth_token>"; leaving it unset
    # takes insecure=True, an explicit choice to serve anyone who can connect.
    auth_token: str | None = field(default=None, repr=False)  # a secret: never logged
    insecure: bool = flag(
        False,
        help="require no token: any client that can connect may read and overwrite KV "
        "(logs a warning)",
    )
    tls_cert_file: str | None = _TLS["tls_cert_file"]  # PEM; with tls_key_file, serve TLS
    tls_key_file: str | None = _TLS["tls_key_file"]
    tls_client_ca_file: str | None = _TLS["tls_client_ca_file"]  # PEM; require client certs
    grace_s: float = flag(5.0, help="seconds in-flight RPCs get on shutdown")
    redis: RedisConfig | None = None  # the shared tier behind memory and disk; None: none

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0 to 65535, got {self.port}")
        for name in ("memory_bytes", "disk_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_blob_bytes <= 0:
            raise ValueError(f"max_blob_bytes must be > 0, got {self.max_blob_bytes}")
        if self.auth_token is not None and not self.auth_token:
            raise ValueError("auth_token must not be empty when set")
        if self.auth_token is None and not self.insecure:
            raise ValueError(
                "the data plane needs a bearer token: set auth_token (genai-kvstore "
                "--auth-token, --auth-token-file or $GENAI_KVSTORE_AUTH_TOKEN), or set "
                "insecure (--insecure) to accept clients without one"
            )
        if self.auth_token is not None and self.insecure:
            raise ValueError("auth_token and insecure exclude each other; set one")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("tls_client_ca_file (mTLS) needs tls_cert_file and tls_key_file")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")


def _check_key(key: bytes, field: str = "key") -> None:
    message = key_error(key, field)
    if message is not None:
        raise InvalidArgument(message)


async def _abort_for(exc: BaseException, rpc: str, context: grpc.aio.ServicerContext) -> None:
    if isinstance(exc, GenAIError):
        # Misses are routine on a cache, and a Redis outage is logged by the
        # Redis tier (rate-limited); refusals that point at a bug are not.
        level = logging.DEBUG if exc.code in ("NOT_FOUND", "UNAVAILABLE") else logging.WARNING
        log.log(level, "kvstore rpc refused", rpc=rpc, code=exc.code, reason=exc.message)
        await abort(context, exc)
    log.exception("kvstore rpc failed", rpc=rpc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {rpc}")


def _unary(
    method: Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[_Response]],
) -> Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[_Response]]:
    """Map domain errors of a unary-response RPC to status codes.

    See docs/design.md, "Status codes".
    """

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> _Response:
        try:
            if isinstance(request, Undecodable):
                raise request.error()
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort_for(exc, method.__name__, context)
            raise  # unreachable: abort raises

    return wrapper


def _streaming(
    method: Callable[[Any, Any, grpc.aio.ServicerContext], AsyncIterator[_Response]],
) -> Callable[[Any, Any, grpc.aio.ServicerContext], AsyncIterator[_Response]]:
    """Map domain errors of a server-streaming RPC to status codes."""

    @functools.wraps(method)
    async def wrapper(
        self: Any, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[_Response]:
        try:
            if isinstance(request, Undecodable):
                raise request.error()
            async for response in method(self, request, context):
                yield response
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort_for(exc, method.__name__, context)

    return wrapper


def _tier_pb(stats: TierStats) -> kvstore_pb2.TierStats:
    return kvstore_pb2.TierStats(**dataclasses.asdict(stats))


class KvStoreServicer(kvstore_pb2_grpc.KvStoreServicer):
    """Validates frames, verifies blobs and hands them to the store."""

    def __init__(self, store: BlobStore, max_blob_bytes: int) -> None:
        self._store = store
        self._max_blob_bytes = max_blob_bytes

    @_unary
    async def Lookup(
        self, request: kvstore_pb2.LookupRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.LookupResponse:
        keys = list(request.keys)
        if len(keys) > MAX_LOOKUP_KEYS:
            raise InvalidArgument(
                f"keys has {len(keys)} entries; allowed at most {MAX_LOOKUP_KEYS}"
            )
        for i, key in enumerate(keys):
            _check_key(key, f"keys[{i}]")
        return kvstore_pb2.LookupResponse(present_prefix_count=await self._store.lookup(keys))

    @_streaming
    async def Get(
        self, request: kvstore_pb2.GetRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kvstore_pb2.GetResponse]:
        _check_key(request.key)
        blob = await self._store.get(request.key)
        if blob is None:
            raise NotFound(f"key {request.key.hex()} is not in the store")
        data = memoryview(blob.data)
        yield kvstore_pb2.GetResponse(
            header=kvstore_pb2.BlobHeader(total_size_bytes=len(data), checksum=blob.checksum)
        )
        for offset in range(0, len(data), MAX_FRAME_BYTES):
            yield kvstore_pb2.GetResponse(data=bytes(data[offset : offset + MAX_FRAME_BYTES]))

    @_unary
    async def Put(
        self,
        request_iterator: AsyncIterator[kvstore_pb2.PutRequest],
        context: grpc.aio.ServicerContext,
    ) -> kvstore_pb2.PutResponse:
        header: kvstore_pb2.BlobHeader | None = None
        hasher: Any = None
        chunks: list[bytes] = []
        received = 0
        async for frame in request_iterator:
            if isinstance(frame, Undecodable):
                raise frame.error()
            kind = frame.WhichOneof("frame")
            if header is None:
                if kind != "header":
                    raise InvalidArgument(f"frame 0 is {kind!r}; a Put starts with a header frame")
                header = frame.header
                self._check_header(header)
                if not header.replace and self._store.contains(header.key):
                    # Blobs are kept as first stored: answer now, the client stops sending.
                    return kvstore_pb2.PutResponse(already_present=True)
                self._store.check_fits(header.total_size_bytes)
                hasher = new_hasher(len(header.checksum))
                continue
            if kind != "data":
                raise InvalidArgument(f"frame is {kind!r} after the header; only data may follow")
            if len(frame.data) > MAX_FRAME_BYTES:
                raise InvalidArgument(
                    f"data frame is {len(frame.data)} bytes; allowed at most {MAX_FRAME_BYTES}"
                )
            received += len(frame.data)
            if received > header.total_size_bytes:
                self._store.put_checksum_failures += 1
                raise DataLoss(
                    f"received more than total_size_bytes={header.total_size_bytes}; nothing stored"
                )
            hasher.update(frame.data)
            chunks.append(frame.data)
        if header is None:
            raise InvalidArgument("Put stream is empty; it starts with a header frame")
        if received != header.total_size_bytes or hasher.digest() != header.checksum:
            self._store.put_checksum_failures += 1
            raise DataLoss(
                f"blob of {received} bytes does not match total_size_bytes="
                f"{header.total_size_bytes} and its checksum; nothing stored"
            )
        blob = StoredBlob(b"".join(chunks), header.checksum)
        result = await self._store.put(header.key, blob, replace=header.replace)
        log.debug("put", key=header.key.hex(), size_bytes=received, **dataclasses.asdict(result))
        return kvstore_pb2.PutResponse(**dataclasses.asdict(result))

    def _check_header(self, header: kvstore_pb2.BlobHeader) -> None:
        _check_key(header.key, "header.key")
        if len(header.checksum) not in DIGEST_SIZES:
            raise InvalidArgument(
                f"header.checksum is {len(header.checksum)} bytes; allowed 16 or 32 (blake2b)"
            )
        if header.total_size_bytes > self._max_blob_bytes:
            raise InvalidArgument(
                f"header.total_size_bytes is {header.total_size_bytes}; "
                f"allowed at most {self._max_blob_bytes}"
            )

    @_unary
    async def Delete(
        self, request: kvstore_pb2.DeleteRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.DeleteResponse:
        _check_key(request.key)
        return kvstore_pb2.DeleteResponse(deleted=await self._store.delete(request.key))

    @_unary
    async def Stats(
        self, request: kvstore_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.StatsResponse:
        stats = self._store.stats()
        response = kvstore_pb2.StatsResponse(
            memory=_tier_pb(stats.memory), put_checksum_failures=stats.put_checksum_failures
        )
        if stats.disk is not None:
            response.disk.CopyFrom(_tier_pb(stats.disk))
        if stats.redis is not None:
            response.redis.CopyFrom(_tier_pb(stats.redis))
        return response


_UNAUTHENTICATED = "missing or invalid bearer token in 'authorization' metadata"


async def _deny_unary(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _UNAUTHENTICATED)


async def _deny_streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _UNAUTHENTICATED)
    yield None  # unreachable; makes this an async generator


def _denying(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that answers UNAUTHENTICATED."""
    codecs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_deny_streaming, **codecs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_deny_unary, **codecs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_deny_streaming, **codecs)
    return grpc.unary_unary_rpc_method_handler(_deny_unary, **codecs)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Requires ``authorization: Bearer <token>`` on the KvStore RPCs only."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()
        self._prefix = f"/{SERVICE_NAME}/"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self._prefix):
            return handler
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization" and isinstance(value, str):
                if hmac.compare_digest(value.encode(), self._expected):
                    return handler
                break
        return _denying(handler)


class RunningServer:
    """A started kvstore server; ``port`` is the bound port."""

    def __init__(
        self,
        server: grpc.aio.Server,
        health_servicer: health.aio.HealthServicer,
        store: BlobStore,
        port: int,
        grace_s: float,
    ) -> None:
        self.server = server
        self.store = store
        self.port = port
        self._health = health_servicer
        self._grace_s = grace_s
        self._stopped = False

    async def stop(self, grace_s: float | None = None) -> None:
        """Report NOT_SERVING, then let in-flight RPCs finish for ``grace_s``. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        await self._health.enter_graceful_shutdown()
        await self.server.stop(self._grace_s if grace_s is None else grace_s)
        await self.store.close()
        log.info("kvstore stopped", port=self.port)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


async def start_server(config: KvStoreConfig) -> RunningServer:
    """Open the store (re-indexing the disk tier), bind and start serving."""
    disk = DiskTier(config.disk_dir, config.disk_bytes) if config.disk_dir else None
    redis = RedisTier(config.redis) if config.redis else None
    store = BlobStore(MemoryTier(config.memory_bytes), disk, redis)
    await store.open()

    interceptors: list[grpc.aio.ServerInterceptor] = [TolerantDecoding((SERVICE_NAME,))]
    if config.auth_token:
        interceptors.append(BearerTokenInterceptor(config.auth_token))
    server = grpc.aio.server(
        interceptors=interceptors,
        options=list(CHANNEL_OPTIONS),
        compression=grpc.Compression.NoCompression,
    )
    kvstore_pb2_grpc.add_KvStoreServicer_to_server(
        KvStoreServicer(store, config.max_blob_bytes), server
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection(
        (
            kvstore_pb2.DESCRIPTOR.services_by_name["KvStore"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        ),
        server,
    )
    host = (
        f"[{config.host}]"
        if ":" in config.host and not config.host.startswith("[")
        else (config.host)
    )
    address = f"{host}:{config.port}"
    if config.tls_cert_file and config.tls_key_file:
        credentials = server_credentials(
            config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file
        )
        port = server.add_secure_port(address, credentials)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"could not bind {host}:{config.port}")
    if config.insecure:
        log.warning(
            "kvstore is insecure: KvStore RPCs need no token, so any client that can "
            "connect may read and overwrite KV chunks and session records",
            port=port,
        )
    await server.start()
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "kvstore serving",
        host=config.host,
        port=port,
        memory_bytes=config.memory_bytes,
        disk_dir=config.disk_dir,
        disk_bytes=config.disk_bytes if disk else 0,
        auth=bool(config.auth_token),
        tls=bool(config.tls_cert_file),
        mtls=bool(config.tls_client_ca_file),
        redis=config.redis.address if config.redis else None,
        redis_cluster=bool(config.redis and config.redis.is_cluster),
        redis_ttl_s=config.redis.ttl_s if config.redis else None,
        redis_split_bytes=config.redis.split_bytes if config.redis else None,
    )
    return RunningServer(server, health_servicer, store, port, config.grace_s)


async def serve(config: KvStoreConfig, stop: asyncio.Event) -> None:
    """Serve until ``stop`` is set, then shut down gracefully."""
    running = await start_server(config)
    try:
        await stop.wait()
    finally:
        await running.stop()
