"""The engine's KV chunk store seam (docs/design.md, "KV chunk contract").

``KvChunkStore`` is the contract the engine relies on (prefetch and push of KV
chunks, session records, every failure a counted miss, nothing on the engine
loop waiting on the network); ``_CountingStore`` is what both implementations
share: the counters, rate-limited warnings, and opening and checking a chunk.
The implementations are ``GrpcKvChunkStore`` (``kv_connector``, the kvstore
over gRPC) and ``MemoryKvChunkStore`` (``kv_connector_memory``, a dict, for
engine tests).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Any

import grpc
import numpy as np
import structlog

from genai_common.errors import Unavailable
from kvstore.checksum import ChecksumError

from .kv_codec import BlobError, KvHeader, pack_kv, unpack_kv
from .kv_integrity import IntegrityError, KvIntegrity
from .prefix_cache import KvLayers

log = structlog.get_logger(__name__)

STAT_NAMES = (
    "hits_chunks",  # chunks handed to the engine by prefetch
    "misses",  # prefetches that delivered fewer chunks than keys asked for
    "fetched_bytes",  # blob bytes received by prefetch (intact or not)
    "pushed_chunks",  # chunks newly stored by push
    "push_skipped",  # pushes not sent: pushed before, in flight, or already in the store
    "push_dropped",  # pushes refused because max_pending_pushes were pending
    "records_dropped",  # record writes refused because max_pending_pushes keys were pending
    "errors",  # RPC failures, malformed blobs, unexpected exceptions
    "timeouts",  # operations that ran past timeout_s
    "checksum_failures",  # blobs whose checksum did not match their bytes
    "mac_failures",  # blobs not sealed under our integrity secret (forged, foreign, replayed)
)
_KV_DTYPES = ("float32", "float16", "bfloat16")
_CLOSE_TIMEOUT_S = 5.0
_WARN_INTERVAL_S = 10.0


def _dtype_name(dtype: object) -> str:
    """The KV payload dtype name of ``dtype`` ("float32", "float16" or "bfloat16")."""
    name = str(dtype)
    if name != "bfloat16":
        with contextlib.suppress(TypeError):
            name = np.dtype(dtype).name  # type: ignore[call-overload]
    if name not in _KV_DTYPES:
        raise ValueError(f"dtype must be one of {list(_KV_DTYPES)}, got {dtype!r}")
    return name


def _key_label(key: bytes | None) -> str | None:
    """How a key appears in logs: chunk keys in hex; records by their kind only,
    since a session id is a bearer secret (docs/design.md, "Security")."""
    if key is None:
        return None
    kind, sep, _ = key.partition(b":")
    return kind.decode("ascii", "replace") + ":<redacted>" if sep else key.hex()


def _resolve(future: Future[Any], result: Any) -> None:
    """Set ``future``'s result unless it is already done (e.g. cancelled by the engine)."""
    with contextlib.suppress(InvalidStateError):
        future.set_result(result)


def _fail(future: Future[Any], error: BaseException) -> None:
    """Set ``future``'s exception unless it is already done."""
    with contextlib.suppress(InvalidStateError):
        future.set_exception(error)


class RecordUnreachable(Unavailable):
    """A session record fetch the store did not answer (``fetch_record``)."""


class KvChunkStore(ABC):
    """Seam (STYLE rule 4): where complete KV chunks live outside the process.

    Contract: every failure (network error, timeout, checksum mismatch, a MAC
    that does not verify, malformed blob) is a MISS, logged as a warning and
    counted in ``stats()``, never an exception to the caller. ``integrity``
    seals everything written and opens everything read (callers see plain
    payloads and records). Nothing the engine loop calls waits on the network:
    fetches return futures (only ``get_record``, for tests and tools, blocks).
    Layers handed out are read-only arrays, each
    ``[kv_heads, chunk_tokens, head_dim]``.
    """

    integrity: KvIntegrity  # its key_id scopes chunk namespaces and record keys

    @abstractmethod
    def prefetch(self, keys: Sequence[bytes]) -> Future[list[KvLayers]]:
        """Fetch the leading run of ``keys`` (a chunk-key chain) that the store holds.

        Returns at once; the future resolves (never raises) with one ``KvLayers``
        per leading key that arrived intact, stopping at the first missing or
        failed chunk (a chain must be contiguous), within ``timeout_s`` as a
        whole; ``[]`` when nothing usable arrived.
        """

    @abstractmethod
    def push(self, key: bytes, layers: KvLayers) -> None:
        """Store one complete chunk in the background; returns at once.

        Takes ownership of ``layers``: the caller must not modify the arrays
        afterwards (``ModelRunner.read_kv`` returns copies: pass them as they
        are). Skipped when this process pushed ``key`` recently or the store
        already holds it; dropped (and counted) when too many pushes are pending.
        """

    @abstractmethod
    def fetch_record(self, key: bytes, timeout_s: float) -> Future[bytes | None]:
        """Fetch the record under ``key`` in the background; returns at once.

        The future resolves within ``timeout_s`` with the record, or None
        when the store answered that it has none (or one that fails its
        check); when the store did not answer (an error, a timeout, Redis
        behind it down) it raises ``RecordUnreachable`` instead, so a caller
        can tell "no such record" from "cannot tell now". Sees this process's
        own pending ``put_record``/``delete_record`` calls (read-your-writes).
        """

    # When a record fetch last failed (time.monotonic()); never: -inf.
    record_failed_at: float = float("-inf")

    def get_record(self, key: bytes, timeout_s: float) -> bytes | None:
        """``fetch_record`` waited for: blocks for at most about ``timeout_s``
        (never call it from the engine loop)."""
        try:
            return self.fetch_record(key, timeout_s).result(timeout_s + _CLOSE_TIMEOUT_S)
        except (TimeoutError, RecordUnreachable):  # wedged or unanswered: a miss here
            return None

    @abstractmethod
    def put_record(self, key: bytes, data: bytes) -> None:
        """Create or replace the record under ``key`` in the background.

        Writes to one key land in call order and the last one wins; pending
        writes to the same key are coalesced. A replacement is one Put with
        ``replace`` set, so a reader on another replica sees the old record or
        the new one, never neither.
        """

    @abstractmethod
    def delete_record(self, key: bytes) -> None:
        """Remove the record under ``key`` in the background (ordered with ``put_record``)."""

    @abstractmethod
    def record_pending(self, key: bytes) -> bool:
        """True while a ``put_record``/``delete_record`` of ``key`` has not landed
        (the engine holds a session turn's final answer until its record is
        visible to other replicas)."""

    @abstractmethod
    def flush(self, timeout_s: float) -> bool:
        """Wait until every push and record write issued so far has finished.

        True when they all have, False when ``timeout_s`` ran out first.
        """

    @abstractmethod
    def stats(self) -> dict[str, int]:
        """Counters named in ``STAT_NAMES`` (since start) plus gauges of pending work."""

    @abstractmethod
    def close(self) -> None:
        """Stop background work (pending writes are abandoned: ``flush`` first to
        keep them); unresolved prefetches resolve ``[]``. Idempotent; afterwards
        every call is a miss or a no-op."""


