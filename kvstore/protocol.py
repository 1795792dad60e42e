"""Wire limits shared by the kvstore server and its clients.

See docs/design.md, "KV chunk contract".
"""

from __future__ import annotations

from collections.abc import Iterator

# Blob data travels in frames of at most this many bytes, far below gRPC's
# 4 MiB default message limit, so that one blob never becomes one message.
MAX_FRAME_BYTES = 1 << 20

# Channel message limit on both ends: frames are <= 1 MiB plus a few bytes of
# framing; the headroom only matters for a peer that ignores the frame limit
# (which then gets INVALID_ARGUMENT from the servicer, not a transport error).
MAX_MESSAGE_BYTES = 8 << 20

# Keys are opaque bytes; chunk keys are 16-byte blake2b digests.
MAX_KEY_BYTES = 256

# Most keys one Lookup may carry (a 256-token chunk each: 16M tokens).
MAX_LOOKUP_KEYS = 65536

SERVICE_NAME = "kvstore.v1.KvStore"

# The environment variable holding the data-plane bearer token: the kvstore
# requires it, the engine's connector sends it (genai-stack sets it for both).
AUTH_TOKEN_ENV = "GENAI_KVSTORE_AUTH_TOKEN"

# Data-plane channel options (no compression is passed separately: KV tensors
# do not compress and the CPU is better spent elsewhere).
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Reconnect within a second of the kvstore coming back. gRPC's default
    # backoff (1 s, x1.6 per failed attempt, up to 120 s) left pushes failing,
    # and every request a miss, for 3.4 s after a 6 s outage and 8.4 s after a
    # 30 s one (loopback; 0.8 s both times with these settings). One reconnect
    # attempt a second to a sidecar or a Service address costs nothing
    # (docs/design.md, "KV chunk contract"). The connect timeout itself
    # (grpc.min_reconnect_backoff_ms, 20 s) stays: a TLS handshake over a real
    # network may need more than 100 ms.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


def key_error(key: bytes, field: str = "key") -> str | None:
    """Why ``key`` is not a valid key, or None when it is."""
    if not 1 <= len(key) <= MAX_KEY_BYTES:
        return f"{field} is {len(key)} bytes; allowed 1 to {MAX_KEY_BYTES}"
    return None


def split_frames(blob: bytes | bytearray | memoryview) -> Iterator[bytes]:
    """Slices of ``blob``, in order, each at most ``MAX_FRAME_BYTES``."""
    view = memoryview(blob)
    for offset in range(0, len(view), MAX_FRAME_BYTES):
        yield bytes(view[offset : offset + MAX_FRAME_BYTES])
