"""CONTEXT_OVERFLOW_SLIDE (docs/design.md, "Context window"): a sequence that
reaches the window drops its oldest tokens after the sink tokens and goes on,
the kept tokens at contiguous positions from 0. On 16-position tiny models the
tokens equal a from-scratch recompute that, at every step, runs the model on
exactly the retained tokens: always when the kept tokens are recomputed, and
with keys rotated by the shift where the KV of a position depends only on its
token and position (one layer: the rotation itself is exact)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from genai_common.errors import InvalidArgument
from genai_service.config import (
    CacheConfig,
    ContextConfig,
    EngineConfig,
    KvStoreConfig,
    RunnerConfig,
)
from genai_service.contract.request import (
    FinishReason,
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
)
from genai_service.engine.engine import LLMEngine
from genai_service.engine.kv.kv_connector_memory import MemoryKvChunkStore
from genai_service.engine.kv.window import SlidePolicy
from tests.tiny_model import (
    GQA_SPEC,
    TinyModelSpec,
    build_tiny_model,
    encode_words,
    reference_logits,
)

WINDOW = 16
PROMPT = encode_words("the cat sat on the mat")
OTHERS = [encode_words("a dog saw the big red box"), encode_words("hello , who are you ?")]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    specs = {
        "standard": TinyModelSpec(max_seq_len=WINDOW),  # plain ops: past/present, recompute
        "gqa": dataclasses.replace(GQA_SPEC, max_seq_len=WINDOW),
        "gqa_1layer": dataclasses.replace(GQA_SPEC, max_seq_len=WINDOW, num_layers=1),
    }
    return {k: build_tiny_model(tmp_path_factory.mktemp(k), s) for k, s in specs.items()}


def engine(
    model_dir: Path,
    runner: str = "auto",
    slide_kv: str = "auto",
    store: MemoryKvChunkStore | None = None,
    **context: object,
) -> LLMEngine:
    kvstore = None
    if store is not None:  # never dialled: ``chunk_store`` replaces the connector
        kvstore = KvStoreConfig("127.0.0.1:1", timeout_s=5.0, auth_token="unused")
    config = EngineConfig(
        model_dir=str(model_dir),
        runner=RunnerConfig(runner=runner),
        cache=CacheConfig(chunk_size=4),
        context=ContextConfig(overflow="slide", slide_kv=slide_kv, **context),  # type: ignore[arg-type]
        kvstore=kvstore,
    )
    return LLMEngine(config, chunk_store=store)


def request(rid: str, ids: list[int], n: int = 40, **kw: object) -> GenerationRequest:
    return GenerationRequest(
        rid,
        tuple(ids),
        stopping=StoppingCriteria(max_new_tokens=n, ignore_eos=True),
        **kw,  # type: ignore[arg-type]
    )


def slide(policy: SlidePolicy, ctx: list[int], keep_from: int) -> int:
    """Apply one slide to ``ctx`` as the engine must; returns the tokens dropped."""
    drop = policy.drop_for(len(ctx), keep_from)
    start = policy.sinks_for(keep_from)
    del ctx[start : start + drop]
    return drop


def recompute(model: Path, policy: SlidePolicy, ctx: list[int], n: int) -> list[int]:
    """Greedy decoding that runs the model from scratch on exactly the retained
    tokens at every step, sliding ``ctx`` in place as the window fills."""
    out = []
    for _ in range(n):
        token = int(np.argmax(reference_logits(model, ctx)))
        out.append(token)
        ctx.append(token)
        if len(ctx) >= policy.window and len(out) < n:
            slide(policy, ctx, len(ctx) - 1)
    return out


CASES = [
    ("standard", "past_present", "auto"),  # no rotary tables in the graph: recompute
    ("gqa", "past_present", "recompute"),
    ("gqa", "shared_buffer", "recompute"),
    ("gqa_1layer", "past_present", "rotate"),
    ("gqa_1layer", "shared_buffer", "rotate"),
]


@pytest.mark.parametrize(("model", "runner", "slide_kv"), CASES)
def test_a_stateless_request_slides_past_the_window_with_the_recomputed_tokens(
    models: dict[str, Path], model: str, runner: str, slide_kv: str
) -> None:
    eng = engine(models[model], runner, slide_kv)
    assert eng.runner.kind == runner
    assert eng.slide_kv == ("recompute" if model == "standard" else slide_kv)
    assert eng.window is not None
    out = eng.generate(request("a", PROMPT))
    assert out.finish_reason is FinishReason.MAX_TOKENS
    assert len(out.token_ids) == 40
    ctx = list(PROMPT)
    assert list(out.token_ids) == recompute(models[model], eng.window, ctx, 40)
    # every token past the window was dropped a block at a time; the prompt stays counted
    assert out.usage.prompt_tokens == len(PROMPT)
    assert out.usage.dropped_tokens == len(PROMPT) + 40 - len(ctx) - 0
    assert eng.counters["context_slides"] >= 3


@pytest.mark.parametrize(("model", "runner", "slide_kv"), CASES[1:])
def test_sliding_sequences_batched_with_others_keep_their_own_tokens(
    models: dict[str, Path], model: str, runner: str, slide_kv: str
) -> None:
    eng = engine(models[model], runner, slide_kv)
    assert eng.window is not None
    prompts = {"a": PROMPT, "b": OTHERS[0], "c": OTHERS[1]}
    batch = [request(rid, ids, n=30 if rid != "c" else 7) for rid, ids in prompts.items()]
    # "e" stops at the window as before: ERROR beside SLIDE in one batch
    batch.append(request("e", OTHERS[1], n=30, context_overflow="error"))
    results = eng.run_to_completion(batch)
    for rid in "ab":
        assert list(results[rid].token_ids) == recompute(
            models[model], eng.window, list(prompts[rid]), 30
        )
    assert list(results["c"].token_ids) == recompute(models[model], eng.window, list(OTHERS[1]), 7)
    assert results["e"].finish_reason is FinishReason.CONTEXT_LENGTH
    assert len(OTHERS[1]) + len(results["e"].token_ids) == WINDOW


TURNS = [PROMPT, OTHERS[0], OTHERS[1], encode_words("what is the time now ?"), PROMPT]


def run_turn(
    eng: LLMEngine, sid: str, rid: str, ids: list[int], n: int = 5, **kw: object
) -> list[int]:
    out = eng.generate(request(rid, ids, n=n, session_id=sid, **kw))
    while eng.has_unfinished():
        eng.step()  # the commit step parks the history's KV
    assert out.finish_reason is FinishReason.MAX_TOKENS
    return list(out.token_ids)


def session_reference(
    model: Path, policy: SlidePolicy, turns: list[list[int]], n: int = 5
) -> tuple[list[list[int]], list[int], int]:
    """Each turn's tokens, the history held after the last one and the tokens
    dropped, as the engine must produce them with the kept tokens recomputed."""
    ctx: list[int] = []
    dropped = 0
    answers = []
    for ids in turns:
        keep_from = len(ctx)
        ctx.extend(ids)
        if len(ctx) >= policy.window:
            dropped += slide(policy, ctx, keep_from)
        before = len(ctx)
        answers.append(recompute(model, policy, ctx, n))
        dropped += before + n - len(ctx)
    return answers, ctx, dropped


@pytest.mark.parametrize(("model", "runner", "slide_kv"), CASES[1:])
def test_a_session_whose_turns_cross_the_window_again_and_again(
    models: dict[str, Path], model: str, runner: str, slide_kv: str
) -> None:
    eng = engine(models[model], runner, slide_kv)
    assert eng.window is not None
    sid = eng.create_session(context_overflow="slide").session_id
    got = [run_turn(eng, sid, f"t{i}", ids) for i, ids in enumerate(TURNS)]
    answers, history, dropped = session_reference(models[model], eng.window, TURNS)
    assert got == answers
    info = eng.sessions.info(eng.sessions.get(sid))
    assert (info.turns, info.history_tokens, info.dropped_tokens) == (5, len(history), dropped)
    assert info.context_overflow == "slide"
    assert dropped >= 2 * eng.window.block  # it slid several times
    # the slid history's KV was parked and reused, not recomputed
    assert eng.counters["session_cached_tokens"] > 0


def test_a_restored_windowed_session_gives_the_tokens_of_one_that_never_left(
    models: dict[str, Path],
) -> None:
    """Rotated keys (two layers: no longer a fresh compute) come back from the
    kvstore under the session's lineage; the next turn on another engine equals
    the same turn on the engine that ran the session."""
    store = MemoryKvChunkStore(timeout_s=5.0)
    try:
        a = engine(models["gqa"], "shared_buffer", "rotate", store)
        sid = a.create_session(context_overflow="slide").session_id
        for i, ids in enumerate(TURNS[:4]):
            run_turn(a, sid, f"t{i}", ids)
        held = a.sessions.get(sid)
        assert held.dropped_tokens > 0 and held.lineage
        a.flush_finished()
        assert a.remote is not None
        a.remote.flush(5.0)  # what it shares is in the store
        # forks share the session's state: one continues here, the session itself on b
        here, there = (a.wait(a.fork_session(sid)).session_id for _ in range(2))
        stay = run_turn(a, here, "stay", TURNS[4])
        b = engine(models["gqa"], "shared_buffer", "rotate", store)
        moved = run_turn(b, sid, "moved", TURNS[4])
        assert moved == stay
        assert b.counters["kvstore_cached_tokens"] > 0
        assert b.sessions.get(sid).dropped_tokens > held.dropped_tokens
        assert run_turn(b, there, "fork", TURNS[4]) == stay
    finally:
        store.close()


def test_slid_keys_are_never_taken_for_a_fresh_prompts(models: dict[str, Path]) -> None:
    """Chunk keys chain over token ids and positions from a namespace: a
    sequence whose keys were rotated by a slide chains from its lineage, so a
    fresh prompt equal to its kept tokens reuses none of its KV; recomputed
    kept tokens are a fresh compute, and are shared."""
    for slide_kv, shared in (("rotate", False), ("recompute", True)):
        eng = engine(models["gqa"], "shared_buffer", slide_kv)
        out = eng.generate(request("slid", PROMPT, n=14))
        eng.flush_finished()
        ctx = list(PROMPT)
        assert eng.window is not None
        recompute_ids = recompute(models["gqa"], eng.window, ctx, 14)
        if slide_kv == "recompute":
            assert list(out.token_ids) == recompute_ids
        kept = ctx[:-1]  # the retained context, but the last token (never computed)
        probe = eng.generate(request("probe", kept, n=1, context_overflow="error"))
        assert (probe.usage.cached_tokens > 0) is shared, slide_kv


def test_errors_and_the_default(models: dict[str, Path], short_context_model_dir: Path) -> None:
    # the default stays ERROR: generation stops at the window
    plain = LLMEngine(EngineConfig(model_dir=str(short_context_model_dir)))
    out = plain.generate(request("e", PROMPT, n=40))
    assert out.finish_reason is FinishReason.CONTEXT_LENGTH
    # a request may ask for the slide on a server whose default is ERROR
    assert (
        plain.generate(request("s", PROMPT, n=40, context_overflow="slide")).usage.completion_tokens
        == 40
    )
    eng = engine(models["gqa"])
    sid = eng.create_session().session_id
    run_turn(eng, sid, "t0", PROMPT)
    # a turn's new input must fit beside the sink tokens the history keeps
    with pytest.raises(InvalidArgument) as err:
        eng.add_request(request("big", list(range(5, 17)), session_id=sid))
    assert err.value.message == (
        "input: 12 new tokens; the context window is 16 tokens and the session keeps 4 "
        "sink tokens, so a turn may add at most 11"
    )
    # no room to slide in the window: refused at startup when asked for, else per request
    with pytest.raises(ValueError, match="leave no room"):
        engine(models["gqa"], sink_tokens=8, slide_tokens=8)
    tight = LLMEngine(
        EngineConfig(model_dir=str(models["gqa"]), context=ContextConfig(sink_tokens=14))
    )
    with pytest.raises(InvalidArgument) as err:
        tight.add_request(request("x", PROMPT, context_overflow="slide"))
    assert err.value.message == (
        "context_overflow: slide is not possible in this server's 16-token context window"
    )
    # rotate needs the graph's rotary tables
    with pytest.raises(ValueError, match="rotate needs"):
        engine(models["standard"], slide_kv="rotate")


def test_a_rewind_reaches_only_what_the_window_still_holds(models: dict[str, Path]) -> None:
    eng = engine(models["gqa"], slide_kv="recompute")
    sid = eng.create_session().session_id
    short = [encode_words(w) for w in ("the cat", "a dog", "the mat", "a box", "the tree")]
    for i, ids in enumerate(short):
        run_turn(eng, sid, f"t{i}", ids, n=2)
    session = eng.sessions.get(sid)
    assert session.dropped_tokens > 0
    gone = [i + 1 for i, e in enumerate(session.turn_ends) if e < 0]
    held = [i + 1 for i, e in enumerate(session.turn_ends) if e >= 0]
    target = next(t for t in held if t > gone[-1])  # held again after the gap
    assert gone and target < session.turns
    with pytest.raises(InvalidArgument) as err:
        eng.wait(eng.rewind_session(sid, turns=gone[-1]))
    assert err.value.message == (
        f"turns: {gone[-1]} is no longer held; the session's context window slid past its "
        f"end (turn {held[0]} is the earliest it holds; 0 empties the history)"
    )
    end = session.turn_ends[target - 1]
    info = eng.wait(eng.rewind_session(sid, turns=target))
    assert (info.turns, info.history_tokens) == (target, end)
    with pytest.raises(InvalidArgument):
        eng.wait(eng.rewind_session(sid, history_tokens=end + 1))
    # a seeded turn after the rewind equals the same turn on a fork of it
    fork = eng.wait(eng.fork_session(sid)).session_id
    seeded = SamplingParams(temperature=1.0, seed=3)
    a = run_turn(eng, sid, "a", short[0], sampling=seeded)
    b = run_turn(eng, fork, "b", short[0], sampling=seeded)
    assert a == b
