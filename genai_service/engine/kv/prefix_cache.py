"""Chunk keys (docs/design.md, "KV chunk contract") and the in-process prefix index.

A prompt is cut into complete chunks of ``chunk_size`` tokens; chunk ``i``
gets the key ``k_i = H(k_{i-1} ‖ tokens of chunk i as little-endian uint32)``
with ``k_0 = H(namespace)`` and ``H = blake2b(digest_size=16)``. Equal keys
mean equal whole prefixes, so the index can hand a new request the KV of the
longest run of leading chunks it has seen before.

The namespace is the model fingerprint, KV dtype, layout, chunk size, key
format version and the integrity key id (``kv_integrity``: a secret-derived
value, so only replicas sharing the secret can compute the keys); a request's
own namespace adds its prefix-sharing scope (``scoped_namespace``: the
principal and/or ``cache_salt``), so requests in different scopes never share.

Plain Python + numpy; never imports onnxruntime.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

KEY_FORMAT_VERSION = 2  # 2: the integrity key id and the request scope joined the namespace

# Per layer (K, V), each [kv_heads, num_tokens, head_dim].
KvLayers = list[tuple[np.ndarray, np.ndarray]]


def _h(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def make_namespace(
    fingerprint: str, kv_dtype: str, layout: str, chunk_size: int, *, key_id: bytes
) -> bytes:
    """The bytes hashed into ``k_0``: any change of model, dtype, layout, chunk
    size or integrity key (``key_id``, ``KvIntegrity.key_id``) gives a disjoint
    key space."""
    fields = (fingerprint, kv_dtype, layout, str(chunk_size), f"v{KEY_FORMAT_VERSION}")
    return "|".join(("genai-kv", *fields, key_id.hex())).encode()


def scoped_namespace(namespace: bytes, principal: str | None, cache_salt: str | None) -> bytes:
    """A request's namespace: ``namespace`` plus who may share its prefixes.
    ``principal`` is None for global sharing; ``cache_salt`` None for none.
    Each part is length-prefixed, so no two scopes give the same bytes."""
    for tag, value in ((b"principal", principal), (b"salt", cache_salt)):
        if value is not None:
            raw = value.encode()
            namespace += b"|%s=%d:%s" % (tag, len(raw), raw)
    return namespace


def chunk_keys(namespace: bytes, token_ids: Sequence[int], chunk_size: int) -> list[bytes]:
    """Keys of the complete chunks of ``token_ids`` (a trailing partial chunk has none)."""
    keys: list[bytes] = []
    prev = _h(namespace)
    n_chunks = len(token_ids) // chunk_size
    if n_chunks == 0:
        return keys
    ids = np.asarray(token_ids[: n_chunks * chunk_size], dtype="<u4")
    for i in range(n_chunks):
        prev = _h(prev + ids[i * chunk_size : (i + 1) * chunk_size].tobytes())
        keys.append(prev)
    return keys


@dataclass
class _Entry:
    layers: KvLayers
    nbytes: int


def kv_nbytes(layers: KvLayers) -> int:
    return sum(k.nbytes + v.nbytes for k, v in layers)


class PrefixIndex:
    """LRU map chunk key → that chunk's KV, bounded in bytes.

    Entries hold their own contiguous copies, so nothing in the index aliases
    a running sequence's buffers.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self.bytes_used = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def match(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are present (touches them as recently used)."""
        n = 0
        for key in keys:
            if key not in self._entries:
                break
            self._entries.move_to_end(key)
            n += 1
        self.hits += n
        self.misses += 1 if n < len(keys) else 0
        return n

    def get(self, key: bytes) -> KvLayers:
        entry = self._entries[key]
        self._entries.move_to_end(key)
        return entry.layers

    def gather(self, keys: Sequence[bytes]) -> list[KvLayers]:
        """The KV of consecutive chunks, in order (touched as recently used)."""
        return [self.get(k) for k in keys]

    def put(self, key: bytes, layers: KvLayers, copy: bool = True) -> bool:
        """Store a chunk; False if it is too large to ever fit. ``copy=False``
        keeps the arrays as given: only for arrays nothing else writes to (e.g.
        read-only views of a fetched blob)."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return True
        nbytes = kv_nbytes(layers)
        if nbytes > self.capacity_bytes:
            return False
        while self.bytes_used + nbytes > self.capacity_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes_used -= old.nbytes
            self.evictions += 1
        owned = (
            [(np.array(k, copy=True), np.array(v, copy=True)) for k, v in layers]
            if copy
            else list(layers)
        )
        self._entries[key] = _Entry(owned, nbytes)
        self.bytes_used += nbytes
        return True

    def clear(self) -> None:
        self._entries.clear()
        self.bytes_used = 0


def join_chunks(chunks: Sequence[KvLayers]) -> KvLayers:
    """Consecutive chunks joined along the token axis (one copy)."""
    if len(chunks) == 1:
        return chunks[0]
    return [
        (
            np.concatenate([c[layer][0] for c in chunks], axis=1),
            np.concatenate([c[layer][1] for c in chunks], axis=1),
        )
        for layer in range(len(chunks[0]))
    ]
