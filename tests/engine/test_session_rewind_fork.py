"""RewindSession and ForkSession in the engine (docs/design.md, "Sessions"): a
rewound or forked session continues exactly as a session that only ever had the
kept history, keeps (or shares) the KV of it, and survives a restart through
the kvstore; on the tiny "words" model with 4-token chunks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from genai_common.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from genai_service.config import CacheConfig, EngineConfig, KvStoreConfig
from genai_service.contract.request import GenerationRequest, SamplingParams, StoppingCriteria
from genai_service.engine.engine import LLMEngine
from genai_service.engine.kv.kv_connector_memory import MemoryKvChunkStore
from tests.tiny_model import encode_words, reference_greedy

T1 = encode_words("hello , who are you ?")
T2 = encode_words("what is the time now ?")
T3 = encode_words("the cat sat on the mat")
T2B = encode_words("where is the big red box ?")


def engine(model_dir: Path, store: MemoryKvChunkStore | None = None) -> LLMEngine:
    kvstore = None
    if store is not None:  # never dialled: ``chunk_store`` replaces the connector
        kvstore = KvStoreConfig("127.0.0.1:1", timeout_s=5.0, auth_token="unused")
    return LLMEngine(
        EngineConfig(model_dir=str(model_dir), cache=CacheConfig(chunk_size=4), kvstore=kvstore),
        chunk_store=store,
    )


def turn(
    eng: LLMEngine,
    sid: str,
    rid: str,
    ids: list[int],
    n: int = 5,
    seed: int | None = None,
    principal: str = "",
) -> list[int]:
    sampling = SamplingParams() if seed is None else SamplingParams(temperature=1.0, seed=seed)
    request = GenerationRequest(
        rid,
        tuple(ids),
        sampling=sampling,
        stopping=StoppingCriteria(max_new_tokens=n, ignore_eos=True),
        session_id=sid,
        principal=principal,
    )
    out = eng.generate(request)
    while eng.has_unfinished():
        eng.step()  # the commit step parks the history's KV
    return list(out.token_ids)


def turn_left_committing(eng: LLMEngine, sid: str) -> list[int]:
    """A first turn (T1, 5 tokens) run until its output is final but not one
    step further: its last token's KV is computed next step. The history."""
    out = eng.generate(
        GenerationRequest(
            "t1",
            tuple(T1),
            stopping=StoppingCriteria(max_new_tokens=5, ignore_eos=True),
            session_id=sid,
        )
    )
    assert eng.sessions.get(sid).committing  # its last token's KV is computed next step
    return T1 + list(out.token_ids)


def test_rewind_to_a_turn_then_a_turn_equals_a_session_that_only_had_those_turns(
    tiny_model_dir: Path,
) -> None:
    eng = engine(tiny_model_dir)
    sid = eng.create_session().session_id
    r1 = turn(eng, sid, "t1", T1)
    history1 = T1 + r1
    turn(eng, sid, "t2", T2)
    turn(eng, sid, "t3", T3)
    info = eng.rewind_session(sid, turns=1)
    assert (info.turns, info.history_tokens) == (1, len(history1))
    # greedy: the next turn is the model's answer to the kept history alone ...
    assert turn(eng, sid, "t2b", T2B) == reference_greedy(tiny_model_dir, history1 + T2B, 5)
    assert eng.counters["session_cached_tokens"] > 0
    # ... and seeded: the same tokens as a fresh session's with the same seed
    eng.rewind_session(sid, turns=1)
    sampled = turn(eng, sid, "s2", T2B, seed=7)
    fresh = eng.create_session().session_id
    assert turn(eng, fresh, "f1", T1) == r1
    assert turn(eng, fresh, "f2", T2B, seed=7) == sampled
    # to no turn at all: an empty history, the first turn again
    info = eng.rewind_session(sid, turns=0)
    assert (info.turns, info.history_tokens) == (0, 0)
    assert turn(eng, sid, "again", T1) == r1


def test_rewind_keeps_the_kv_of_what_is_kept_even_mid_chunk(tiny_model_dir: Path) -> None:
    eng = engine(tiny_model_dir)
    sid = eng.create_session().session_id
    history = T1 + turn(eng, sid, "t1", T1, n=7)
    assert len(history) > 9
    cut = 9  # not a multiple of the 4-token chunk
    info = eng.rewind_session(sid, history_tokens=cut)
    assert (info.history_tokens, info.turns) == (cut, 0)  # the cut is inside turn 1
    session = eng.sessions.get(sid)
    assert session.kv_len == cut and sum(c[0][0].shape[1] for c in session.kv or []) == cut
    before = eng.counters["computed_tokens"]
    out = turn(eng, sid, "t2", T2)
    assert out == reference_greedy(tiny_model_dir, history[:cut] + T2, 5)
    # no re-prefill of the kept history: the new input, the decodes, the commit
    assert eng.counters["computed_tokens"] - before == len(T2) + 4 + 1


