"""Redis tier: Redis or Redis Cluster as the shared tier behind memory and disk.

See docs/design.md, "Redis tier". One Redis value per blob (the kvstore's key
in hex after ``key_prefix``, so no key ever holds a hash tag and a session's
chunks spread over the shards), laid out little-endian::

    "<4sBBBxIQ"  magic b"GKVR", format version, checksum length, flags (bit 0:
                 mutable, written with replace), pad, part count (0: the blob
                 follows inline), blob size in bytes               (20 bytes)
    checksum   checksum length bytes: blake2b of the whole blob
    inline:    the blob
    split:     an 8-byte nonce; the blob is in ``part count`` values named
               "<prefix><key hex>:<nonce hex>:<i>", ``split_bytes`` each (the last shorter)

A blob above ``split_bytes`` is split because one large value holds Redis's
single thread for its whole copy (measured in the design section). The head is
written last and in one SET, so a reader sees the old blob or the new one; the
nonce keeps a replacement's parts apart from the parts a reader of the old head
is fetching. Every read is verified against the checksum; a value that fails,
or whose parts are gone (evicted), is a miss, counted, and its head is removed
only if it is still the value that was read.

Every Redis failure (refused, timeout, MOVED storm, cluster down) is a miss for
reads and a counted error for writes, never an exception to the caller, and
every operation is bounded by ``timeout_ms``.
"""

from __future__ import annotations

import asyncio
import os
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import structlog
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException, RedisError
from redis.retry import Retry

from genai_common.errors import Unavailable
from genai_common.flags import flag, parse_bytes
from kvstore.checksum import DIGEST_SIZES, verify_checksum
from kvstore.memory_tier import StoredBlob
from kvstore.stats import TierStats

log = structlog.get_logger(__name__)

# Where genai-kvstore reads the Redis url and password when no flag gives them
# (a url with a password in argv is visible to ps).
REDIS_URL_ENV = "GENAI_KVSTORE_REDIS_URL"
REDIS_PASSWORD_ENV = "GENAI_KVSTORE_REDIS_PASSWORD"

_MAGIC = b"GKVR"
_VERSION = 1
_HEADER = struct.Struct("<4sBBBxIQ")
_MUTABLE = 1  # flags bit: a record Put with replace, which other kvstores may change
_NONCE_BYTES = 8
_SCHEMES = {"redis": False, "rediss": False, "redis+cluster": True, "rediss+cluster": True}
_ERROR_LOG_INTERVAL_S = 5.0
# Deletes the head only while it still holds the value a reader found bad,
# so a replacement that landed meanwhile survives.
_DELETE_IF_EQUAL = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
)

# What a Redis operation may raise that means "Redis failed", not "bug here"
# (RedisClusterException, e.g. no reachable node, is not a RedisError).
_FAILURES = (RedisError, RedisClusterException, OSError, TimeoutError)

_T = TypeVar("_T")


@dataclass(frozen=True)
class RedisConfig:
    """The shared Redis tier (``genai-kvstore --redis`` and the ``--redis-*`` flags)."""

    # redis://, rediss:// (TLS); redis+cluster:// or rediss+cluster:// for a
    # Redis Cluster (any node's address: the rest are discovered). May hold a
    # password (redis://:PASSWORD@host:port), so it is never logged.
    url: str = field(repr=False)
    cluster: bool = flag(False, help="the url is a Redis Cluster node")  # whatever the scheme
    password: str | None = field(default=None, repr=False)  # overrides the URL's; a secret
    ttl_s: int = flag(
        0,
        help="expiry of every value written to Redis, 0 for none: then Redis's "
        "maxmemory-policy (allkeys-lru) evicts",
    )
    timeout_ms: int = flag(  # connect, all round trips, all parts
        500, help="bound on one Redis operation; slower is a miss"
    )
    split_bytes: int = flag(
        1 << 20, help="blobs above this are stored as parts of this size", parse=parse_bytes
    )
    key_prefix: str = flag("genai:kv:", help="prefix of every Redis key")
    tls_ca_file: str | None = flag(  # default: the system's CAs
        None, help="rediss:// CA", metavar="PEM"
    )
    tls_cert_file: str | None = flag(  # for a Redis requiring mTLS
        None, help="rediss:// client cert", metavar="PEM"
    )
    tls_key_file: str | None = flag(None, help=None, metavar="PEM")
    max_connections: int = 64  # per Redis node

    def __post_init__(self) -> None:
        scheme = urlsplit(self.url).scheme
        if scheme not in _SCHEMES:
            raise ValueError(
                f"redis url scheme must be one of {', '.join(_SCHEMES)}, got {scheme!r}"
            )
        if self.password is not None and not self.password:
            raise ValueError("redis password must not be empty when set")
        if self.ttl_s < 0:
            raise ValueError(f"redis ttl_s must be >= 0, got {self.ttl_s}")
        if self.timeout_ms <= 0:
            raise ValueError(f"redis timeout_ms must be > 0, got {self.timeout_ms}")
        if self.split_bytes < 4096:
            raise ValueError(f"redis split_bytes must be >= 4096, got {self.split_bytes}")
        if "{" in self.key_prefix or "}" in self.key_prefix:
            raise ValueError("redis key_prefix must not contain '{' or '}' (hash tags)")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("redis tls_cert_file and tls_key_file go together")
        if (self.tls_ca_file or self.tls_cert_file) and not self.tls:
            raise ValueError("redis TLS files need a rediss:// url")
        if self.max_connections <= 0:
            raise ValueError(f"redis max_connections must be > 0, got {self.max_connections}")

    @property
    def is_cluster(self) -> bool:
        return self.cluster or _SCHEMES[urlsplit(self.url).scheme]

    @property
    def tls(self) -> bool:
        return urlsplit(self.url).scheme.startswith("rediss")

    @property
    def client_url(self) -> str:
        """The url redis-py understands (without "+cluster")."""
        parts = urlsplit(self.url)
        return urlunsplit(parts._replace(scheme=parts.scheme.removesuffix("+cluster")))

    @property
    def address(self) -> str:
        """host:port, for logs (no credentials)."""
        parts = urlsplit(self.url)
        return f"{parts.hostname}:{parts.port or 6379}"


