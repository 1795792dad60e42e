from __future__ import annotations

import hashlib

import numpy as np
import pytest

from genai_service.engine.kv.prefix_cache import (
    PrefixIndex,
    chunk_keys,
    join_chunks,
    kv_nbytes,
    make_namespace,
    scoped_namespace,
)

KEY_ID = bytes(range(16))


def _h(b: bytes) -> bytes:
    return hashlib.blake2b(b, digest_size=16).digest()


def test_chunk_keys_follow_the_design_chain() -> None:
    ns = make_namespace("abc", "float32", "L2.H2.D8.hnd", 4, key_id=KEY_ID)
    ids = list(range(1, 11))  # two complete chunks of 4 and a partial one
    keys = chunk_keys(ns, ids, 4)
    k0 = _h(ns)
    k1 = _h(k0 + np.asarray(ids[0:4], "<u4").tobytes())
    k2 = _h(k1 + np.asarray(ids[4:8], "<u4").tobytes())
    assert keys == [k1, k2]
    assert all(len(k) == 16 for k in keys)


def test_equal_key_means_equal_prefix_and_namespaces_are_disjoint() -> None:
    ns = make_namespace("m", "float32", "x", 2, key_id=KEY_ID)
    a = chunk_keys(ns, [1, 2, 3, 4], 2)
    b = chunk_keys(ns, [1, 2, 3, 5], 2)
    assert a[0] == b[0] and a[1] != b[1]
    c = chunk_keys(ns, [9, 2, 3, 4], 2)
    assert c[1] != a[1]  # same chunk tokens, different history
    for other in (
        make_namespace("m2", "float32", "x", 2, key_id=KEY_ID),
        make_namespace("m", "float16", "x", 2, key_id=KEY_ID),
        make_namespace("m", "float32", "y", 2, key_id=KEY_ID),
        make_namespace("m", "float32", "x", 3, key_id=KEY_ID),
        make_namespace("m", "float32", "x", 2, key_id=bytes(16)),  # another integrity secret
    ):
        assert chunk_keys(other, [1, 2, 3, 4], 2)[0] != a[0]


def test_the_public_recipe_no_longer_gives_the_keys() -> None:
    """Without the integrity key id, the model's public facts do not give the keys."""
    public = "|".join(("genai-kv", "m", "float32", "x", "2", "v1")).encode()  # the old namespace
    ns = make_namespace("m", "float32", "x", 2, key_id=KEY_ID)
    assert chunk_keys(public, [1, 2], 2) != chunk_keys(ns, [1, 2], 2)


def test_scopes_are_disjoint() -> None:
    ns = make_namespace("m", "float32", "x", 2, key_id=KEY_ID)
    assert scoped_namespace(ns, None, None) == ns  # global, no salt: the model's namespace
    scopes = [
        scoped_namespace(ns, principal, salt)
        for principal in (None, "", "alice", "bob", "alice|salt=1:x")
        for salt in (None, "x", "y")
    ]
    assert len({chunk_keys(s, [1, 2], 2)[0] for s in scopes}) == len(scopes)


def test_chunk_keys_of_short_input_are_empty() -> None:
    assert chunk_keys(b"ns", [1, 2, 3], 4) == []


def _layers(fill: float, tokens: int = 4) -> list[tuple[np.ndarray, np.ndarray]]:
    k = np.full((2, tokens, 8), fill, np.float32)
    return [(k, k + 1), (k + 2, k + 3)]


def test_index_match_gather_and_lru_eviction_by_bytes() -> None:
    one = kv_nbytes(_layers(0))
    index = PrefixIndex(capacity_bytes=2 * one)
    index.put(b"a", _layers(1))
    index.put(b"b", _layers(2))
    assert index.match([b"a", b"b", b"c"]) == 2
    joined = join_chunks(index.gather([b"a", b"b"]))
    assert joined[0][0].shape == (2, 8, 8)
    np.testing.assert_array_equal(joined[1][1][:, 4:], _layers(2)[1][1])
    index.match([b"a"])  # a is now most recent
    index.put(b"c", _layers(3))
    assert b"b" not in index and b"a" in index and b"c" in index
    assert index.evictions == 1 and index.bytes_used == 2 * one


def test_index_copies_what_it_stores_and_refuses_oversized() -> None:
    layers = _layers(1)
    index = PrefixIndex(capacity_bytes=kv_nbytes(layers))
    index.put(b"a", layers)
    layers[0][0][:] = 99
    assert index.get(b"a")[0][0].max() == 1
    assert not index.put(b"big", _layers(1, tokens=8))


def test_negative_capacity_is_rejected() -> None:
    with pytest.raises(ValueError, match="capacity_bytes"):
        PrefixIndex(-1)
