"""Disk tier: one file per blob in a directory, bounded in bytes, LRU by access time.

File layout (little-endian)::

    "<4sBBHQ"  magic b"GKVS", format version, checksum length, key length,
               blob size in bytes                                  (16 bytes)
    key        key length bytes
    checksum   checksum length bytes: blake2b of the blob (digest_size = length)
    blob       blob size bytes

A blob is written to a temporary file in the same directory, fsynced, then
renamed over its final name, so a crash leaves either the whole file or a
``*.tmp`` that the next start-up deletes. The file name is the hex of the key
(keys over 64 bytes are hashed first, to stay under the file-name limit); the
header holds the key itself, so start-up re-indexes the directory from the
files alone, verifying every checksum and deleting (and counting) corrupt
files. A file's mtime records its last access, so LRU order survives restarts.

The index lives in memory and is touched only from the event loop; file I/O
runs in worker threads (``asyncio.to_thread``). Renames and unlinks happen
under one asyncio lock, so a delete or an eviction never races a write of the
same file name.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import structlog

from kvstore.checksum import DIGEST_SIZES, hasher, verify_checksum
from kvstore.checksum import checksum as blob_checksum
from kvstore.memory_tier import StoredBlob
from kvstore.stats import TierStats

log = structlog.get_logger(__name__)

_MAGIC = b"GKVS"
_VERSION = 1
_HEADER = struct.Struct("<4sBBHQ")
_SUFFIX = ".kv"
_TMP_SUFFIX = ".tmp"
_HEX_KEY_MAX_BYTES = 64  # 128 hex characters; longer keys are hashed
_READ_CHUNK_BYTES = 1 << 20


class CorruptFileError(Exception):
    """A blob file whose header, key or checksum does not hold."""


@dataclass(frozen=True, slots=True)
class _Entry:
    size_bytes: int
    checksum: bytes


def file_name(key: bytes) -> str:
    """File name of ``key``: its hex, or "h" + blake2b-16 hex for long keys."""
    if len(key) <= _HEX_KEY_MAX_BYTES:
        return key.hex() + _SUFFIX
    return "h" + blob_checksum(key).hex() + _SUFFIX


def _read_header(f: BinaryIO, path: Path) -> tuple[bytes, bytes, int]:
    raw = f.read(_HEADER.size)
    if len(raw) != _HEADER.size:
        raise CorruptFileError(f"{path.name}: truncated header")
    magic, version, checksum_len, key_len, size = _HEADER.unpack(raw)
    if magic != _MAGIC or version != _VERSION or checksum_len not in DIGEST_SIZES:
        raise CorruptFileError(f"{path.name}: bad header")
    key = f.read(key_len)
    checksum = f.read(checksum_len)
    if len(key) != key_len or len(checksum) != checksum_len:
        raise CorruptFileError(f"{path.name}: truncated header")
    return key, checksum, size


def _scan_file(path: Path) -> tuple[bytes, _Entry]:
    """Parse and fully verify one blob file (start-up re-index), streaming the data."""
    with path.open("rb") as f:
        key, checksum, size = _read_header(f, path)
        if file_name(key) != path.name:
            raise CorruptFileError(f"{path.name}: key in header does not match the file name")
        digest = hasher(len(checksum))
        remaining = size
        while remaining:
            chunk = f.read(min(remaining, _READ_CHUNK_BYTES))
            if not chunk:
                raise CorruptFileError(f"{path.name}: truncated data")
            digest.update(chunk)
            remaining -= len(chunk)
        if f.read(1):
            raise CorruptFileError(f"{path.name}: trailing bytes")
    if digest.digest() != checksum:
        raise CorruptFileError(f"{path.name}: checksum mismatch")
    return key, _Entry(size, checksum)


def _read_blob(path: Path, key: bytes, entry: _Entry) -> StoredBlob:
    """Read and verify one blob; record the access in the file's mtime."""
    with path.open("rb") as f:
        file_key, checksum, size = _read_header(f, path)
        if file_key != key or checksum != entry.checksum or size != entry.size_bytes:
            raise CorruptFileError(f"{path.name}: header does not match the index")
        data = f.read(size)
        if len(data) != size or f.read(1):
            raise CorruptFileError(f"{path.name}: data is not {size} bytes")
    if not verify_checksum(data, checksum):
        raise CorruptFileError(f"{path.name}: checksum mismatch")
    with contextlib.suppress(OSError):  # LRU order after a restart is best effort
        os.utime(path)
    return StoredBlob(data, checksum)


