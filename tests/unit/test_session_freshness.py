"""A session held in memory is used only once its record says it is current
(docs/design.md, "Routing a session's turns"): two ``SessionCalls`` sharing one
store stand for two replicas sharing a kvstore."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from genai_common.errors import NotFound, Unavailable
from genai_service.engine.kv.kv_connector_memory import MemoryKvChunkStore
from genai_service.engine.sessions import restores
from genai_service.engine.sessions.restores import PendingCall, SessionCalls
from genai_service.engine.sessions.sessions import Session, SessionTable


class Replica:
    def __init__(self, store: MemoryKvChunkStore) -> None:
        self.table = SessionTable(8, 900.0, persistent=True)
        self.calls = SessionCalls(
            self.table,
            store,
            abort=lambda rid: False,
            vocab_size=1000,
            timeout_s=1.0,
            counters=Counter(),
            max_fetches=8,
        )

    def settle(self, result: Any) -> Any:
        """The answer of a call, polling its record fetch like the engine's steps."""
        deadline = time.monotonic() + 5
        while isinstance(result, PendingCall) and not result.done:
            assert time.monotonic() < deadline
            assert self.calls.restores is not None
            self.calls.restores.poll()
            time.sleep(0.001)
        if isinstance(result, PendingCall):
            if not result.ok:
                raise result.value
            return result.value
        return result

    def get(self, sid: str) -> Any:
        return self.settle(self.calls.get(sid, ""))

    def session(self, sid: str) -> Session:
        """The copy the next turn here would run on (what ``use`` hands it)."""
        return self.settle(self.calls.use(sid, "", lambda s: s))  # type: ignore[no-any-return]

    def turn(self, sid: str, tokens: list[int]) -> None:
        """What the engine does when a turn ends: history grows, the record is saved."""
        s = self.session(sid)
        s.history = s.history + tokens
        s.turns += 1
        self.calls.save(s)


@pytest.fixture()
def store() -> Iterator[MemoryKvChunkStore]:
    store = MemoryKvChunkStore(timeout_s=1.0)
    yield store
    store.close()


@pytest.fixture()
def fetches(store: MemoryKvChunkStore, monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    seen: list[bytes] = []
    fetch = store.fetch_record

    def counted(key: bytes, timeout_s: float) -> Any:
        seen.append(key)
        return fetch(key, timeout_s)

    monkeypatch.setattr(store, "fetch_record", counted)
    return seen


def test_a_newer_record_replaces_a_stale_copy(store: MemoryKvChunkStore) -> None:
    a, b = Replica(store), Replica(store)
    sid = a.calls.create(None, "", None).session_id
    a.turn(sid, [1, 2, 3])
    b.turn(sid, [4, 5])  # B restores the session from its record, then runs turn 2
    assert a.session(sid).history == [1, 2, 3, 4, 5]  # A's copy (turn 1) was stale
    assert a.table.replaced == 1 and a.get(sid).turns == 2


def test_a_current_copy_is_kept(store: MemoryKvChunkStore) -> None:
    a = Replica(store)
    sid = a.calls.create(None, "", None).session_id
    a.turn(sid, [1, 2, 3])
    copy = a.table.get(sid)
    copy.kv = ["parked KV"]
    assert a.session(sid) is copy and copy.kv == ["parked KV"]
    assert a.table.replaced == 0


def test_as_new_but_different_the_record_wins(store: MemoryKvChunkStore) -> None:
    """Two replicas that both ran 'turn 2' wrote the same version; the shared
    record, not either copy in memory, is the conversation."""
    a, b = Replica(store), Replica(store)
    sid = a.calls.create(None, "", None).session_id
    a.turn(sid, [1])
    b.session(sid)  # B holds version 2 too
    a.turn(sid, [2])  # A: version 3 with [1, 2]
    b.table.get(sid).history = [1, 9]  # B: version 3 with [1, 9], say its write failed
    b.table.get(sid).version = a.table.get(sid).version
    assert b.session(sid).history == [1, 2]


def test_a_get_session_vouches_for_the_turn_after_it(
    store: MemoryKvChunkStore, fetches: list[bytes]
) -> None:
    a = Replica(store)
    sid = a.calls.create(None, "", None).session_id
    a.get(sid)
    assert len(fetches) == 1
    a.get(sid)  # asked twice before a turn: still one fetch
    a.session(sid)  # the turn
    assert len(fetches) == 1
    a.session(sid)  # the next turn with no GetSession before it fetches
    assert len(fetches) == 2


def test_a_vouch_expires(
    store: MemoryKvChunkStore, fetches: list[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    a = Replica(store)
    sid = a.calls.create(None, "", None).session_id
    a.get(sid)
    monkeypatch.setattr(restores, "VOUCH_S", 0.0)
    a.session(sid)
    assert len(fetches) == 2


def test_a_busy_copy_is_used_and_never_replaced(store: MemoryKvChunkStore) -> None:
    a, b = Replica(store), Replica(store)
    sid = a.calls.create(None, "", None).session_id
    b.turn(sid, [7])
    a.table.get(sid).running_request_id = "running here"
    assert a.session(sid).history == []  # no fetch while its turn runs here
    stale = a.table.get(sid)
    assert a.table.adopt(b.table.get(sid)) is stale


def test_after_a_failed_fetch_copies_are_used_unchecked_for_a_while(
    store: MemoryKvChunkStore, fetches: list[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    a = Replica(store)
    sid = a.calls.create(None, "", None).session_id
    a.turn(sid, [1, 2])
    before = len(fetches)
    store.fail = True
    assert a.session(sid).history == [1, 2]  # the fetch failed: the copy in memory
    assert len(fetches) == before + 1
    a.session(sid)  # within RECHECK_AFTER_FAILURE_S: no fetch, no timeout paid
    assert len(fetches) == before + 1
    store.fail = False
    monkeypatch.setattr(restores, "RECHECK_AFTER_FAILURE_S", 0.0)
    a.session(sid)
    assert len(fetches) == before + 2


def test_a_session_closed_on_another_replica_is_not_found(store: MemoryKvChunkStore) -> None:
    a, b = Replica(store), Replica(store)
    sid = a.calls.create(None, "", None).session_id
    a.turn(sid, [1, 2])
    b.settle(b.calls.close(sid, ""))
    with pytest.raises(NotFound):
        a.get(sid)
    assert sid not in a.table
    fresh = Replica(store)  # nor does a replica that never held it restore it
    with pytest.raises(NotFound):
        fresh.get(sid)


def test_a_session_this_replica_does_not_hold_is_unavailable_while_the_store_is_down(
    store: MemoryKvChunkStore,
) -> None:
    """Issue 31: during a kvstore (or Redis) outage a replica that does not
    hold the session answered NOT_FOUND, which a client takes for the end of
    the conversation; it is UNAVAILABLE (retry), and the session is found again
    once the store answers. An id that was never handed out stays NOT_FOUND."""
    a, b = Replica(store), Replica(store)
    sid = a.calls.create(None, "", None).session_id
    a.turn(sid, [1, 2])
    store.fail = True
    with pytest.raises(Unavailable) as err:
        b.get(sid)
    assert err.value.message.startswith("session_id: ") and "retry" in err.value.message
    assert b.calls.restores is not None
    assert b.calls.restores.counters["session_record_fetches_unanswered"] == 1
    assert a.get(sid).history_tokens == 2  # a copy in memory is used as it is
    store.fail = False
    assert b.get(sid).history_tokens == 2
    with pytest.raises(NotFound):
        b.get("not-a-session-id")
