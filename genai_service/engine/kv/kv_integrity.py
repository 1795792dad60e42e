"""Keyed MACs on everything the engine stores in the kvstore (docs/design.md,
"KV integrity").

The kvstore holds opaque bytes that any data-plane client can write, and a
blob's own checksum (``kvstore.checksum``) is computed by its writer: it catches
bit rot, not a forger. So the connector seals every KV chunk and session
record it writes, ``sealed = data ‖ tag`` with::

    tag = blake2b(len(key) as uint32 LE ‖ key ‖ data, key=mac_key, digest_size=32)

under a secret shared by the replicas that trust each other
(``genai-server --kv-integrity-key-file``). The store key is part of the MAC,
so a sealed blob cannot be replayed under another key. A reader opens (checks)
before use; a blob that does not open is a miss, never KV or a session.

Subkeys are derived from the secret per purpose (blake2b personalisation):
the MAC key, and ``key_id``, which is folded into chunk-key namespaces and
session record keys, so replicas with different secrets use disjoint keys and
an outsider cannot compute them. Neither is ever stored or logged.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from genai_common.credentials import MIN_SECRET_BYTES

TAG_BYTES = 32
KEY_ID_BYTES = 16

Buffer = bytes | bytearray | memoryview


class IntegrityError(ValueError):
    """A blob whose MAC does not verify: forged, replayed under another key,
    written under another secret, or not sealed at all."""


def _subkey(secret: bytes, purpose: bytes, size: int) -> bytes:
    return hashlib.blake2b(secret, digest_size=size, person=purpose).digest()


class KvIntegrity:
    """Seals and opens kvstore blobs under one secret (at least 32 bytes)."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(
                f"kv integrity secret is {len(secret)} bytes; at least {MIN_SECRET_BYTES} "
                "are required"
            )
        self._mac_key = _subkey(secret, b"genai-kv-mac", 32)
        self.key_id = _subkey(secret, b"genai-kv-id", KEY_ID_BYTES)

    @classmethod
    def generate(cls) -> KvIntegrity:
        """A random secret: this instance trusts only blobs it sealed itself."""
        return cls(secrets.token_bytes(MIN_SECRET_BYTES))

    def __repr__(self) -> str:
        return "KvIntegrity(<secret>)"

    def tag(self, key: bytes, data: Buffer) -> bytes:
        mac = hashlib.blake2b(key=self._mac_key, digest_size=TAG_BYTES)
        mac.update(len(key).to_bytes(4, "little"))
        mac.update(key)
        mac.update(data)
        return mac.digest()

    def seal(self, key: bytes, data: Buffer) -> bytes:
        """``data`` with its tag appended, to be stored under ``key``."""
        return bytes(data) + self.tag(key, data)

    def open(self, key: bytes, sealed: Buffer) -> memoryview:
        """The data of a blob read from under ``key`` (a view, no copy); raises
        ``IntegrityError`` unless this secret sealed it for that key."""
        view = memoryview(sealed)
        if len(view) < TAG_BYTES:
            raise IntegrityError(f"blob of {len(view)} bytes is shorter than its MAC")
        data, tag = view[:-TAG_BYTES], view[-TAG_BYTES:]
        if not hmac.compare_digest(self.tag(key, data), tag):
            raise IntegrityError("blob MAC does not verify: not written under this secret")
        return data
