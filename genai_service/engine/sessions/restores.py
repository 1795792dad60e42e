"""Sessions restored from their kvstore records without the engine loop waiting.

A session that is not in memory (evicted, or created on another replica) may
still have a record in the kvstore. Fetching it is network I/O, so it never
happens on the engine loop (docs/design.md, "Sessions"): ``SessionRestores``
starts the fetch on the connector's thread, and the call that needs the
session (a GetSession, a turn, ...) waits as a ``PendingCall`` while the
engine keeps stepping every other sequence. Each step ``poll`` adopts the
records that have arrived into the session table and resumes their waiters.
``SessionCalls`` are the engine's session calls on top of that: they save
every change as a record and wait for a record (``with_session``) when the
session is not in memory; a turn for such a session waits in
``ParkedRequests``. The other way, ``HeldOutputs`` keeps a turn's final
output until its session's record is visible in the kvstore.

Plain Python: futures from the ``KvChunkStore``, no network here.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

import structlog

from genai_common.errors import (
    GenAIError,
    Internal,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)

from ...contract.request import FinishReason, GenerationRequest, RequestOutput, Usage
from ...contract.sessions import SessionInfo, SessionPage
from ..kv.kv_chunk_store import KvChunkStore, RecordUnreachable
from .sessions import (
    Session,
    SessionTable,
    closed_record,
    is_session_id,
    not_found,
    record_key,
    session_from_record,
    session_record,
)

log = structlog.get_logger(__name__)

Resume = Callable[["GenAIError | None"], None]
T = TypeVar("T")
H = TypeVar("H")  # what a HeldOutputs holds

# A turn submitted this soon after a GetSession checked its session's record
# (the frontend's, building the turn's prompt) does not fetch it again.
VOUCH_S = 2.0
# After a record fetch fails, sessions in memory are used unchecked this long.
RECHECK_AFTER_FAILURE_S = 10.0


class PendingCall:
    """The answer of an engine call that waits for a session record.

    The engine process (``process_main``) sends its answer, ``CallDone`` or
    ``CallFailed``, when the engine resolves it (from a later ``step``);
    in-process callers use ``LLMEngine.wait``. ``cancel`` drops
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

    def settle(self, ok: bool, value: Any) -> None:
        """Resolve with ``value`` (``ok``), or with the error ``value``."""
        if not self.done:  # (else cancelled)
            self._settle(ok, value)

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
        # session id -> when a GetSession checked its record (see ``vouch``)
        self._vouched: dict[str, float] = {}

    def __bool__(self) -> bool:
        return bool(self._fetches)

    @staticmethod
    def can_restore(session_id: str) -> bool:
        """Only ids of the form this service hands out are looked up (others are
        NOT_FOUND at once, with no kvstore round trip)."""
        return is_session_id(session_id)

    def vouch(self, session_id: str) -> None:
        """The record of ``session_id`` was just checked for a GetSession: the
        frontend asks for one right before it submits a turn, so that turn
        need not fetch the record again (``take_vouched``)."""
        self._vouched[session_id] = time.monotonic()

    def can_skip_check(self, session_id: str) -> bool:
        """Whether a session in memory may be used without fetching its record:
        a GetSession just checked it (``take_vouched``), or a record fetch
        failed within ``RECHECK_AFTER_FAILURE_S``: while the kvstore is down or
        stalled, a check would only add its timeout to every turn."""
        if self.take_vouched(session_id):
            return True
        return time.monotonic() - self.remote.record_failed_at < RECHECK_AFTER_FAILURE_S

    def take_vouched(self, session_id: str) -> bool:
        """Whether a GetSession checked the record within ``VOUCH_S`` (once)."""
        checked = self._vouched.pop(session_id, None)
        if len(self._vouched) > self.max_fetches:  # vouches no turn took
            cutoff = time.monotonic() - VOUCH_S
            self._vouched = {k: t for k, t in self._vouched.items() if t >= cutoff}
        return checked is not None and time.monotonic() - checked < VOUCH_S

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
            error: GenAIError | None = None
            try:
                data = future.result()
            except RecordUnreachable as exc:
                data = None
                if self.table.find(session_id) is None:
                    # Not held here and the store cannot say whether it exists
                    # (the kvstore, or Redis behind it, is down): UNAVAILABLE,
                    # which a client retries, rather than NOT_FOUND, which it
                    # takes for the end of the conversation. A copy in memory
                    # is used as it is (see ``with_session``).
                    self.counters["session_record_fetches_unanswered"] += 1
                    error = Unavailable(
                        f"session_id: session {session_id!r} is not held by this replica and "
                        f"its record could not be read ({exc.message}); retry shortly"
                    )
            session = None
            if data is not None:
                session = session_from_record(session_id, data, self.vocab_size)
            if session is not None:
                try:
                    if self.table.adopt(session) is session:
                        self.counters["sessions_restored"] += 1
                except GenAIError as exc:  # full of busy sessions, or closed elsewhere
                    error = exc
            for resume in waiters:
                resume(error)


