from __future__ import annotations

import pytest

from genai_service.engine.sessions import SessionTable
from genai_service.errors import FailedPrecondition, NotFound, ResourceExhausted


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_create_get_and_ids_are_128_bit_random() -> None:
    table = SessionTable(max_sessions=4, idle_ttl_s=10)
    a, b = table.create(), table.create()
    assert len(a.session_id) == 32 and a.session_id != b.session_id
    assert table.get(a.session_id) is a


def test_unknown_and_expired_sessions_are_not_found_alike() -> None:
    clock = Clock()
    table = SessionTable(max_sessions=4, idle_ttl_s=10, clock=clock)
    s = table.create()
    clock.now += 11
    with pytest.raises(NotFound) as expired:
        table.get(s.session_id)
    with pytest.raises(NotFound) as unknown:
        table.get("nope")
    assert "no session" in expired.value.message and "no session" in unknown.value.message
    assert len(table) == 0


def test_max_sessions() -> None:
    table = SessionTable(max_sessions=1, idle_ttl_s=10)
    table.create()
    with pytest.raises(ResourceExhausted, match="limit is 1"):
        table.create()


def test_one_turn_at_a_time_and_reset_close() -> None:
    evicted = []
    table = SessionTable(max_sessions=2, idle_ttl_s=10, on_evict=evicted.append)
    s = table.create()
    table.begin_turn(s.session_id, "r1")
    with pytest.raises(FailedPrecondition, match="already running a turn"):
        table.begin_turn(s.session_id, "r2")
    with pytest.raises(FailedPrecondition):
        table.reset(s.session_id)
    table.end_turn(s)
    s.history = [1, 2, 3]
    s.kv, s.kv_len = object(), 3
    table.reset(s.session_id)
    assert s.history == [] and s.kv is None and evicted == [s]
    table.close(s.session_id)
    with pytest.raises(NotFound):
        table.get(s.session_id)


def test_busy_sessions_do_not_expire() -> None:
    clock = Clock()
    table = SessionTable(max_sessions=2, idle_ttl_s=1, clock=clock)
    s = table.create()
    table.begin_turn(s.session_id, "r")
    clock.now += 5
    assert table.get(s.session_id) is s
