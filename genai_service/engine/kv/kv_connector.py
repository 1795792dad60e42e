"""The engine's connector to the kvstore data plane (docs/design.md, "KV chunk contract").

The engine loop is synchronous and single-threaded; it must never wait on the
network. ``GrpcKvChunkStore`` therefore runs all of its RPCs on one background
thread with its own asyncio loop (``AsyncKvStoreClient``), packs and verifies
payloads on a small thread pool (numpy copies and blake2b release the GIL), and
hands the engine ``concurrent.futures.Future`` objects to poll. Every failure
is a miss: logged (rate-limited), counted, never raised.

The contract is ``KvChunkStore`` (``kv_chunk_store``); ``MemoryKvChunkStore``
(``kv_connector_memory``) keeps it in a dict, for engine tests.

Session records (small mutable blobs under ``session:...``) share the store.
A record is replaced by one Put with ``replace`` set (chunks never are),
serialised per key on one worker; see ``KvChunkStore.put_record``.

Every blob is sealed with a keyed MAC (``kv_integrity``) just before it goes
on the wire and opened just after it comes off, so what the engine is handed
was written by a replica holding the same secret; anything else is a miss,
counted as ``mac_failures``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import grpc
import structlog

from genai_common.credentials import channel_credentials
from kvstore.client import AsyncKvStoreClient

from .kv_chunk_store import (
    _CLOSE_TIMEOUT_S,
    RecordUnreachable,
    _CountingStore,
    _fail,
    _key_label,
    _resolve,
)
from .kv_codec import KvHeader
from .kv_integrity import IntegrityError, KvIntegrity
from .prefix_cache import KvLayers

log = structlog.get_logger(__name__)


class GrpcKvChunkStore(_CountingStore):
    """``KvChunkStore`` over a kvstore server (``genai-kvstore``).

    ``target`` is "host:port"; ``dtype`` the engine's KV dtype (payloads are
    packed in it and others are refused); ``timeout_s`` bounds each prefetch
    as a whole, each push and each record write; ``auth_token`` is the data
    plane's bearer token; ``tls_ca_file`` (PEM) dials the kvstore over TLS
    trusting that CA, with ``tls_cert_file``/``tls_key_file`` as the client
    certificate for mTLS; ``max_pending_pushes`` bounds queued plus in-flight
    pushes (and, separately, keys with pending record writes); ``workers`` is
    how many pushes run at once and the size of the pack/verify thread pool;
    ``fetch_concurrency`` how many Gets one prefetch keeps in flight;
    ``recent_keys`` how many pushed or fetched keys are remembered as present;
    ``integrity`` seals and opens blobs (None: a random secret).
    """

    def __init__(
        self,
        target: str,
        *,
        dtype: str,
        timeout_s: float = 2.0,
        auth_token: str | None = None,
        tls_ca_file: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
        max_pending_pushes: int = 64,
        workers: int = 2,
        fetch_concurrency: int = 8,
        recent_keys: int = 65536,
        integrity: KvIntegrity | None = None,
    ) -> None:
        super().__init__(dtype, timeout_s, integrity)
        for name, value in (
            ("max_pending_pushes", max_pending_pushes),
            ("workers", workers),
            ("fetch_concurrency", fetch_concurrency),
            ("recent_keys", recent_keys),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.target = target
        credentials = (
            channel_credentials(tls_ca_file, tls_cert_file, tls_key_file) if tls_ca_file else None
        )
        self._max_pending = max_pending_pushes
        self._workers = workers
        self._fetch_concurrency = fetch_concurrency
        self._recent_limit = recent_keys

        # Everything below is guarded by _lock; _idle wakes flush().
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._closed = False
        self._recent: OrderedDict[bytes, None] = OrderedDict()  # keys known to be in the store
        # Keys whose stored blob failed its check: pushed with replace, so a
        # forged or rotten chunk costs one recompute, not a miss forever.
        self._unusable_keys: OrderedDict[bytes, None] = OrderedDict()
        self._inflight: set[bytes] = set()  # keys queued or being pushed
        self._pending_pushes = 0
        self._records: dict[bytes, tuple[int, bytes | None]] = {}  # newest pending write per key
        self._record_seq = 0
        self._prefetches: set[Future[list[KvLayers]]] = set()
        self._record_fetches: set[Future[bytes | None]] = set()

        self._cpu = ThreadPoolExecutor(workers, thread_name_prefix="kv-connector-cpu")
        self._loop = asyncio.new_event_loop()
        self._tasks: set[asyncio.Task[Any]] = set()  # touched on the loop thread only
        self._thread = threading.Thread(target=self._run_loop, name="kv-connector", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._open(auth_token, credentials), self._loop).result(
            _CLOSE_TIMEOUT_S
        )
        log.info(
            "kv connector started",
            target=target,
            dtype=self.dtype,
            timeout_s=timeout_s,
            auth=bool(auth_token),
            tls=credentials is not None,
        )

    # -- engine thread ----------------------------------------------------------

    def prefetch(self, keys: Sequence[bytes]) -> Future[list[KvLayers]]:
        future: Future[list[KvLayers]] = Future()
        keys = list(keys)
        with self._lock:
            if keys and not self._closed:
                self._prefetches.add(future)
                self._loop.call_soon_threadsafe(self._spawn, self._prefetch, keys, future)
                return future
        future.set_result([])
        return future

    def push(self, key: bytes, layers: KvLayers) -> None:
        with self._lock:
            if self._closed:
                return
            if key in self._recent or key in self._inflight:
                self._count("push_skipped")
                return
            if self._pending_pushes >= self._max_pending:
                dropped = True
            else:
                dropped = False
                self._pending_pushes += 1
                self._inflight.add(key)
                self._loop.call_soon_threadsafe(self._push_queue.put_nowait, (key, layers))
        if dropped:
            self._count("push_dropped")
            self._warn("kvstore push dropped: too many pending", pending=self._max_pending)

    def fetch_record(self, key: bytes, timeout_s: float) -> Future[bytes | None]:
        future: Future[bytes | None] = Future()
        with self._lock:
            if self._closed:
                future.set_result(None)
            elif key in self._records:
                future.set_result(self._records[key][1])  # our own write has not landed yet
            else:
                self._record_fetches.add(future)
                self._loop.call_soon_threadsafe(
                    self._spawn, self._fetch_record, key, timeout_s, future
                )
        return future

    def put_record(self, key: bytes, data: bytes) -> None:
        self._write_record(key, bytes(data))

    def delete_record(self, key: bytes) -> None:
        self._write_record(key, None)

    def record_pending(self, key: bytes) -> bool:
        with self._lock:
            return key in self._records

    def flush(self, timeout_s: float) -> bool:
        with self._idle:
            return self._idle.wait_for(
                lambda: self._closed or (self._pending_pushes == 0 and not self._records),
                timeout_s,
            )

    def stats(self) -> dict[str, int]:
        out = super().stats()
        with self._lock:
            out["pending_pushes"] = self._pending_pushes
            out["pending_records"] = len(self._records)
        return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._idle.notify_all()
            stop = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
        try:
            stop.result(_CLOSE_TIMEOUT_S)
        except Exception:
            log.warning("kv connector did not shut down cleanly", exc_info=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(_CLOSE_TIMEOUT_S)
        self._cpu.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            pending, self._prefetches = self._prefetches, set()
            records, self._record_fetches = self._record_fetches, set()
        for future in pending:
            _resolve(future, [])
        for record in records:
            _resolve(record, None)
        log.info("kv connector closed", target=self.target, **self.stats())

    def _write_record(self, key: bytes, data: bytes | None) -> None:
        with self._lock:
            if self._closed:
                return
            self._record_seq += 1
            if key in self._records:  # already queued: the worker will write the newest value
                self._records[key] = (self._record_seq, data)
                return
            if len(self._records) < self._max_pending:
                self._records[key] = (self._record_seq, data)
                self._loop.call_soon_threadsafe(self._record_queue.put_nowait, key)
                return
        self._count("records_dropped")
        self._warn("kvstore record write dropped: too many pending", key=_key_label(key))

    # -- loop thread ------------------------------------------------------------

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    def _spawn(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        task = self._loop.create_task(fn(*args))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _open(
        self, auth_token: str | None, credentials: grpc.ChannelCredentials | None
    ) -> None:
        # KV payloads carry their own checksum (verified by unpack_kv): skip the
        # client's whole-blob check. Records have none, so their client verifies.
        settings: dict[str, Any] = {
            "auth_token": auth_token,
            "timeout_s": self.timeout_s,
            "credentials": credentials,
        }
        self._chunk_client = AsyncKvStoreClient(self.target, verify=False, **settings)
        self._record_client = AsyncKvStoreClient(self.target, **settings)
        self._push_queue: asyncio.Queue[tuple[bytes, KvLayers]] = asyncio.Queue()
        self._record_queue: asyncio.Queue[bytes] = asyncio.Queue()
        for _ in range(self._workers):
            self._spawn(self._push_worker)
        self._spawn(self._record_worker)

    async def _shutdown(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._chunk_client.close()
        await self._record_client.close()

    def _remember(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                self._recent[key] = None
                self._recent.move_to_end(key)
                self._unusable_keys.pop(key, None)
            while len(self._recent) > self._recent_limit:
                self._recent.popitem(last=False)

    def _unusable(self, key: bytes) -> None:
        with self._lock:
            self._recent.pop(key, None)
            self._unusable_keys[key] = None
            self._unusable_keys.move_to_end(key)
            while len(self._unusable_keys) > self._recent_limit:
                self._unusable_keys.popitem(last=False)

    async def _prefetch(self, keys: list[bytes], future: Future[list[KvLayers]]) -> None:
        out: list[KvLayers] = []  # the leading run, filled in place so a timeout keeps it
        try:
            async with asyncio.timeout(self.timeout_s):
                deadline = self._loop.time() + self.timeout_s
                present = await self._chunk_client.lookup(keys, timeout_s=self.timeout_s)
                if present:
                    await self._fetch(keys[: min(present, len(keys))], deadline, out)
        except Exception as exc:  # TimeoutError, AioRpcError, anything unexpected: a miss
            self._failed("prefetch", exc)
        finally:
            self._finish_prefetch(len(keys), len(out))
            with self._lock:
                self._prefetches.discard(future)
            _resolve(future, out)

    async def _fetch_record(
        self, key: bytes, timeout_s: float, future: Future[bytes | None]
    ) -> None:
        data: bytes | None = None
        unreachable: RecordUnreachable | None = None
        try:
            async with asyncio.timeout(timeout_s):
                data = await self._get_record(key, timeout_s)
        except IntegrityError as exc:  # not sealed by us: a miss, the store answered
            self._failed("record get", exc, key)
        except Exception as exc:  # TimeoutError, AioRpcError (UNAVAILABLE: Redis down)
            self.record_failed_at = time.monotonic()  # the store did not answer
            self._failed("record get", exc, key)
            unreachable = RecordUnreachable(f"the kvstore did not answer ({type(exc).__name__})")
        finally:
            with self._lock:
                self._record_fetches.discard(future)
            if unreachable is not None:
                _fail(future, unreachable)
            else:
                _resolve(future, data)

    async def _fetch(self, keys: list[bytes], deadline: float, out: list[KvLayers]) -> None:
        """Get ``keys`` concurrently, check them in order, stop at the first failure."""
        limit = asyncio.Semaphore(self._fetch_concurrency)  # FIFO: leading keys go first

        async def get(key: bytes) -> bytes | None:
            async with limit:
                remaining = max(deadline - self._loop.time(), 0.001)
                return await self._chunk_client.get(key, timeout_s=remaining)

        tasks = [asyncio.ensure_future(get(key)) for key in keys]
        first: KvHeader | None = None
        try:
            for i, (key, task) in enumerate(zip(keys, tasks, strict=True)):
                try:
                    blob = await task
                except Exception as exc:  # RPC error, short or oversized blob, bad key
                    self._failed("get", exc, key)
                    return
                if blob is None:  # evicted since the Lookup
                    return
                self._count("fetched_bytes", len(blob))
                checked = await self._loop.run_in_executor(
                    self._cpu, self._check_chunk, key, blob, first
                )
                if checked is None:
                    # Whoever wrote this chunk may have written the rest of the
                    # run too, and this engine recomputes all of it anyway: its
                    # pushes replace the whole run, so a forged chain heals in
                    # one recompute, not one chunk per process.
                    for rest in keys[i + 1 :]:
                        self._unusable(rest)
                    return
                first = first or checked[0]
                out.append(checked[1])
                self._remember((key,))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _push_worker(self) -> None:
        while True:
            key, layers = await self._push_queue.get()
            try:
                await self._push(key, layers)
            finally:
                with self._lock:
                    self._pending_pushes -= 1
                    self._inflight.discard(key)
                    self._idle.notify_all()

    async def _push(self, key: bytes, layers: KvLayers) -> None:
        try:
            with self._lock:
                replace = key in self._unusable_keys
            async with asyncio.timeout(self.timeout_s):
                if not replace and await self._chunk_client.lookup([key]):
                    stored = False
                else:
                    blob = await self._loop.run_in_executor(self._cpu, self._pack, key, layers)
                    reply = await self._chunk_client.put(key, blob, replace=replace)
                    stored = not reply.already_present
        except Exception as exc:
            self._failed("push", exc, key)
            return
        self._remember((key,))
        self._count("pushed_chunks" if stored else "push_skipped")

    async def _record_worker(self) -> None:
        while True:
            key = await self._record_queue.get()
            with self._lock:
                seq, data = self._records[key]
            try:
                await self._replace_record(key, data)
            except Exception as exc:
                self._failed("record write", exc, key)
            finally:
                with self._lock:
                    if self._records[key][0] == seq:
                        del self._records[key]
                        self._idle.notify_all()
                    else:  # a newer write came in meanwhile: write that one too
                        self._record_queue.put_nowait(key)

    async def _get_record(self, key: bytes, timeout_s: float) -> bytes | None:
        return self._open_record(key, await self._record_client.get(key, timeout_s=timeout_s))

    async def _replace_record(self, key: bytes, data: bytes | None) -> None:
        async with asyncio.timeout(self.timeout_s):
            if data is None:
                await self._record_client.delete(key)
            else:
                sealed = self.integrity.seal(key, data)
                await self._record_client.put(key, sealed, replace=True)