def test_rewind_errors(tiny_model_dir: Path) -> None:
    eng = engine(tiny_model_dir)
    sid = eng.create_session(owner="alice").session_id
    turn(eng, sid, "t1", T1, principal="alice")
    n = eng.get_session(sid, "alice").history_tokens
    with pytest.raises(InvalidArgument) as err:
        eng.rewind_session(sid, "alice", turns=2)
    assert err.value.message == "turns: 2 is past the end; the session has 1 turns"
    with pytest.raises(InvalidArgument) as err:
        eng.rewind_session(sid, "alice", history_tokens=n + 1)
    assert err.value.message == (
        f"history_tokens: {n + 1} is past the end; the session holds {n} tokens"
    )
    with pytest.raises(PermissionDenied):
        eng.rewind_session(sid, "mallory", turns=0)
    with pytest.raises(PermissionDenied):
        eng.fork_session(sid, "mallory")
    eng.add_request(
        GenerationRequest(
            "busy",
            tuple(T2),
            stopping=StoppingCriteria(max_new_tokens=3, ignore_eos=True),
            session_id=sid,
            principal="alice",
        )
    )
    with pytest.raises(FailedPrecondition):
        eng.rewind_session(sid, "alice", turns=0)
    while eng.has_unfinished():
        eng.step()
    assert eng.get_session(sid, "alice").turns == 2


def test_a_fork_shares_the_parents_kv_and_each_goes_its_own_way(tiny_model_dir: Path) -> None:
    eng = engine(tiny_model_dir)
    parent = eng.create_session().session_id
    history1 = T1 + turn(eng, parent, "t1", T1)
    history2 = history1 + T2 + turn(eng, parent, "t2", T2)
    whole = eng.fork_session(parent, metadata={"branch": "b"})
    first = eng.fork_session(parent, turns=1)
    assert (whole.turns, whole.history_tokens, whole.metadata) == (
        2,
        len(history2),
        {"branch": "b"},
    )
    assert (first.turns, first.history_tokens) == (1, len(history1))
    chunks = eng.sessions.get(parent).kv
    forked = eng.sessions.get(whole.session_id).kv
    assert chunks is not None and forked is not None and forked is not chunks
    assert all(a is b for a, b in zip(forked, chunks, strict=True))  # shared, not copied
    # each continues as a session with its history alone would
    assert turn(eng, whole.session_id, "w3", T3) == reference_greedy(
        tiny_model_dir, history2 + T3, 5
    )
    assert turn(eng, first.session_id, "f2", T2B) == reference_greedy(
        tiny_model_dir, history1 + T2B, 5
    )
    assert turn(eng, parent, "p3", T2B) == reference_greedy(tiny_model_dir, history2 + T2B, 5)
    assert eng.get_session(parent).history_tokens == len(history2) + len(T2B) + 5
    eng.close_session(parent)
    assert turn(eng, first.session_id, "f3", T3)  # the fork outlives its parent
    assert eng.get_session(first.session_id).turns == 3


def test_rewound_and_forked_sessions_continue_on_another_engine(tiny_model_dir: Path) -> None:
    store = MemoryKvChunkStore(timeout_s=5.0)
    try:
        a = engine(tiny_model_dir, store)
        sid = a.create_session().session_id
        history1 = T1 + turn(a, sid, "t1", T1)
        turn(a, sid, "t2", T2)
        fork = a.wait(a.fork_session(sid)).session_id
        history2 = a.wait(a.get_session(fork)).history_tokens
        a.wait(a.rewind_session(sid, turns=1))
        b = engine(tiny_model_dir, store)  # another replica (or a restart): records only
        assert turn(b, sid, "b2", T3) == reference_greedy(tiny_model_dir, history1 + T3, 5)
        out = turn(b, fork, "bf", T3)
        assert len(out) == 5 and b.sessions.get(fork).turns == 3
        assert len(b.sessions.get(fork).history) == history2 + len(T3) + 5
        # the restored session keeps its turn boundaries: it rewinds by turns there too
        assert b.wait(b.rewind_session(fork, turns=1)).history_tokens == len(history1)
    finally:
        store.close()


