"""Blob checksums: the one place the data plane hashes a blob (docs/design.md,
"KV chunk contract").

A blob's checksum is its blake2b digest, 16 or 32 bytes long (the length says
which digest size). The writer computes it and sends it in the Put header; the
server checks it as the frames arrive, the disk tier keeps it beside the blob
and checks it on start-up and on every read, and the client checks it on Get.
It catches rot and truncation, not forgery: that is the engine's MAC
(``genai_service/engine/kv/kv_integrity.py``).
"""

from __future__ import annotations

import hashlib

DIGEST_SIZES = (16, 32)


class ChecksumError(ValueError):
    """Bytes whose checksum does not match them."""


def checksum(data: bytes | bytearray | memoryview, digest_size: int = 16) -> bytes:
    """blake2b digest of ``data``; ``digest_size`` is 16 or 32 bytes."""
    return hasher(digest_size, data).digest()


def verify_checksum(data: bytes | bytearray | memoryview, expected: bytes) -> bool:
    """True when ``expected`` (16 or 32 bytes) is the checksum of ``data``."""
    if len(expected) not in DIGEST_SIZES:
        return False
    return checksum(data, len(expected)) == expected


def hasher(digest_size: int, data: bytes | bytearray | memoryview = b"") -> hashlib.blake2b:
    """An incremental checksum (``update``, then ``digest``), for a blob that
    arrives or is read in pieces; ``digest_size`` is 16 or 32 bytes."""
    if digest_size not in DIGEST_SIZES:
        raise ValueError(f"digest_size must be 16 or 32, got {digest_size}")
    return hashlib.blake2b(data, digest_size=digest_size)
