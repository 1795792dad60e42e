"""Sessions restored from their kvstore records without the engine loop waiting.

A session that is not in memory (evicted, or created on another replica) may
still have a record in the kvstore. Fetching it is network I/O, so it never
happens on the engine loop (docs/design.md, "Sessions"): ``SessionRestores``
starts the fetch on the connector's thread, and the call that needs the
session (a GetSession, a turn, ...) waits as a ``PendingCall`` while the
engine keeps stepping every other sequence. Each step ``poll`` adopts the
records that have arrived into the session table and resumes their waiters.

Plain Python: futures from the ``KvChunkStore``, no network here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import structlog

from genai_common.errors import GenAIError, Internal, ResourceExhausted

from .kv_connector import KvChunkStore
from .sessions import SessionTable, is_session_id, session_from_record

log = structlog.get_logger(__name__)

Resume = Callable[["GenAIError | None"], None]


class PendingCall:
    """The answer of an engine call that waits for a session record.

    The engine process sends it when the engine resolves it (from a later
    ``step``); in-process callers use ``LLMEngine.wait``. ``cancel`` drops
    the answer (an aborted request).
    """

    def __init__(self) -> None:
        self.done = False
        self.ok = False
        self.value: Any = None
        self._callbacks: list[Callable[[bool, Any], None]] = []

    def add_done_callback(self, fn: Callable[[bool, Any], None]) -> None:
        """Call ``fn(ok, value_or_error)`` once resolved (now, if it is)."""
        if self.done:
            fn(self.ok, self.value)
        else:
            self._callbacks.append(fn)

    def resolve(self, compute: Callable[[], Any]) -> None:
        """Resolve with ``compute()``, or with the error it raises."""
        if self.done:
            return  # cancelled
        try:
            self._settle(True, compute())
        except GenAIError as exc:
            self._settle(False, exc)
        except Exception as exc:  # a bug: the caller still gets an answer
            log.exception("pending_call_failed")
            self._settle(False, Internal(str(exc)))

    def cancel(self) -> None:
        self.done, self._callbacks = True, []

    def _settle(self, ok: bool, value: Any) -> None:
        self.done, self.ok, self.value = True, ok, value
        callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(ok, value)


class SessionRestores:
    """Record fetches in flight, one per session id however many calls wait on it."""

    def __init__(
        self,
        remote: KvChunkStore,
        table: SessionTable,
        vocab_size: int,
        timeout_s: float,
        counters: Counter[str],
        record_key: Callable[[str], bytes],
        max_fetches: int,
    ) -> None:
        self.remote = remote
        self.table = table
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.counters = counters
        self.record_key = record_key  # the engine's: scoped by the integrity key id
        self.max_fetches = max_fetches
        # session id -> (its record fetch, the calls to resume when it lands)
        self._fetches: dict[str, tuple[Future[bytes | None], list[Resume]]] = {}

    def __bool__(self) -> bool:
        return bool(self._fetches)

    @staticmethod
    def can_restore(session_id: str) -> bool:
        """Only ids of the form this service hands out are looked up (others are
        NOT_FOUND at once, with no kvstore round trip)."""
        return is_session_id(session_id)

    def wait_for(self, session_id: str, resume: Resume) -> None:
        """Fetch ``session_id``'s record in the background (once) and call
        ``resume`` from a later ``poll``, after the session, if its record was
        good, is in the table."""
        entry = self._fetches.get(session_id)
        if entry is None:
            if len(self._fetches) >= self.max_fetches:
                self.counters["session_record_fetches_refused"] += 1
                raise ResourceExhausted(
                    f"session_id: {len(self._fetches)} session records are being fetched "
                    f"from the kvstore; at most {self.max_fetches} at once, retry later"
                )
            entry = (self.remote.fetch_record(self.record_key(session_id), self.timeout_s), [])
            self._fetches[session_id] = entry
        entry[1].append(resume)

    def poll(self) -> None:
        """Adopt the records that have arrived and resume their waiters in the
        order they came: ``resume(None)`` when the session may now be in the
        table (it is not when there was no record, or an unreadable one),
        ``resume(error)`` when there was no room for it."""
        done = [sid for sid, (future, _) in self._fetches.items() if future.done()]
        for session_id in done:
            future, waiters = self._fetches.pop(session_id)
            data = future.result()
            session = None
            if data is not None:
                session = session_from_record(session_id, data, self.vocab_size)
            error: GenAIError | None = None
            if session is not None:
                try:
                    self.table.adopt(session)
                    self.counters["sessions_restored"] += 1
                except GenAIError as exc:  # the table is full of busy sessions
                    error = exc
            for resume in waiters:
                resume(error)
