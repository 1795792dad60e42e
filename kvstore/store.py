"""The tiered blob store behind the KvStore servicer: memory first, disk behind
it, and optionally Redis (Cluster) behind both, shared with other kvstores
(docs/design.md, "Redis tier").

Puts write through to every tier (memory for speed, disk for restarts, Redis
for the other replicas), so memory evictions simply forget. A disk or Redis
hit is promoted to memory, except a record that was Put with ``replace``: with
a Redis tier such a record lives in Redis alone, since another kvstore may
replace it there (a local copy would go stale). The Redis tier fails soft: its
errors are misses and counted write failures, never the RPC's, but for a
replacement Redis did not take, which fails with UNAVAILABLE. A Put of a
present key, or of a key another Put is storing right now, changes nothing,
unless it asks to replace: replacements of one key are serialised, and each
tier swaps the blob in one step, so a Get sees the old blob or the new one.
"""

from __future__ import annotations

import asyncio

import structlog

from genai_common.errors import Internal, ResourceExhausted, Unavailable
from kvstore.disk_tier import DiskTier
from kvstore.memory_tier import MemoryTier, StoredBlob
from kvstore.redis_tier import RedisTier
from kvstore.stats import PutResult, StoreStats

log = structlog.get_logger(__name__)


class BlobStore:
    """Memory tier plus optional disk and Redis tiers. Used from one event loop."""

    def __init__(
        self, memory: MemoryTier, disk: DiskTier | None = None, redis: RedisTier | None = None
    ) -> None:
        self.memory = memory
        self.disk = disk
        self.redis = redis
        self._storing: set[bytes] = set()  # keys whose Put is between check and commit
        # One replacement of a key at a time: its lock and how many Puts use it.
        self._replacing: dict[bytes, tuple[asyncio.Lock, int]] = {}
        self.put_checksum_failures = 0

    async def open(self) -> None:
        """Re-index the disk tier, if any."""
        if self.disk is not None:
            await self.disk.open()

    async def close(self) -> None:
        if self.redis is not None:
            await self.redis.close()

    def contains(self, key: bytes) -> bool:
        """Whether a local tier (memory, disk) holds ``key``; Redis is not asked."""
        return key in self.memory or (self.disk is not None and key in self.disk)

    async def lookup(self, keys: list[bytes]) -> int:
        """How many leading ``keys`` are present; present ones become recently used.

        The local tiers answer first; the keys from the first one they lack
        on go to Redis in one pipelined round trip per shard.
        """
        for count, key in enumerate(keys):
            if not (self.memory.touch(key) or (self.disk is not None and self.disk.touch(key))):
                if self.redis is None:
                    return count
                return count + await self.redis.lookup(keys[count:])
        return len(keys)

    async def get(self, key: bytes) -> StoredBlob | None:
        blob = self.memory.get(key)
        if blob is not None:
            return blob
        if self.disk is not None:
            blob = await self.disk.get(key)
        if blob is None and self.redis is not None:
            shared = await self.redis.get(key)
            if shared is None:
                return None
            if shared.mutable:
                return shared.blob  # Redis's copy is the one other kvstores replace
            blob = shared.blob
        if blob is not None:
            self.memory.put(key, blob)  # promotion; a blob too large for memory is not kept
        return blob

    def check_fits(self, size_bytes: int) -> None:
        """Raise ResourceExhausted when no tier could ever hold ``size_bytes``."""
        if (
            self.memory.fits(size_bytes)
            or (self.disk is not None and self.disk.fits(size_bytes))
            or self.redis is not None  # bounded by Redis's maxmemory, not by us
        ):
            return
        capacity = max(self.memory.capacity_bytes, self.disk.capacity_bytes if self.disk else 0)
        raise ResourceExhausted(
            f"blob of {size_bytes} bytes exceeds every tier's capacity (largest: {capacity} bytes)"
        )

    async def put(self, key: bytes, blob: StoredBlob, replace: bool = False) -> PutResult:
        """Store a verified blob in every tier it fits in (over the stored one
        when ``replace``)."""
        if replace:
            lock, users = self._replacing.get(key, (asyncio.Lock(), 0))
            self._replacing[key] = (lock, users + 1)
            try:
                async with lock:
                    return await self._put(key, blob, replace=True)
            finally:
                lock, users = self._replacing[key]
                if users > 1:
                    self._replacing[key] = (lock, users - 1)
                else:
                    del self._replacing[key]
        if self.contains(key) or key in self._storing:
            return PutResult(already_present=True, stored_in_memory=False, stored_on_disk=False)
        self._storing.add(key)
        try:
            return await self._put(key, blob, replace=False)
        finally:
            self._storing.discard(key)

    async def _put(self, key: bytes, blob: StoredBlob, replace: bool) -> PutResult:
        self.check_fits(len(blob.data))
        in_memory = self.memory.put(key, blob, replace=replace)
        on_disk = False
        disk_error: OSError | None = None
        if self.disk is not None:
            try:
                on_disk = await self.disk.put(key, blob, replace=replace)
            except OSError as exc:
                log.error("disk tier write failed", key=key.hex(), error=str(exc))
                disk_error = exc
        if replace:
            # A tier that did not take the new blob (too large for it, or a
            # failed write) must not keep serving, or resurface, the old one.
            if not in_memory:
                self.memory.delete(key)
            if not on_disk and self.disk is not None:
                await self.disk.delete(key)
        # Write-through: when the Put answers, other kvstores sharing the
        # Redis tier find the blob (a session record must have landed before
        # its turn's answer goes out; docs/design.md, "Sessions").
        in_redis = self.redis is not None and await self.redis.put(key, blob, replace=replace)
        if replace and self.redis is not None:
            # Keep the record in Redis alone (see the module docstring). One
            # Redis did not take is kept nowhere and the Put fails: a copy
            # kept here would be served over the newer ones other kvstores
            # write to Redis once it is back.
            in_memory = False
            self.memory.delete(key)
            if self.disk is not None and on_disk:
                await self.disk.delete(key)
                on_disk = False
            if not in_redis:
                raise Unavailable(
                    f"redis tier: the replacement of {key.hex()[:32]} was not stored; retry"
                )
        if disk_error is not None and not in_memory and not in_redis:
            raise Internal(f"disk tier write failed: {disk_error}") from disk_error
        return PutResult(already_present=False, stored_in_memory=in_memory, stored_on_disk=on_disk)

    async def delete(self, key: bytes) -> bool:
        in_memory = self.memory.delete(key)
        on_disk = self.disk is not None and await self.disk.delete(key)
        in_redis = self.redis is not None and await self.redis.delete(key)
        return in_memory or on_disk or in_redis

    def stats(self) -> StoreStats:
        return StoreStats(
            memory=self.memory.stats(),
            disk=self.disk.stats() if self.disk is not None else None,
            put_checksum_failures=self.put_checksum_failures,
            redis=self.redis.stats() if self.redis is not None else None,
        )
