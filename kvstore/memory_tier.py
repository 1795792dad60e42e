"""Memory tier: blobs in a dict, bounded in bytes, least recently used evicted first."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvstore.stats import TierStats


@dataclass(frozen=True, slots=True)
class StoredBlob:
    """An immutable blob and the blake2b digest it was stored with."""

    data: bytes
    checksum: bytes  # 16 or 32 bytes; its length is the digest_size


class MemoryTier:
    """LRU map from key to blob, bounded by the sum of blob sizes.

    Every method is synchronous and is called from the event loop only, so
    each one is atomic with respect to other RPCs; no lock is needed.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._blobs: OrderedDict[bytes, StoredBlob] = OrderedDict()  # oldest first
        self._size_bytes = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self._blobs

    def fits(self, size_bytes: int) -> bool:
        """Whether a blob of this size can be held at all (after evicting everything)."""
        return size_bytes <= self.capacity_bytes

    def touch(self, key: bytes) -> bool:
        """Mark ``key`` recently used; False when absent. Not counted as a hit."""
        if key not in self._blobs:
            return False
        self._blobs.move_to_end(key)
        return True

    def get(self, key: bytes) -> StoredBlob | None:
        blob = self._blobs.get(key)
        if blob is None:
            self._misses += 1
            return None
        self._blobs.move_to_end(key)
        self._hits += 1
        return blob

    def put(self, key: bytes, blob: StoredBlob, replace: bool = False) -> bool:
        """Store ``blob``, evicting LRU blobs to make room; False when it can never fit.

        A present key keeps its blob unless ``replace``; a replaced blob is
        swapped in one step (no moment without either).
        """
        if key in self._blobs and not replace:
            self._blobs.move_to_end(key)
            return True
        size = len(blob.data)
        if not self.fits(size):
            return False
        old = self._blobs.pop(key, None)
        if old is not None:
            self._size_bytes -= len(old.data)
        while self._size_bytes + size > self.capacity_bytes:
            _, evicted = self._blobs.popitem(last=False)
            self._size_bytes -= len(evicted.data)
            self._evictions += 1
        self._blobs[key] = blob
        self._size_bytes += size
        return True

    def delete(self, key: bytes) -> bool:
        blob = self._blobs.pop(key, None)
        if blob is None:
            return False
        self._size_bytes -= len(blob.data)
        return True

    def stats(self) -> TierStats:
        return TierStats(
            entries=len(self._blobs),
            size_bytes=self._size_bytes,
            capacity_bytes=self.capacity_bytes,
            hits=self._hits,
            misses=self._misses,
            evictions=self._evictions,
            checksum_failures=0,  # blobs are verified on Put; memory is trusted
        )