def _write_temp(directory: Path, key: bytes, blob: StoredBlob) -> Path:
    tmp = directory / f".{uuid.uuid4().hex}{_TMP_SUFFIX}"
    header = _HEADER.pack(_MAGIC, _VERSION, len(blob.checksum), len(key), len(blob.data))
    try:
        with tmp.open("xb") as f:
            f.write(header + key + blob.checksum)
            f.write(blob.data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit(tmp: Path, final: Path) -> None:
    os.replace(tmp, final)  # atomic: readers see the old state or the whole file
    _fsync_dir(final.parent)


def _unlink_all(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


class DiskTier:
    """Blob files in one directory, bounded by the sum of blob sizes."""

    def __init__(self, directory: str | os.PathLike[str], capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._size_bytes = 0
        self._lock = asyncio.Lock()  # guards renames and unlinks
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._checksum_failures = 0

    async def open(self) -> None:
        """Create the directory if needed and re-index it, dropping corrupt files."""
        found, dropped = await asyncio.to_thread(self._scan)
        for key, entry in found:
            self._index[key] = entry
            self._size_bytes += entry.size_bytes
        self._checksum_failures += dropped
        victims = self._evict_over_capacity()
        if victims:
            await asyncio.to_thread(_unlink_all, victims)
        log.info(
            "disk tier indexed",
            directory=str(self.directory),
            entries=len(self._index),
            size_bytes=self._size_bytes,
            dropped_corrupt=dropped,
            evicted=len(victims),
        )

    def _scan(self) -> tuple[list[tuple[bytes, _Entry]], int]:
        self.directory.mkdir(parents=True, exist_ok=True)
        found: list[tuple[float, bytes, _Entry]] = []
        dropped = 0
        for item in os.scandir(self.directory):
            path = Path(item.path)
            if not item.is_file(follow_symlinks=False):
                continue
            if item.name.endswith(_TMP_SUFFIX):  # a write interrupted by a crash
                path.unlink(missing_ok=True)
                continue
            if not item.name.endswith(_SUFFIX):
                continue
            try:
                key, entry = _scan_file(path)
                found.append((item.stat().st_mtime, key, entry))
            except (CorruptFileError, OSError) as exc:
                log.warning("dropping corrupt blob file", file=item.name, reason=str(exc))
                path.unlink(missing_ok=True)
                dropped += 1
        found.sort(key=lambda t: t[0])  # oldest access first
        return [(key, entry) for _, key, entry in found], dropped

    def _path(self, key: bytes) -> Path:
        return self.directory / file_name(key)

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def fits(self, size_bytes: int) -> bool:
        return size_bytes <= self.capacity_bytes

    def touch(self, key: bytes) -> bool:
        """Mark ``key`` recently used in the index; False when absent."""
        if key not in self._index:
            return False
        self._index.move_to_end(key)
        return True

    async def get(self, key: bytes) -> StoredBlob | None:
        """The verified blob, or None when absent or corrupt (corrupt files are dropped)."""
        for attempt in range(2):
            entry = self._index.get(key)
            if entry is None:
                self._misses += 1
                return None
            self._index.move_to_end(key)
            try:
                blob = await asyncio.to_thread(_read_blob, self._path(key), key, entry)
            except FileNotFoundError:  # deleted or evicted while we were reading
                self._misses += 1
                return None
            except (CorruptFileError, OSError) as exc:
                # A replacement renames its file and updates the index under the
                # lock: once we hold it, a changed entry means we read a newer file.
                async with self._lock:
                    replaced = self._index.get(key) not in (None, entry)
                if attempt == 0 and replaced:
                    continue
                self._misses += 1
                self._checksum_failures += 1
                log.warning("dropping corrupt blob file", key=key.hex(), reason=str(exc))
                await self._drop(key, entry)
                return None
            self._hits += 1
            return blob
        return None  # unreachable: the second attempt always returns

    async def put(self, key: bytes, blob: StoredBlob, replace: bool = False) -> bool:
        """Write ``blob`` durably, evicting LRU files; False when it can never fit.

        A present key keeps its file unless ``replace``: then the new file is
        renamed over the old one, so a reader opens one or the other.
        Raises OSError when the write fails (e.g. the disk is full).
        """
        if key in self._index and not replace:
            self._index.move_to_end(key)
            return True
        if not self.fits(len(blob.data)):
            return False
        tmp = await asyncio.to_thread(_write_temp, self.directory, key, blob)
        async with self._lock:
            if key in self._index and not replace:  # a concurrent Put of the same key won
                await asyncio.to_thread(_unlink_all, [tmp])
                return True
            try:
                await asyncio.to_thread(_commit, tmp, self._path(key))
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            old = self._index.pop(key, None)
            if old is not None:
                self._size_bytes -= old.size_bytes
            self._index[key] = _Entry(len(blob.data), blob.checksum)
            self._size_bytes += len(blob.data)
            victims = self._evict_over_capacity()
            if victims:
                await asyncio.to_thread(_unlink_all, victims)
        return True

    def _evict_over_capacity(self) -> list[Path]:
        """Drop LRU entries from the index until under capacity; their paths to unlink."""
        victims: list[Path] = []
        while self._size_bytes > self.capacity_bytes and self._index:
            key, entry = self._index.popitem(last=False)
            self._size_bytes -= entry.size_bytes
            self._evictions += 1
            victims.append(self._path(key))
        return victims

    async def delete(self, key: bytes) -> bool:
        async with self._lock:
            entry = self._index.pop(key, None)
            if entry is None:
                return False
            self._size_bytes -= entry.size_bytes
            await asyncio.to_thread(_unlink_all, [self._path(key)])
        return True

    async def _drop(self, key: bytes, entry: _Entry) -> None:
        async with self._lock:
            if self._index.get(key) is not entry:
                return  # already deleted, or replaced after a delete
            del self._index[key]
            self._size_bytes -= entry.size_bytes
            await asyncio.to_thread(_unlink_all, [self._path(key)])

    def stats(self) -> TierStats:
        return TierStats(
            entries=len(self._index),
            size_bytes=self._size_bytes,
            capacity_bytes=self.capacity_bytes,
            hits=self._hits,
            misses=self._misses,
            evictions=self._evictions,
            checksum_failures=self._checksum_failures,
        )
