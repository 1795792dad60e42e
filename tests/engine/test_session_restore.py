"""Sessions restored from their kvstore records never stall the engine loop.

The in-memory connector is made slow (``delay_s``): a record fetch takes that
long, yet every ``step`` (and the call that started the fetch) returns at
once, other sequences keep decoding, and only the call or request that needs
the record waits for it (docs/design.md "Sessions").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from genai_common.errors import NotFound, ResourceExhausted
from genai_service.config import (
    CacheConfig,
    EngineConfig,
    KvStoreConfig,
    SchedulerConfig,
    SessionConfig,
)
from genai_service.contract.request import (
    FinishReason,
    GenerationRequest,
    RequestOutput,
    StoppingCriteria,
)
from genai_service.engine.engine import LLMEngine
from genai_service.engine.kv.kv_connector_memory import MemoryKvChunkStore
from genai_service.engine.sessions.restores import PendingCall
from tests.tiny_model import encode_words, reference_greedy

DELAY_S = 2.0  # each record fetch (and prefetch) takes this long once set
FAST_S = 1.0  # a call or a step "returns at once": half DELAY_S, as before
T1 = encode_words("hello , who are you ?")
T2 = encode_words("what is the time now ?")
STREAM = encode_words("the old house was big and red")


def make_engine(model_dir: Path, store: MemoryKvChunkStore, **config: object) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model_dir=str(model_dir),
            cache=CacheConfig(chunk_size=4),
            **config,  # type: ignore[arg-type]
            # the target is never dialled: ``chunk_store`` replaces the connector
            kvstore=KvStoreConfig("127.0.0.1:1", timeout_s=5.0, auth_token="unused"),
        ),
        chunk_store=store,
    )


def greedy(rid: str, ids: list[int], n: int, **kw: object) -> GenerationRequest:
    return GenerationRequest(
        rid, tuple(ids), stopping=StoppingCriteria(max_new_tokens=n, ignore_eos=True), **kw
    )


@pytest.fixture()
def store() -> Iterator[MemoryKvChunkStore]:
    store = MemoryKvChunkStore(timeout_s=5.0)
    yield store
    store.close()


@pytest.fixture()
def saved_session(long_context_model_dir: Path, store: MemoryKvChunkStore) -> tuple[str, list[int]]:
    """A session with one turn, written to ``store`` by another engine; its history."""
    a = make_engine(long_context_model_dir, store)
    sid = a.create_session().session_id
    r1 = a.generate(greedy("t1", T1, 5, session_id=sid))  # not closed: it would close ``store``
    return sid, T1 + list(r1.token_ids)


class Stepper:
    """Steps an engine, timing every step and keeping every output by request."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.outputs: dict[str, list[RequestOutput]] = {}
        self.slowest_s = 0.0

    def step(self) -> None:
        started = time.monotonic()
        outs = self.engine.step()
        self.slowest_s = max(self.slowest_s, time.monotonic() - started)
        for out in outs:
            self.outputs.setdefault(out.request_id, []).append(out)
        if self.engine.last_step_idle:
            time.sleep(0.001)

    def until(self, done: Callable[[], bool], timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, "timed out stepping the engine"
            self.step()

    def tokens(self, rid: str) -> list[int]:
        return [t for out in self.outputs.get(rid, []) for t in out.token_ids]

    def finished(self, rid: str) -> bool:
        outs = self.outputs.get(rid)
        return bool(outs) and outs[-1].finished


def start_stream(stepper: Stepper, store: MemoryKvChunkStore) -> None:
    """A long stream decoding before the store turns slow (its own prefetch is done)."""
    stepper.engine.add_request(greedy("stream", STREAM, 3000))
    stepper.until(lambda: len(stepper.tokens("stream")) >= 2)
    store.delay_s = DELAY_S
    # Only the steps from here on count: the first ones (this engine's first ORT
    # run, the prefill) may take a second on a loaded 2-core machine, and wait
    # on nothing slow.
    stepper.slowest_s = 0.0


def test_a_session_lookup_returns_at_once_and_never_blocks_a_step(
    long_context_model_dir: Path,
    store: MemoryKvChunkStore,
    saved_session: tuple[str, list[int]],
) -> None:
    sid, history = saved_session
    b = Stepper(make_engine(long_context_model_dir, store))
    start_stream(b, store)
    started = time.monotonic()
    pending = b.engine.get_session(sid)
    assert time.monotonic() - started < FAST_S
    assert isinstance(pending, PendingCall) and not pending.done
    before = len(b.tokens("stream"))
    b.until(lambda: pending.done)
    waited = time.monotonic() - started
    assert waited >= DELAY_S * 0.9  # the record really took that long to come
    assert b.slowest_s < FAST_S  # ...and no step waited for it
    assert len(b.tokens("stream")) - before >= 10  # the stream kept decoding meanwhile
    assert pending.ok and pending.value.turns == 1
    assert pending.value.history_tokens == len(history)
    assert b.engine.counters["sessions_restored"] == 1
    # now in memory: answered at once
    assert b.engine.get_session(sid).history_tokens == len(history)
    b.engine.abort("stream")
    b.engine.flush_finished()


def test_a_turn_waits_outside_the_scheduler_then_runs_exactly(
    long_context_model_dir: Path,
    store: MemoryKvChunkStore,
    saved_session: tuple[str, list[int]],
) -> None:
    sid, history = saved_session
    b = Stepper(make_engine(long_context_model_dir, store))
    start_stream(b, store)
    started = time.monotonic()
    b.engine.add_request(greedy("t2", T2, 6, session_id=sid))
    assert time.monotonic() - started < FAST_S
    b.step()
    stats = b.engine.stats()
    assert stats["waiting"] == 0 and stats["running"] == 1  # only the stream
    b.until(lambda: b.finished("t2"))
    assert time.monotonic() - started >= DELAY_S * 0.9
    assert b.slowest_s < FAST_S
    assert b.tokens("t2") == reference_greedy(long_context_model_dir, history + T2, 6)
    final = b.outputs["t2"][-1]
    assert final.error is None and final.session_tokens == len(history) + len(T2) + 6
    assert b.engine.wait(b.engine.get_session(sid)).turns == 2
    b.engine.abort("stream")
    b.engine.flush_finished()


def test_unknown_sessions_end_not_found_after_the_fetch(
    long_context_model_dir: Path, store: MemoryKvChunkStore
) -> None:
    b = Stepper(make_engine(long_context_model_dir, store))
    start_stream(b, store)
    unknown = "0" * 32  # well formed: only the kvstore can say it is unknown
    b.engine.add_request(greedy("lost", T2, 4, session_id=unknown))
    pending = [
        b.engine.get_session(unknown),
        b.engine.reset_session(unknown),
        b.engine.close_session(unknown),
    ]
    assert all(isinstance(p, PendingCall) for p in pending)
    b.until(lambda: b.finished("lost") and all(p.done for p in pending))
    assert b.slowest_s < FAST_S
    (out,) = b.outputs["lost"]
    assert (
        isinstance(out.error, NotFound)
        and out.error.message == f"session_id: no session {unknown!r}"
    )
    for p in pending:
        assert not p.ok and isinstance(p.value, NotFound)
    with pytest.raises(NotFound):  # a malformed id needs no lookup at all
        b.engine.get_session("not-a-session")
    b.engine.abort("stream")
    b.engine.flush_finished()


def test_a_waiting_turn_can_be_cancelled(
    long_context_model_dir: Path,
    store: MemoryKvChunkStore,
    saved_session: tuple[str, list[int]],
) -> None:
    sid, history = saved_session
    b = Stepper(make_engine(long_context_model_dir, store))
    store.delay_s = DELAY_S
    b.engine.add_request(greedy("t2", T2, 6, session_id=sid))
    assert b.engine.abort("t2")
    b.step()
    (out,) = b.outputs["t2"]
    assert out.finished and out.finish_reason is FinishReason.CANCELLED and out.error is None
    # the record still arrives; the session is restored idle, the turn never runs
    info = b.engine.wait(b.engine.get_session(sid))
    assert not info.busy and info.turns == 1 and info.history_tokens == len(history)
    assert b.outputs["t2"] == [out] and b.engine.counters["requests_added"] == 0
    b.engine.flush_finished()


def test_reset_and_close_of_a_session_not_in_memory(
    long_context_model_dir: Path,
    store: MemoryKvChunkStore,
    saved_session: tuple[str, list[int]],
) -> None:
    sid, _ = saved_session
    b = make_engine(long_context_model_dir, store)
    store.delay_s = 0.2
    assert b.wait(b.reset_session(sid)).history_tokens == 0
    b.sessions.close(sid)  # evict it from memory again: the reset record is in the store
    assert b.wait(b.get_session(sid)).history_tokens == 0
    b.sessions.close(sid)
    b.wait(b.close_session(sid))  # restores it, then closes it and deletes its record
    with pytest.raises(NotFound):
        b.wait(b.get_session(sid))


def test_kv_prefetch_never_blocks_a_step(
    long_context_model_dir: Path, store: MemoryKvChunkStore
) -> None:
    """KvReuse.attach only polls its prefetch: a request whose chunks are on
    their way waits in the queue while others step."""
    prompt = encode_words("the cat sat on the mat and the dog sat in the box")
    a = make_engine(long_context_model_dir, store)
    a.generate(greedy("seed", prompt, 2))
    b = Stepper(make_engine(long_context_model_dir, store))
    start_stream(b, store)
    started = time.monotonic()
    b.engine.add_request(greedy("reuse", prompt, 4))
    b.until(lambda: b.finished("reuse"))
    assert time.monotonic() - started >= DELAY_S * 0.9 and b.slowest_s < FAST_S
    assert b.tokens("reuse") == reference_greedy(long_context_model_dir, prompt, 4)
    assert b.outputs["reuse"][-1].usage.cached_tokens == (len(prompt) - 1) // 4 * 4
    b.engine.abort("stream")
    b.engine.flush_finished()


def test_pending_call_answers_once() -> None:
    seen: list[tuple[bool, object]] = []
    call = PendingCall()
    call.add_done_callback(lambda ok, v: seen.append((ok, v)))
    call.resolve(lambda: 7)
    call.resolve(lambda: 8)  # already answered
    call.add_done_callback(lambda ok, v: seen.append((ok, v)))  # late: called now
    assert seen == [(True, 7), (True, 7)]
    failing = PendingCall()
    failing.resolve(lambda: (_ for _ in ()).throw(NotFound("gone")))
    assert not failing.ok and isinstance(failing.value, NotFound)
    cancelled = PendingCall()
    cancelled.add_done_callback(lambda ok, v: seen.append((ok, v)))
    cancelled.cancel()
    cancelled.resolve(lambda: 9)
    assert seen == [(True, 7), (True, 7)]


def test_record_fetches_and_parked_turns_are_bounded(
    long_context_model_dir: Path, store: MemoryKvChunkStore
) -> None:
    """Lookups of made-up ids against a stalled kvstore cannot pile up: past
    ``max_record_fetches`` sessions being fetched a call for another one is
    RESOURCE_EXHAUSTED at once, and turns parked for their record count toward
    the queue bound."""
    engine = make_engine(
        long_context_model_dir,
        store,
        sessions=SessionConfig(max_record_fetches=3),
        scheduler=SchedulerConfig(max_queue=2),
    )
    store.delay_s = DELAY_S
    ids = [f"{i:032x}" for i in range(1, 6)]
    pending = [engine.get_session(sid) for sid in ids[:3]]
    assert all(isinstance(p, PendingCall) for p in pending)
    assert isinstance(engine.get_session(ids[0]), PendingCall)  # joins the fetch in flight
    with pytest.raises(ResourceExhausted, match="at most 3 at once"):
        engine.get_session(ids[3])
    assert engine.stats()["session_record_fetches_refused"] == 1

    engine.add_request(greedy("p1", T2, 2, session_id=ids[0]))
    engine.add_request(greedy("p2", T2, 2, session_id=ids[1]))
    with pytest.raises(ResourceExhausted, match="queue: 2 requests waiting, the limit is 2"):
        engine.add_request(greedy("p3", T2, 2, session_id=ids[2]))
    deadline = time.monotonic() + 30
    while not all(p.done for p in pending) and time.monotonic() < deadline:
        engine.step()
        time.sleep(0.01)
    assert all(p.done and isinstance(p.value, NotFound) for p in pending)
    assert isinstance(engine.get_session(ids[4]), PendingCall)  # room again


def test_turns_of_a_session_in_memory_parked_for_its_record_count_toward_the_queue(
    long_context_model_dir: Path, store: MemoryKvChunkStore
) -> None:
    """With a kvstore a session in memory is checked against its record before
    a turn runs (docs/design.md, "Routing a session's turns"), so its turns park
    too, and the queue bound holds for them."""
    engine = make_engine(long_context_model_dir, store, scheduler=SchedulerConfig(max_queue=2))
    sid = engine.create_session().session_id
    store.delay_s = DELAY_S  # the record check stays in flight
    engine.add_request(greedy("q1", T2, 2, session_id=sid))
    engine.add_request(greedy("q2", T2, 2, session_id=sid))
    with pytest.raises(ResourceExhausted, match="queue: 2 requests waiting, the limit is 2"):
        engine.add_request(greedy("q3", T2, 2, session_id=sid))
    assert sid in engine.sessions  # in memory all along