def connect(config: RedisConfig) -> Redis | RedisCluster:
    """A client for ``config``; it connects lazily, on its first command."""
    timeout_s = config.timeout_ms / 1000
    kwargs: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "max_connections": config.max_connections,
        # No retries: the caller's miss is cheaper than a retry that outlives the timeout.
        "retry": Retry(NoBackoff(), 0),
    }
    if config.password is not None:
        kwargs["password"] = config.password
    if config.tls:
        kwargs.update(
            ssl_ca_certs=config.tls_ca_file,
            ssl_certfile=config.tls_cert_file,
            ssl_keyfile=config.tls_key_file,
        )
    if config.is_cluster:
        # A cache serves the slots it still has when a shard is gone.
        return RedisCluster.from_url(config.client_url, require_full_coverage=False, **kwargs)
    return Redis.from_url(config.client_url, **kwargs)


def encode_head(blob: StoredBlob, parts: int, mutable: bool, nonce: bytes = b"") -> bytes:
    flags = _MUTABLE if mutable else 0
    header = _HEADER.pack(_MAGIC, _VERSION, len(blob.checksum), flags, parts, len(blob.data))
    return header + blob.checksum + (nonce if parts else blob.data)


class CorruptValue(Exception):
    """A Redis value that is not a head of this format."""


@dataclass(frozen=True, slots=True)
class RedisBlob:
    """A verified blob read from Redis."""

    blob: StoredBlob
    mutable: bool  # written with replace: another kvstore may change it


def decode_head(value: bytes) -> tuple[bytes, int, int, bytes, bool]:
    """(checksum, part count, blob size, inline blob or nonce, mutable) of a head value."""
    if len(value) < _HEADER.size:
        raise CorruptValue("truncated header")
    magic, version, checksum_len, flags, parts, size = _HEADER.unpack_from(value)
    if magic != _MAGIC or version != _VERSION or checksum_len not in DIGEST_SIZES:
        raise CorruptValue("bad header")
    start = _HEADER.size + checksum_len
    checksum, rest = value[_HEADER.size : start], value[start:]
    if len(checksum) != checksum_len:
        raise CorruptValue("truncated checksum")
    if parts == 0 and len(rest) != size:
        raise CorruptValue(f"inline blob is {len(rest)} bytes, header says {size}")
    if parts and len(rest) != _NONCE_BYTES:
        raise CorruptValue("bad nonce")
    return checksum, parts, size, rest, bool(flags & _MUTABLE)


