"""Sealing and opening kvstore blobs (genai_service/engine/kv/kv_integrity.py)."""

from __future__ import annotations

import pytest

from genai_service.engine.kv.kv_integrity import TAG_BYTES, IntegrityError, KvIntegrity

SECRET = b"a-secret-shared-by-trusting-replicas"
KEY = bytes(range(16))
DATA = b"some KV payload bytes" * 10


def test_seal_then_open_round_trips() -> None:
    ours = KvIntegrity(SECRET)
    sealed = ours.seal(KEY, DATA)
    assert len(sealed) == len(DATA) + TAG_BYTES and sealed.startswith(DATA)
    assert bytes(ours.open(KEY, sealed)) == DATA
    assert bytes(KvIntegrity(SECRET).open(KEY, sealed)) == DATA  # another replica, same secret
    assert bytes(ours.open(KEY, ours.seal(KEY, b""))) == b""


@pytest.mark.parametrize("where", ["data", "tag"])
def test_any_changed_byte_is_refused(where: str) -> None:
    ours = KvIntegrity(SECRET)
    sealed = bytearray(ours.seal(KEY, DATA))
    positions = range(len(DATA)) if where == "data" else range(len(DATA), len(sealed))
    for i in positions:
        sealed[i] ^= 0x01
        with pytest.raises(IntegrityError):
            ours.open(KEY, sealed)
        sealed[i] ^= 0x01
    assert bytes(ours.open(KEY, sealed)) == DATA


def test_a_blob_is_bound_to_its_key() -> None:
    ours = KvIntegrity(SECRET)
    sealed = ours.seal(KEY, DATA)
    for i in range(len(KEY)):
        other = bytearray(KEY)
        other[i] ^= 0x80
        with pytest.raises(IntegrityError):
            ours.open(bytes(other), sealed)  # replayed under another key
    with pytest.raises(IntegrityError):
        ours.open(KEY + b"\x00", sealed)
    # The key's length is in the MAC: moving a byte between key and data does not verify.
    with pytest.raises(IntegrityError):
        ours.open(KEY[:-1], KEY[-1:] + sealed)


def test_another_secret_or_no_seal_is_refused() -> None:
    ours, theirs = KvIntegrity(SECRET), KvIntegrity(SECRET + b"!")
    with pytest.raises(IntegrityError):
        ours.open(KEY, theirs.seal(KEY, DATA))
    with pytest.raises(IntegrityError, match="shorter than its MAC"):
        ours.open(KEY, b"short")
    with pytest.raises(IntegrityError):
        ours.open(KEY, DATA)  # an unsealed blob
    assert ours.key_id != theirs.key_id and len(ours.key_id) == 16
    assert ours.key_id == KvIntegrity(SECRET).key_id
    assert KvIntegrity.generate().key_id != KvIntegrity.generate().key_id


def test_subkeys_differ_and_the_secret_is_never_shown() -> None:
    ours = KvIntegrity(SECRET)
    assert ours.key_id not in SECRET and ours.key_id != ours.tag(b"", b"")[:16]
    assert SECRET.decode() not in repr(ours)


def test_short_secrets_are_refused() -> None:
    with pytest.raises(ValueError, match="31 bytes; at least 32"):
        KvIntegrity(b"x" * 31)
