"""``MemoryKvChunkStore``: the in-process ``KvChunkStore`` for engine tests and dev.

Same contract as ``GrpcKvChunkStore`` (``kv_connector``), kept in a dict with
no network; it shares the counters, warnings, sealing and chunk checks of
``kv_chunk_store._CountingStore``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from .kv_chunk_store import RecordUnreachable, _CountingStore, _fail, _resolve
from .kv_codec import KvHeader
from .kv_integrity import IntegrityError, KvIntegrity
from .prefix_cache import KvLayers

T = TypeVar("T")


def _settle(future: Future[T], compute: Callable[[], T]) -> None:
    """``future`` resolved with ``compute()``, or failed with the
    ``RecordUnreachable`` it raised (as the gRPC connector's record fetch)."""
    try:
        value = compute()
    except RecordUnreachable as exc:
        _fail(future, exc)
    else:
        _resolve(future, value)


class MemoryKvChunkStore(_CountingStore):
    """``KvChunkStore`` in a dict, for engine tests; same contract, no network.

    Chunks are stored packed and sealed (``blobs``, shared with records as in
    the real store), so tests can corrupt or forge them. Knobs, changeable at
    any time: ``delay_s`` makes prefetch and fetch_record resolve that much
    later on a timer thread; a delay of ``timeout_s`` or more is a timeout.
    ``fail`` makes every operation fail (counted as an error).
    """

    def __init__(
        self,
        *,
        dtype: str = "float32",
        timeout_s: float = 2.0,
        delay_s: float = 0.0,
        fail: bool = False,
        integrity: KvIntegrity | None = None,
    ) -> None:
        super().__init__(dtype, timeout_s, integrity)
        self.delay_s = delay_s
        self.fail = fail
        self.blobs: dict[bytes, bytes] = {}
        self._lock = threading.Lock()
        # Pending delayed fetches, and what each resolves to when the store closes.
        self._timers: dict[Future[Any], tuple[threading.Timer, Any]] = {}
        self._closed = False

    def _collect(self, keys: list[bytes]) -> list[KvLayers]:
        out: list[KvLayers] = []
        first: KvHeader | None = None
        if self.fail:
            self._failed("prefetch", ConnectionError("failure injected"))
        elif self.delay_s >= self.timeout_s:
            self._failed("prefetch", TimeoutError(f"delay_s={self.delay_s}"))
        else:
            for key in keys:
                with self._lock:
                    blob = self.blobs.get(key)
                if blob is None:
                    break
                self._count("fetched_bytes", len(blob))
                checked = self._check_chunk(key, blob, first)
                if checked is None:
                    break
                first = first or checked[0]
                out.append(checked[1])
        self._finish_prefetch(len(keys), len(out))
        return out

    def _later(self, delay_s: float, compute: Callable[[], T], closed: T) -> Future[T]:
        """A future of ``compute()``, run on a timer thread after ``delay_s``
        (now when 0); ``closed`` when the store is or gets closed first."""
        future: Future[T] = Future()
        if self._closed:
            future.set_result(closed)
        elif delay_s <= 0:
            _settle(future, compute)
        else:

            def fire() -> None:
                with self._lock:
                    self._timers.pop(future, None)
                _settle(future, compute)

            timer = threading.Timer(delay_s, fire)
            timer.daemon = True
            with self._lock:
                self._timers[future] = (timer, closed)
            timer.start()
        return future

    def prefetch(self, keys: Sequence[bytes]) -> Future[list[KvLayers]]:
        keys = list(keys)
        if not keys:
            return self._later(0, list, [])
        return self._later(min(self.delay_s, self.timeout_s), lambda: self._collect(keys), [])

    def _refused(self, what: str, key: bytes) -> bool:
        """True when a write must not happen: closed, or a failure injected (counted)."""
        if self._closed:
            return True
        if self.fail:
            self._failed(what, ConnectionError("failure injected"), key)
            return True
        return False

    def push(self, key: bytes, layers: KvLayers) -> None:
        if self._refused("push", key):
            return
        with self._lock:
            present = key in self.blobs
        if present:
            self._count("push_skipped")
            return
        blob = self._pack(key, layers)
        with self._lock:
            self.blobs.setdefault(key, blob)
        self._count("pushed_chunks")

    def fetch_record(self, key: bytes, timeout_s: float) -> Future[bytes | None]:
        delay_s = self.delay_s  # as it is when the fetch starts

        def read() -> bytes | None:
            if self.fail or delay_s >= timeout_s:
                error = ConnectionError("failure injected") if self.fail else TimeoutError()
                self.record_failed_at = time.monotonic()
                self._failed("record get", error, key)
                raise RecordUnreachable(f"the kvstore did not answer ({type(error).__name__})")
            with self._lock:
                sealed = self.blobs.get(key)
            try:
                return self._open_record(key, sealed)
            except IntegrityError as exc:
                self._failed("record get", exc, key)
                return None

        return self._later(min(delay_s, timeout_s), read, None)

    def put_record(self, key: bytes, data: bytes) -> None:
        if self._refused("record write", key):
            return
        sealed = self.integrity.seal(key, data)
        with self._lock:
            self.blobs[key] = sealed

    def delete_record(self, key: bytes) -> None:
        if self._refused("record write", key):
            return
        with self._lock:
            self.blobs.pop(key, None)

    def record_pending(self, key: bytes) -> bool:
        return False  # writes are synchronous

    def flush(self, timeout_s: float) -> bool:
        return True  # writes are synchronous

    def close(self) -> None:
        with self._lock:
            self._closed = True
            timers, self._timers = self._timers, {}
        for future, (timer, closed) in timers.items():
            timer.cancel()
            _resolve(future, closed)
