"""The tiered blob store behind the KvStore servicer: memory first, disk behind it.

Puts write through to both tiers (memory for speed, disk for restarts), so
memory evictions simply forget. A disk hit is promoted to memory. A Put of a
present key, or of a key another Put is storing right now, changes nothing,
unless it asks to replace: replacements of one key are serialised, and each
tier swaps the blob in one step, so a Get sees the old blob or the new one.
"""

from __future__ import annotations

import asyncio

import structlog

from genai_common.errors import Internal, ResourceExhausted
from kvstore.disk_tier import DiskTier
from kvstore.memory_tier import MemoryTier, StoredBlob
from kvstore.stats import PutResult, StoreStats

log = structlog.get_logger(__name__)


class BlobStore:
    """Memory tier plus optional disk tier. Used from one event loop."""

    def __init__(self, memory: MemoryTier, disk: DiskTier | None = None) -> None:
        self.memory = memory
        self.disk = disk
        self._storing: set[bytes] = set()  # keys whose Put is between check and commit
        # One replacement of a key at a time: its lock and how many Puts use it.
        self._replacing: dict[bytes, tuple[asyncio.Lock, int]] = {}
        self.put_checksum_failures = 0

    async def open(self) -> None:
        """Re-index the disk tier, if any."""
        if self.disk is not None:
            await self.disk.open()

    def contains(self, key: bytes) -> bool:
        return key in self.memory or (self.disk is not None and key in self.disk)

    def lookup(self, keys: list[bytes]) -> int:
        """How many leading ``keys`` are present; present ones become recently used."""
        for count, key in enumerate(keys):
            if not (self.memory.touch(key) or (self.disk is not None and self.disk.touch(key))):
                return count
        return len(keys)

    async def get(self, key: bytes) -> StoredBlob | None:
        blob = self.memory.get(key)
        if blob is not None or self.disk is None:
            return blob
        blob = await self.disk.get(key)
        if blob is not None:
            self.memory.put(key, blob)  # promotion; a blob too large for memory stays on disk
        return blob

    def check_fits(self, size_bytes: int) -> None:
        """Raise ResourceExhausted when no tier could ever hold ``size_bytes``."""
        if self.memory.fits(size_bytes) or (self.disk is not None and self.disk.fits(size_bytes)):
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
        if disk_error is not None and not in_memory:
            raise Internal(f"disk tier write failed: {disk_error}") from disk_error
        return PutResult(already_present=False, stored_in_memory=in_memory, stored_on_disk=on_disk)

    async def delete(self, key: bytes) -> bool:
        in_memory = self.memory.delete(key)
        on_disk = self.disk is not None and await self.disk.delete(key)
        return in_memory or on_disk

    def stats(self) -> StoreStats:
        return StoreStats(
            memory=self.memory.stats(),
            disk=self.disk.stats() if self.disk is not None else None,
            put_checksum_failures=self.put_checksum_failures,
        )