def with_session(
    table: SessionTable,
    restores: SessionRestores | None,
    session_id: str,
    principal: str,
    then: Callable[[Session], T],
    *,
    vouch: bool = False,
) -> T | PendingCall:
    """``then(session)`` for the session ``principal`` may use: now if it is in
    memory and cannot be stale, else (with a kvstore: ``restores``) as a
    ``PendingCall`` resolved once its record has arrived, so the engine loop
    never waits for it.

    With a kvstore any replica may have run turns of the session since this
    one last did (docs/design.md, "Routing a session's turns"), so a copy in
    memory is used only once its record says it is current (a newer record
    replaces it, ``SessionTable.adopt``), or when a GetSession (``vouch``)
    has just checked it, or while it runs a turn here. A record that cannot
    be fetched leaves the copy in memory as it is."""
    session = table.find(session_id)
    if session is not None:
        owned(session, principal)  # another principal's: refused before any fetch
        if restores is None or session.busy or restores.can_skip_check(session_id):
            result = then(session)
            if vouch and restores is not None:
                restores.vouch(session_id)  # still good for the turn that follows
            return result
    if restores is None or not restores.can_restore(session_id):
        raise not_found(session_id)
    pending = PendingCall()

    def resume(error: GenAIError | None) -> None:
        def run() -> T:
            if error is not None:
                raise error
            result = then(owned(table.get(session_id), principal))
            if vouch and restores is not None:
                restores.vouch(session_id)
            return result

        pending.resolve(run)

    restores.wait_for(session_id, resume)
    return pending


def owned(session: Session, principal: str) -> Session:
    """``session`` if ``principal`` may use it; ``PermissionDenied`` otherwise."""
    if session.owner and session.owner != principal:
        raise PermissionDenied(
            f"session_id: session {session.session_id!r} belongs to another principal"
        )
    return session


class SessionCalls:
    """The engine's session calls (CreateSession ... ListSessions) on its
    ``table``; with a kvstore (``remote``) each change is saved as the
    session's record, and a call for a session not in memory answers a
    ``PendingCall`` resolved once the record has arrived (``restores``)."""

    def __init__(
        self,
        table: SessionTable,
        remote: KvChunkStore | None,
        abort: Callable[[str], bool],
        *,
        vocab_size: int,
        timeout_s: float,
        counters: Counter[str],
        max_fetches: int,
        record_wait_s: float = 1.0,
    ) -> None:
        self.table = table
        self.remote = remote
        self._abort = abort  # the engine's: closing a session cancels its running turn
        # Answers of calls that changed a session, held as a turn's final output
        # is: (the answer, its value) until the session's record is visible.
        self._held: HeldOutputs[tuple[PendingCall, SessionInfo]] | None = (
            HeldOutputs(remote, record_wait_s) if remote is not None else None
        )
        self.restores = (
            SessionRestores(
                remote, table, vocab_size, timeout_s, counters, self.record_key, max_fetches
            )
            if remote is not None
            else None
        )

    def record_key(self, session_id: str) -> bytes:
        assert self.remote is not None  # records live in the kvstore
        return record_key(session_id, self.remote.integrity.key_id)

    @property
    def holding(self) -> bool:
        """Answers wait for their session's record (``release_answers``)."""
        return bool(self._held)

    def release_answers(self) -> None:
        """Send the held answers whose record has landed (or waited long enough)."""
        if self._held:
            for answer, info in self._held.release():
                answer.settle(True, info)

    def _when_saved(self, result: SessionInfo | PendingCall) -> SessionInfo | PendingCall:
        """``result`` (a changed session's info, or the call waiting for it)
        answered only once the session's record is visible in the kvstore, so
        the caller's next call may go to any replica."""
        held = self._held
        if held is None:
            return result
        answer = PendingCall()

        def hold(ok: bool, value: Any) -> None:
            key = self.record_key(value.session_id) if ok else b""
            if ok and held.remote.record_pending(key):
                held.hold(key, (answer, value))
            else:
                answer.settle(ok, value)

        if isinstance(result, PendingCall):
            result.add_done_callback(hold)
        else:
            hold(True, result)
        return answer.value if answer.done and answer.ok else answer

    def save(self, session: Session) -> None:
        if self.remote is not None:
            session.version += 1
            self.remote.put_record(self.record_key(session.session_id), session_record(session))

    def use(
        self, session_id: str, principal: str, then: Callable[[Session], T], vouch: bool = False
    ) -> T | PendingCall:
        """``with_session`` on this table and its restores."""
        return with_session(self.table, self.restores, session_id, principal, then, vouch=vouch)

    def create(
        self,
        idle_ttl_s: float | None,
        owner: str,
        metadata: dict[str, str] | None,
        context_overflow: str = "error",
    ) -> SessionInfo | PendingCall:
        session = self.table.create(idle_ttl_s, owner, metadata, context_overflow)
        self.save(session)
        return self._when_saved(SessionTable.info(session))

    def get(self, session_id: str, principal: str) -> SessionInfo | PendingCall:
        return self.use(session_id, principal, SessionTable.info, vouch=True)

    def reset(self, session_id: str, principal: str) -> SessionInfo | PendingCall:
        def reset(session: Session) -> SessionInfo:
            session = self.table.reset(session.session_id)
            self.save(session)
            return SessionTable.info(session)

        return self._when_saved(self.use(session_id, principal, reset))

    def rewind(
        self, session_id: str, principal: str, turns: int | None, history_tokens: int | None
    ) -> SessionInfo | PendingCall:
        def rewind(session: Session) -> SessionInfo:
            session = self.table.rewind(session.session_id, turns, history_tokens)
            self.save(session)
            return SessionTable.info(session)

        return self._when_saved(self.use(session_id, principal, rewind))

    def fork(
        self,
        session_id: str,
        principal: str,
        turns: int | None,
        idle_ttl_s: float | None,
        metadata: dict[str, str] | None,
    ) -> SessionInfo | PendingCall:
        def fork(parent: Session) -> SessionInfo:
            child = self.table.fork(parent, turns, idle_ttl_s, principal, metadata)
            self.save(child)
            return SessionTable.info(child)

        return self._when_saved(self.use(session_id, principal, fork))

    def close(self, session_id: str, principal: str) -> SessionInfo | PendingCall:
        def close(session: Session) -> SessionInfo:
            if session.running_request_id is not None:
                self._abort(session.running_request_id)  # closing cancels a running turn
            if self.remote is not None:
                self.remote.put_record(self.record_key(session_id), closed_record(session))
            return SessionTable.info(self.table.close(session_id))

        return self._when_saved(self.use(session_id, principal, close))

    def page(self, principal: str, page_size: int, page_token: str) -> SessionPage:
        """One page of the sessions in memory that ``principal`` owns (all of
        them when auth is off); see ``SessionTable.page``."""
        sessions, token = self.table.page(principal or None, page_size, page_token)
        return SessionPage([SessionTable.info(s) for s in sessions], token)


