"""KV chunk payloads: the engine's codec for the KV it shares through the kvstore.

A KV chunk payload is::

    header   "<4sBBHIIII": magic b"GKV1", version, dtype code, reserved (0),
             num_layers, kv_heads, head_dim, num_tokens          (24 bytes)
    body     for each layer: K then V, each [kv_heads, num_tokens, head_dim],
             little-endian, C order
    trailer  blake2b(digest_size=16) of header + body             (16 bytes)

This is the engine's format: the kvstore stores payloads as opaque blobs (with
a checksum of its own, ``kvstore.checksum``), and only the engine's connector
packs and unpacks them (docs/design.md, "KV chunk contract").
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from kvstore.checksum import ChecksumError, checksum

MAGIC = b"GKV1"
VERSION = 1
TRAILER_BYTES = 16
_HEADER = struct.Struct("<4sBBHIIII")
HEADER_BYTES = _HEADER.size

# dtype code in the header -> little-endian numpy dtype of the stored values.
# bfloat16 has no numpy dtype: its values travel as their uint16 bit patterns.
_DTYPES: dict[int, tuple[str, np.dtype]] = {
    1: ("float32", np.dtype("<f4")),
    2: ("float16", np.dtype("<f2")),
    3: ("bfloat16", np.dtype("<u2")),
}
_CODES = {name: code for code, (name, _) in _DTYPES.items()}


class BlobError(ValueError):
    """A payload that is not a well-formed KV chunk."""


class PayloadChecksumError(BlobError, ChecksumError):
    """A payload whose trailer does not match its bytes: malformed, and a checksum failure."""


@dataclass(frozen=True)
class KvHeader:
    """Shape of a KV chunk payload."""

    dtype: str  # "float32" | "float16" | "bfloat16"
    num_layers: int
    kv_heads: int
    head_dim: int
    num_tokens: int
    version: int = VERSION

    @property
    def layer_shape(self) -> tuple[int, int, int]:
        """Shape of one K or V tensor: [kv_heads, num_tokens, head_dim]."""
        return (self.kv_heads, self.num_tokens, self.head_dim)


def _dtype_code(dtype: object) -> int:
    try:
        name = "bfloat16" if str(dtype) == "bfloat16" else np.dtype(dtype).name  # type: ignore[call-overload]
    except TypeError:
        name = str(dtype)
    if name == "uint16":  # bfloat16 bit patterns
        name = "bfloat16"
    if name not in _CODES:
        raise ValueError(f"dtype must be one of {sorted(_CODES)}, got {dtype!r}")
    return _CODES[name]


def pack_kv(layers: list[tuple[np.ndarray, np.ndarray]], dtype: object) -> bytes:
    """Serialize per-layer (K, V) pairs, each [kv_heads, num_tokens, head_dim].

    ``dtype`` is the stored dtype ("float32", "float16", numpy dtypes, or
    "bfloat16" for uint16 bit patterns); arrays are cast to it. Arrays need not
    be contiguous (e.g. a token range sliced out of a larger cache buffer).
    """
    if not layers:
        raise ValueError("layers must not be empty")
    code = _dtype_code(dtype)
    store = _DTYPES[code][1]
    shape = tuple(layers[0][0].shape)
    if len(shape) != 3:
        raise ValueError(f"K/V must be [kv_heads, num_tokens, head_dim], got shape {shape}")
    for i, (k, v) in enumerate(layers):
        if k.shape != shape or v.shape != shape:
            raise ValueError(f"layer {i}: K {k.shape} and V {v.shape} must both be {shape}")
    kv_heads, num_tokens, head_dim = shape
    tensor_bytes = kv_heads * num_tokens * head_dim * store.itemsize
    body_end = HEADER_BYTES + 2 * len(layers) * tensor_bytes

    out = bytearray(body_end + TRAILER_BYTES)
    _HEADER.pack_into(out, 0, MAGIC, VERSION, code, 0, len(layers), kv_heads, head_dim, num_tokens)
    flat = np.frombuffer(out, dtype=np.uint8)
    offset = HEADER_BYTES
    for k, v in layers:
        for tensor in (k, v):
            dst = flat[offset : offset + tensor_bytes].view(store).reshape(shape)
            np.copyto(dst, tensor, casting="same_kind")  # one copy, casts to little-endian
            offset += tensor_bytes
    out[body_end:] = checksum(memoryview(out)[:body_end], TRAILER_BYTES)
    return bytes(out)


def unpack_kv(blob: bytes | memoryview) -> tuple[KvHeader, list[tuple[np.ndarray, np.ndarray]]]:
    """Verify and parse a payload made by ``pack_kv``.

    Returns read-only views into ``blob`` (no copy), K and V per layer, each
    [kv_heads, num_tokens, head_dim]. Raises ``PayloadChecksumError`` when the
    trailer does not match and ``BlobError`` when the payload is malformed.
    """
    if len(blob) < HEADER_BYTES + TRAILER_BYTES:
        raise BlobError(f"KV payload of {len(blob)} bytes is shorter than its header and trailer")
    view = memoryview(blob)
    body_end = len(blob) - TRAILER_BYTES
    if checksum(view[:body_end], TRAILER_BYTES) != bytes(view[body_end:]):
        raise PayloadChecksumError("KV payload checksum mismatch")
    magic, version, code, _, num_layers, kv_heads, head_dim, num_tokens = _HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise BlobError(f"KV payload magic is {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise BlobError(f"KV payload version is {version}, this reader knows {VERSION}")
    if code not in _DTYPES:
        raise BlobError(f"KV payload dtype code {code} is unknown")
    name, store = _DTYPES[code]
    header = KvHeader(name, num_layers, kv_heads, head_dim, num_tokens, version)
    count = kv_heads * num_tokens * head_dim
    if HEADER_BYTES + 2 * num_layers * count * store.itemsize != body_end:
        raise BlobError(
            f"KV payload body is {body_end - HEADER_BYTES} bytes, header implies "
            f"{2 * num_layers * count * store.itemsize}"
        )
    values = np.frombuffer(blob, dtype=store, count=2 * num_layers * count, offset=HEADER_BYTES)
    tensors = values.reshape(num_layers, 2, *header.layer_shape)  # [layer, K|V, heads, tok, dim]
    return header, [(tensors[i, 0], tensors[i, 1]) for i in range(num_layers)]