class _CountingStore(KvChunkStore):
    """Counters, rate-limited warnings and chunk checks shared by the implementations."""

    def __init__(self, dtype: object, timeout_s: float, integrity: KvIntegrity | None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.dtype = _dtype_name(dtype)
        self.timeout_s = timeout_s
        # None: a random secret, so only what this instance wrote is trusted.
        self.integrity = integrity or KvIntegrity.generate()
        self._stats_lock = threading.Lock()
        self._counters = dict.fromkeys(STAT_NAMES, 0)
        self._warned: dict[str, tuple[float, int]] = {}

    def _count(self, name: str, n: int = 1) -> None:
        with self._stats_lock:
            self._counters[name] += n

    def _warn(self, event: str, **fields: object) -> None:
        """Log ``event`` at most once per interval (a down kvstore fails every request)."""
        now = time.monotonic()
        with self._stats_lock:
            last, suppressed = self._warned.get(event, (-math.inf, 0))
            if now - last < _WARN_INTERVAL_S:
                self._warned[event] = (last, suppressed + 1)
                return
            self._warned[event] = (now, 0)
        log.warning(event, suppressed=suppressed, **fields)

    def _failed(self, op: str, exc: BaseException, key: bytes | None = None) -> None:
        """Count and log a failed operation as a timeout, checksum failure or error."""
        rpc = exc if isinstance(exc, grpc.RpcError) else None
        code = rpc.code() if rpc is not None else None  # type: ignore[attr-defined]
        if isinstance(exc, TimeoutError) or code == grpc.StatusCode.DEADLINE_EXCEEDED:
            kind = "timeouts"
        elif isinstance(exc, IntegrityError):
            kind = "mac_failures"
        elif isinstance(exc, ChecksumError) or code == grpc.StatusCode.DATA_LOSS:
            kind = "checksum_failures"
        else:
            kind = "errors"
        self._count(kind)
        reason = rpc.details() if rpc is not None else str(exc)  # type: ignore[attr-defined]
        self._warn(
            f"kvstore {op} failed: treated as a miss",
            kind=kind,
            error=type(exc).__name__,
            reason=reason,
            key=_key_label(key),
        )

    def _pack(self, key: bytes, layers: KvLayers) -> bytes:
        """A chunk as the sealed blob to store under ``key``."""
        return self.integrity.seal(key, pack_kv(layers, self.dtype))

    def _open_record(self, key: bytes, sealed: bytes | None) -> bytes | None:
        """A record read from the store; raises ``IntegrityError`` if it is not ours."""
        return None if sealed is None else bytes(self.integrity.open(key, sealed))

    def _check_chunk(
        self, key: bytes, blob: bytes, first: KvHeader | None
    ) -> tuple[KvHeader, KvLayers] | None:
        """Open, unpack and verify one chunk of a chain; None (counted) when it is unusable."""
        try:
            header, layers = unpack_kv(self.integrity.open(key, blob))
            if header.dtype != self.dtype:
                raise BlobError(f"KV payload dtype is {header.dtype}, expected {self.dtype}")
            if first is not None and (header.num_layers, header.layer_shape) != (
                first.num_layers,
                first.layer_shape,
            ):
                raise BlobError(
                    f"KV payload is {header.num_layers} x {header.layer_shape}, the chain's "
                    f"first chunk is {first.num_layers} x {first.layer_shape}"
                )
        except (BlobError, IntegrityError) as exc:  # ChecksumError included
            self._failed("chunk check", exc, key)
            self._unusable(key)
            return None
        return header, layers

    def _unusable(self, key: bytes) -> None:
        """The blob stored under ``key`` failed its check (a forgery, rot, or
        another layout): the next push of ``key`` replaces it."""

    def _finish_prefetch(self, wanted: int, got: int) -> None:
        with self._stats_lock:
            self._counters["hits_chunks"] += got
            self._counters["misses"] += 1 if got < wanted else 0

    def stats(self) -> dict[str, int]:
        with self._stats_lock:
            return dict(self._counters)