def test_turn_boundaries_round_trip_through_the_record() -> None:
    from genai_service.engine.sessions.sessions import (
        Session,
        session_from_record,
        session_record,
    )

    s = Session("a" * 32, 1.0, 2.0, 60.0, history=[1, 2, 3, 4], turns=2, turn_ends=[2, 4])
    back = session_from_record(s.session_id, session_record(s), vocab_size=10)
    assert back is not None and back.turn_ends == [2, 4] and back.turns == 2
    old = dataclasses.replace(s, turn_ends=[])  # a record from before turn_ends
    back = session_from_record(old.session_id, session_record(old), vocab_size=10)
    assert back is not None and back.turn_ends == []


def test_a_rewind_right_after_a_turn_keeps_the_kv_of_the_prefix(tiny_model_dir: Path) -> None:
    eng = engine(tiny_model_dir)
    sid = eng.create_session().session_id
    history = turn_left_committing(eng, sid)
    assert eng.rewind_session(sid, history_tokens=6).history_tokens == 6
    while eng.has_unfinished():
        eng.step()
    session = eng.sessions.get(sid)
    assert session.kv_len == 6 and session.kv is not None
    assert all(k.base is None for chunk in session.kv for k, _ in chunk[:1])  # no views
    assert turn(eng, sid, "t2", T2) == reference_greedy(tiny_model_dir, history[:6] + T2, 5)


def test_a_fork_right_after_a_turn_gets_the_kv_of_the_last_token_too(
    tiny_model_dir: Path,
) -> None:
    eng = engine(tiny_model_dir)
    sid = eng.create_session().session_id
    history = turn_left_committing(eng, sid)
    whole = eng.fork_session(sid).session_id
    assert eng.sessions.get(whole).committing  # so the fork's first turn waits for it
    while eng.has_unfinished():
        eng.step()
    child = eng.sessions.get(whole)
    assert not child.committing and child.kv_len == len(history)
    parent_kv = eng.sessions.get(sid).kv
    assert parent_kv is not None and child.kv is not None
    assert all(a is b for a, b in zip(child.kv, parent_kv, strict=True))  # shared, not copied
    before = eng.counters["computed_tokens"]
    assert turn(eng, whole, "f2", T2) == reference_greedy(tiny_model_dir, history + T2, 5)
    assert eng.counters["computed_tokens"] - before == len(T2) + 4 + 1  # no re-prefill


def test_forks_of_a_fork_and_a_turn_queued_before_the_commit_get_the_kv(
    tiny_model_dir: Path,
) -> None:
    eng = engine(tiny_model_dir)
    sid = eng.create_session().session_id
    history = turn_left_committing(eng, sid)
    child = eng.fork_session(sid).session_id
    grandchild = eng.fork_session(child).session_id  # its parent awaits the KV itself
    assert eng.sessions.get(grandchild).committing
    # a turn on the child queued before the commit step (as one pipe read may do)
    request = GenerationRequest(
        "c2",
        tuple(T2),
        stopping=StoppingCriteria(max_new_tokens=5, ignore_eos=True),
        session_id=child,
    )
    before = eng.counters["computed_tokens"]
    result = eng.generate(request)  # steps until done: the commit first, then the turn
    assert list(result.token_ids) == reference_greedy(tiny_model_dir, history + T2, 5)
    assert result.usage.cached_tokens == len(history)
    # the parent's commit (1), the child's input and its decodes: no re-prefill
    assert eng.counters["computed_tokens"] - before == 1 + len(T2) + 4
    while eng.has_unfinished():
        eng.step()
    g = eng.sessions.get(grandchild)
    assert not g.committing and g.kv_len == len(history)
    assert turn(eng, grandchild, "g2", T3) == reference_greedy(tiny_model_dir, history + T3, 5)


def test_a_fork_that_evicts_its_parent_keeps_the_kv() -> None:
    import numpy as np

    from genai_service.engine.sessions.sessions import SessionTable

    table = SessionTable(1, 60.0, persistent=True)  # full with the parent alone
    parent = table.create()
    layers = [(np.zeros((1, 8, 2), np.float32), np.zeros((1, 8, 2), np.float32))]
    parent.history, parent.turns, parent.turn_ends = list(range(8)), 1, [8]
    parent.kv, parent.kv_len = [layers], 8
    child = table.fork(parent, None, None, "", None)
    assert parent.session_id not in table  # evicted to its record to make room
    assert child.kv == [layers] and child.kv_len == 8 and child.history == list(range(8))


def test_a_token_rewind_of_a_session_without_boundaries_keeps_its_turns() -> None:
    from genai_service.engine.sessions.sessions import SessionTable

    table = SessionTable(4, 60.0)
    s = table.create()
    s.history, s.turns = list(range(10)), 3  # from a record written before turn_ends
    assert table.rewind(s.session_id, history_tokens=10).turns == 3
    assert table.rewind(s.session_id, history_tokens=4).turns == 0
