"""Store statistics as plain values, shared by the server, its tiers and clients."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TierStats:
    """One storage tier; counters run since the server started."""

    entries: int  # blobs held now
    size_bytes: int  # sum of their sizes
    capacity_bytes: int  # bound on size_bytes (LRU eviction keeps under it)
    hits: int  # Gets this tier served
    misses: int  # Gets that reached this tier and found nothing usable
    evictions: int  # blobs removed to make room
    checksum_failures: int  # corrupt copies found and dropped
    # Operations that failed (Redis: refused, timeout, cluster down; each a
    # miss for reads, a write kept only locally); always 0 for memory and disk.
    errors: int = 0


@dataclass(frozen=True)
class StoreStats:
    """The whole store: the memory tier and, when configured, the disk and Redis tiers."""

    memory: TierStats
    disk: TierStats | None
    put_checksum_failures: int  # Put streams refused with DATA_LOSS
    redis: TierStats | None = None


@dataclass(frozen=True)
class PutResult:
    """Where a Put went."""

    already_present: bool  # key existed and replace was not asked: nothing stored
    stored_in_memory: bool
    stored_on_disk: bool