class RedisTier:
    """The Redis tier's reads and writes, on the kvstore's event loop."""

    def __init__(self, config: RedisConfig, client: Redis | RedisCluster | None = None) -> None:
        self.config = config
        self._client = client if client is not None else connect(config)
        self._timeout_s = config.timeout_ms / 1000
        self._hits = 0
        self._misses = 0
        self._errors = 0
        self._checksum_failures = 0
        self._errors_logged = 0
        self._last_error_log = -_ERROR_LOG_INTERVAL_S

    async def close(self) -> None:
        try:
            await self._client.aclose()
        except _FAILURES as exc:  # closing a dead connection
            log.debug("redis close failed", error=str(exc))

    def name(self, key: bytes) -> bytes:
        """The Redis key of a blob: prefix + hex (no braces, so no hash tag)."""
        return self.config.key_prefix.encode() + key.hex().encode()

    def _part_name(self, key: bytes, nonce: bytes, index: int) -> bytes:
        return self.name(key) + b":" + nonce.hex().encode() + b":%d" % index

    def _error(self, op: str, exc: BaseException) -> None:
        """Count a Redis failure; log it, at most once per interval (with the count since)."""
        self._errors += 1
        now = time.monotonic()
        if now - self._last_error_log >= _ERROR_LOG_INTERVAL_S:
            log.warning(
                "redis tier error (a miss for reads; writes kept in the local tiers only)",
                op=op,
                error=f"{type(exc).__name__}: {exc}",
                redis=self.config.address,
                errors_since_last_log=self._errors - self._errors_logged,
            )
            self._last_error_log = now
            self._errors_logged = self._errors

    async def _bounded(self, op: str, call: Callable[[], Awaitable[_T]]) -> tuple[bool, _T | None]:
        """(True, result), or (False, None) after counting a failure or a timeout."""
        try:
            async with asyncio.timeout(self._timeout_s):
                return True, await call()
        except _FAILURES as exc:
            self._error(op, exc)
            return False, None

    # Lookup ---------------------------------------------------------------

    async def lookup(self, keys: list[bytes]) -> int:
        """How many leading ``keys`` have a head in Redis (TOUCHed: recently used).

        One pipeline per shard, sent concurrently: one round trip per shard
        holding any of the keys. A key on a shard that fails counts as absent.
        """
        if not keys:
            return 0
        present = await self._touch_many([self.name(key) for key in keys])
        for count, found in enumerate(present):
            if not found:
                return count
        return len(keys)

    async def _touch_many(self, names: list[bytes]) -> list[bool]:
        touched: list[Any] = [0] * len(names)  # a shard that fails: absent
        await self._bounded(
            "lookup",
            lambda: self._per_shard(names, lambda pipe, i: pipe.touch(names[i]), touched, "lookup"),
        )
        return [bool(t) for t in touched]

    async def _per_shard(
        self,
        names: list[bytes],
        command: Callable[[Any, int], Any],
        results: list[Any] | None = None,
        tolerate: str | None = None,
    ) -> None:
        """``command(pipeline, i)`` for each of ``names``, one pipeline per
        shard, the shards concurrently; each reply lands in ``results[i]`` as
        its shard answers. With ``tolerate`` (the operation's name), a shard
        that fails is counted and leaves its results as they were, instead of
        failing the whole call."""

        async def run(indices: list[int]) -> None:
            pipe = self._client.pipeline(transaction=False)
            for i in indices:
                command(pipe, i)
            replies = await pipe.execute()
            if results is not None:
                for i, reply in zip(indices, replies, strict=True):
                    results[i] = reply

        groups = await self._by_node(names)
        outcomes = await asyncio.gather(
            *(run(indices) for indices in groups), return_exceptions=tolerate is not None
        )
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, _FAILURES):
                    raise outcome
                self._error(tolerate or "", outcome)

    async def _by_node(self, names: list[bytes]) -> list[list[int]]:
        """Indices of ``names`` grouped by the shard that owns them (one group
        when not a cluster). The cluster client's own pipeline would group them
        too, but fails every group when one shard is down."""
        client = self._client
        if not isinstance(client, RedisCluster):
            return [list(range(len(names)))]
        await client.initialize()  # a no-op once the slot map is known
        groups: dict[str, list[int]] = {}
        for i, name in enumerate(names):
            node = client.get_node_from_key(name)  # type: ignore[arg-type]  # bytes are keys too
            groups.setdefault(node.name if node is not None else "", []).append(i)
        return list(groups.values())

    # Get ------------------------------------------------------------------

    async def get(self, key: bytes) -> RedisBlob | None:
        """The verified blob, or None (a miss: absent, evicted or corrupt);
        ``Unavailable`` when Redis did not answer, so that a reader can tell
        "not stored" from "cannot tell now" (a session record: UNAVAILABLE to
        the client, not NOT_FOUND; a chunk: a miss either way)."""
        name = self.name(key)
        ok, head = await self._bounded("get", lambda: self._client.get(name))
        if not ok:
            self._misses += 1
            raise Unavailable(f"key {key.hex()}: Redis did not answer; retry shortly")
        if not isinstance(head, bytes):  # None: absent (values are bytes: no decoding)
            self._misses += 1
            return None
        try:
            checksum, parts, size, rest, mutable = decode_head(head)
            data = rest if parts == 0 else await self._get_parts(key, rest, parts)
        except CorruptValue as exc:
            await self._drop(name, head, f"corrupt value: {exc}")
            return None
        except _PartsFailed:
            self._misses += 1
            raise Unavailable(f"key {key.hex()}: Redis did not answer; retry shortly") from None
        if data is None:
            await self._drop(name, head, "parts evicted", corrupt=False)
            return None
        if len(data) != size or not verify_checksum(data, checksum):
            await self._drop(name, head, "checksum mismatch")
            return None
        self._hits += 1
        return RedisBlob(StoredBlob(data, checksum), mutable)

    async def _get_parts(self, key: bytes, nonce: bytes, parts: int) -> bytes | None:
        """The joined parts, None when one is missing; _PartsFailed on a Redis error."""
        names = [self._part_name(key, nonce, i) for i in range(parts)]
        values: list[bytes | None] = [None] * parts

        def run() -> Awaitable[None]:
            return self._per_shard(names, lambda pipe, i: pipe.get(names[i]), values)

        ok, _ = await self._bounded("get", run)
        if not ok:
            raise _PartsFailed
        if any(value is None for value in values):
            return None
        return b"".join(v for v in values if v is not None)

    async def _drop(self, name: bytes, head: bytes, reason: str, corrupt: bool = True) -> None:
        """Count a bad value as a miss and remove its head if nothing replaced it."""
        self._misses += 1
        if corrupt:
            self._checksum_failures += 1
        log.warning("dropping bad redis value", key=name.decode(), reason=reason)
        await self._bounded("drop", lambda: self._client.eval(_DELETE_IF_EQUAL, 1, name, head))
        return None

    # Put / Delete ---------------------------------------------------------

    async def put(self, key: bytes, blob: StoredBlob, replace: bool = False) -> bool:
        """Write ``blob`` (keeping a present one unless ``replace``); False on a failure.

        Parts first, the head last in one SET (NX unless replacing), so a
        reader never finds a head whose parts are not written yet.
        """
        name = self.name(key)
        ttl = self.config.ttl_s or None
        if len(blob.data) <= self.config.split_bytes:
            # A replacement reads the old head back (SET ... GET) to remove its parts.
            ok, old = await self._bounded(
                "put",
                lambda: self._client.set(
                    name, encode_head(blob, 0, replace), ex=ttl, nx=not replace, get=replace
                ),
            )
        else:
            ok, old = await self._put_split(key, name, blob, replace, ttl)
        if ok and replace and isinstance(old, bytes):
            await self._delete_old_parts(key, old)
        return ok

    async def _put_split(
        self, key: bytes, name: bytes, blob: StoredBlob, replace: bool, ttl: int | None
    ) -> tuple[bool, Any]:
        split = self.config.split_bytes
        if not replace:
            ok, exists = await self._bounded("put", lambda: self._client.exists(name))
            if not ok or exists:  # content-addressed: a stored blob is the same one
                return ok, None
        nonce = os.urandom(_NONCE_BYTES)
        count = -(-len(blob.data) // split)
        part_names = [self._part_name(key, nonce, i) for i in range(count)]
        view = memoryview(blob.data)

        def write_part(pipe: Any, i: int) -> Any:
            return pipe.set(part_names[i], bytes(view[i * split : (i + 1) * split]), ex=ttl)

        async def write() -> Any:
            await self._per_shard(part_names, write_part)
            head = encode_head(blob, count, replace, nonce)
            if replace:
                return await self._client.set(name, head, ex=ttl, get=True)
            if not await self._client.set(name, head, ex=ttl, nx=True):
                await self._delete_names(part_names)  # a concurrent Put won
            return None

        return await self._bounded("put", write)

    async def _delete_names(self, names: list[bytes]) -> None:
        await self._per_shard(names, lambda pipe, i: pipe.delete(names[i]))

    async def _delete_old_parts(self, key: bytes, old_head: bytes) -> None:
        try:
            _, parts, _, nonce, _ = decode_head(old_head)
        except CorruptValue:
            return
        if parts:
            names = [self._part_name(key, nonce, i) for i in range(parts)]
            await self._bounded("delete", lambda: self._delete_names(names))

    async def delete(self, key: bytes) -> bool:
        """Remove the blob (head, then its parts); False when absent or on a failure."""
        name = self.name(key)
        ok, old = await self._bounded("delete", lambda: self._client.getdel(name))
        if not ok or not isinstance(old, bytes):
            return False
        await self._delete_old_parts(key, old)
        return True

    def stats(self) -> TierStats:
        # Occupancy is Redis's to report (INFO memory, DBSIZE); this kvstore
        # knows only what it asked.
        return TierStats(
            entries=0,
            size_bytes=0,
            capacity_bytes=0,
            hits=self._hits,
            misses=self._misses,
            evictions=0,
            checksum_failures=self._checksum_failures,
            errors=self._errors,
        )


class _PartsFailed(Exception):
    """Fetching a split blob's parts failed (already counted)."""