class ParkedRequests:
    """Session turns waiting outside the scheduler for their session's record
    (``PendingCall``s that queue the turn once it has arrived). A turn that
    then cannot run, or is cancelled meanwhile, has its one output ``emit``ted."""

    def __init__(self, emit: Callable[[RequestOutput], None]) -> None:
        self._emit = emit
        self._parked: dict[str, tuple[GenerationRequest, PendingCall]] = {}

    def __len__(self) -> int:
        return len(self._parked)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._parked

    def park(self, request: GenerationRequest, pending: PendingCall) -> None:
        rid = request.request_id
        self._parked[rid] = (request, pending)
        pending.add_done_callback(lambda ok, error: self._unpark(rid, ok, error))

    def _unpark(self, request_id: str, ok: bool, error: Any) -> None:
        self._parked.pop(request_id, None)
        if not ok:
            self._emit(RequestOutput(request_id, finished=True, error=error))

    def cancel(self, request_id: str) -> bool:
        """Drop a parked turn (its output: ``CANCELLED``); False if none is parked."""
        parked = self._parked.pop(request_id, None)
        if parked is None:
            return False
        request, pending = parked
        pending.cancel()
        self._emit(
            RequestOutput(
                request_id,
                finished=True,
                finish_reason=FinishReason.CANCELLED,
                usage=Usage(len(request.prompt_token_ids), 0, 0),
                session_id=request.session_id,
            )
        )
        return True


class HeldOutputs(Generic[H]):
    """What answers a change to a session (a turn's final output, a session
    call's answer) held until the session's record is visible in the kvstore
    (so the next call may go to any replica), or until ``wait_s`` has passed."""

    def __init__(self, remote: KvChunkStore, wait_s: float) -> None:
        self.remote = remote
        self.wait_s = wait_s
        # (record key, give-up time, output)
        self._held: list[tuple[bytes, float, H]] = []

    def __bool__(self) -> bool:
        return bool(self._held)

    def hold(self, key: bytes, out: H) -> None:
        self._held.append((key, time.monotonic() + self.wait_s, out))

    def release(self) -> list[H]:
        """The outputs whose record has landed (or that waited long enough)."""
        if not self._held:
            return []
        now = time.monotonic()
        ready, waiting = [], []
        for key, give_up, out in self._held:
            if not self.remote.record_pending(key) or now >= give_up:
                ready.append(out)
            else:
                waiting.append((key, give_up, out))
        self._held = waiting
        return ready
