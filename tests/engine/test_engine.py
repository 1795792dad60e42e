"""The engine end to end on tiny models: exact tokens against the full-recompute reference."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from genai_common.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from genai_service.config import (
    CacheConfig,
    EngineConfig,
    LimitsConfig,
    RunnerConfig,
    SchedulerConfig,
)
from genai_service.contract.request import (
    FinishReason,
    GenerationRequest,
    Priority,
    SamplingParams,
    StoppingCriteria,
    collect,
)
from genai_service.engine.engine import LLMEngine
from genai_service.engine.kv.kv_connector_memory import MemoryKvChunkStore
from genai_service.engine.kv.prefix_cache import chunk_keys
from genai_service.engine.sampling import sampler
from genai_service.engine.sampling_rows import TokenPicker
from tests.tiny_model import EOS_ID, encode_words, reference_greedy

PROMPTS = [
    "the cat sat on the mat",
    "hello",
    "where is the big red box ? it was under the old tree and the dog saw it",
    "two birds",
]


def make_engine(model_dir: Path, **overrides) -> LLMEngine:
    config = EngineConfig(
        model_dir=str(model_dir),
        runner=overrides.pop("runner", RunnerConfig()),
        scheduler=overrides.pop("scheduler", SchedulerConfig()),
        cache=overrides.pop("cache", CacheConfig(chunk_size=4)),
        limits=overrides.pop("limits", LimitsConfig()),
        **overrides,
    )
    return LLMEngine(config)


def greedy(rid: str, prompt: str | list[int], n: int, **stopping) -> GenerationRequest:
    ids = encode_words(prompt) if isinstance(prompt, str) else prompt
    return GenerationRequest(
        rid, tuple(ids), stopping=StoppingCriteria(max_new_tokens=n, ignore_eos=True, **stopping)
    )


RUNNERS = [
    ("rope", "past_present"),
    ("learned", "past_present"),
    ("gqa", "past_present"),
    ("gqa", "shared_buffer"),
    ("gqa-learned", "past_present"),
    ("gqa-learned", "shared_buffer"),
]


@pytest.mark.parametrize(("variant", "runner"), RUNNERS)
def test_kv_path_equals_full_recompute_batched(
    tiny_models: dict[str, Path], variant: str, runner: str
) -> None:
    """All prompts run together: batched decode of sequences of different lengths."""
    model_dir = tiny_models[variant]
    engine = make_engine(
        model_dir,
        cache=CacheConfig(chunk_size=4, prefix_cache_bytes=0),
        runner=RunnerConfig(runner=runner),
    )
    assert engine.runner.kind == runner
    results = engine.run_to_completion(greedy(f"r{i}", p, 12) for i, p in enumerate(PROMPTS))
    for i, prompt in enumerate(PROMPTS):
        want = reference_greedy(model_dir, encode_words(prompt), 12)
        assert list(results[f"r{i}"].token_ids) == want, prompt


@pytest.mark.parametrize(("variant", "runner"), RUNNERS)
def test_chunked_prefill_and_sequences_joining_mid_batch(
    tiny_models: dict[str, Path], variant: str, runner: str
) -> None:
    model_dir = tiny_models[variant]
    engine = make_engine(
        model_dir,
        scheduler=SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=5),
        cache=CacheConfig(chunk_size=4, prefix_cache_bytes=0),
        runner=RunnerConfig(runner=runner),
    )
    outs: dict[str, list] = {}
    engine.add_request(greedy("a", PROMPTS[0], 10))
    engine.add_request(greedy("b", PROMPTS[2], 6))
    for step in range(200):
        if step == 3:
            engine.add_request(greedy("c", PROMPTS[3], 8))  # joins while a and b decode
        if step == 6:
            engine.add_request(greedy("d", PROMPTS[1], 5))  # waits for a free slot
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
        if len(outs) == 4 and all(o[-1].finished for o in outs.values()):
            break
    for rid, prompt, n in (("a", 0, 10), ("b", 2, 6), ("c", 3, 8), ("d", 1, 5)):
        want = reference_greedy(model_dir, encode_words(PROMPTS[prompt]), n)
        assert list(collect(outs[rid]).token_ids) == want, rid
    if runner == "shared_buffer":
        assert engine.runner.moves > 0  # b left before c: c's slot was compacted


def test_two_turn_session_equals_one_request_over_the_history(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, cache=CacheConfig(chunk_size=4, prefix_cache_bytes=0))
    session = engine.create_session()
    turn1_in = encode_words("hello , who are you ?")
    r1 = engine.generate(
        dataclasses.replace(greedy("t1", turn1_in, 7), session_id=session.session_id)
    )
    turn2_in = encode_words("what is the time now ?")
    before = engine.counters["computed_tokens"]
    r2 = engine.generate(
        dataclasses.replace(greedy("t2", turn2_in, 6), session_id=session.session_id)
    )
    history = turn1_in + list(r1.token_ids)
    assert list(r2.token_ids) == reference_greedy(tiny_model_dir, history + turn2_in, 6)
    assert (
        r2.usage.cached_tokens
        == len(history)
        == r1.usage.prompt_tokens + r1.usage.completion_tokens
    )
    assert r2.usage.prompt_tokens == len(history) + len(turn2_in)
    # turn 2 computed its new tokens and its own decode steps, nothing of the history
    computed = engine.counters["computed_tokens"] - before
    assert computed == len(turn2_in) + (6 - 1) + 1  # prefill, decodes, the final commit
    assert r2.session_tokens == len(history) + len(turn2_in) + 6
    info = engine.get_session(session.session_id)
    assert info.turns == 2 and info.history_tokens == r2.session_tokens


def test_parked_session_kv_shares_the_prefix_index_chunks(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, cache=CacheConfig(chunk_size=4))
    sid = engine.create_session().session_id
    t1 = encode_words("hello , who are you ?")
    r1 = engine.generate(dataclasses.replace(greedy("t1", t1, 7), session_id=sid))
    while engine.has_unfinished():
        engine.step()  # the commit step parks the history
    session = engine.sessions.get(sid)
    history = t1 + list(r1.token_ids)
    keys = chunk_keys(engine.kv_reuse.namespace, history, 4)
    assert session.kv is not None and session.kv_len == len(history)
    assert len(keys) >= 2 and len(session.kv) == len(keys) + (1 if len(history) % 4 else 0)
    for key, chunk in zip(keys, session.kv, strict=False):
        assert chunk is engine.prefix_index.get(key)  # the same arrays, not a copy
    t2 = encode_words("what is the time now ?")
    r2 = engine.generate(dataclasses.replace(greedy("t2", t2, 6), session_id=sid))
    assert r2.usage.cached_tokens == len(history)
    assert list(r2.token_ids) == reference_greedy(tiny_model_dir, history + t2, 6)


def test_the_parked_budget_counts_shared_chunks_once(tiny_model_dir: Path) -> None:
    from genai_service.config import SessionConfig

    kv = make_engine(tiny_model_dir).spec.kv
    per_token = kv.num_layers * 2 * kv.num_kv_heads * kv.head_dim * 4  # float32 K and V
    prompt = encode_words("hello , who are you ?")  # the same history in both sessions
    history_len = len(prompt) + 3
    full = history_len - history_len % 4
    # both histories' complete chunks once, plus each one's own tail
    budget = (full + 2 * (history_len - full)) * per_token
    assert history_len % 4 and budget < 2 * history_len * per_token
    eng = LLMEngine(
        EngineConfig(
            model_dir=str(tiny_model_dir),
            cache=CacheConfig(chunk_size=4),
            sessions=SessionConfig(max_parked_kv_bytes=budget),
        )
    )
    sids = [eng.create_session().session_id for _ in range(2)]
    for i, sid in enumerate(sids):
        eng.generate(dataclasses.replace(greedy(f"s{i}", prompt, 3), session_id=sid))
        while eng.has_unfinished():
            eng.step()
    parked = [eng.sessions.get(sid).kv for sid in sids]
    assert all(kv is not None for kv in parked) and eng.counters["session_kv_evicted"] == 0
    assert parked[0][0] is parked[1][0]  # one copy of the shared chunk


def test_session_reset_close_busy_and_unknown(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    sid = engine.create_session().session_id
    engine.add_request(dataclasses.replace(greedy("t1", "hello", 3), session_id=sid))
    with pytest.raises(FailedPrecondition):
        engine.add_request(dataclasses.replace(greedy("t2", "hello", 3), session_id=sid))
    while engine.has_unfinished():
        engine.step()
    assert engine.get_session(sid).history_tokens == 4
    engine.reset_session(sid)
    assert engine.get_session(sid).history_tokens == 0
    r = engine.generate(dataclasses.replace(greedy("t3", "hello", 3), session_id=sid))
    assert r.usage.cached_tokens == 0 and r.session_tokens == 4
    engine.close_session(sid)
    with pytest.raises(NotFound):
        engine.add_request(dataclasses.replace(greedy("t4", "hello", 3), session_id=sid))
    with pytest.raises(NotFound):
        engine.get_session("0" * 32)


def test_turn_right_after_a_turn_waits_for_the_commit(tiny_model_dir: Path) -> None:
    """The next turn may arrive before the last token's KV is computed: it waits a step."""
    engine = make_engine(tiny_model_dir, cache=CacheConfig(chunk_size=4, prefix_cache_bytes=0))
    sid = engine.create_session().session_id
    engine.add_request(dataclasses.replace(greedy("t1", "the cat", 3), session_id=sid))
    while True:
        if any(o.finished for o in engine.step()):
            break
    engine.add_request(dataclasses.replace(greedy("t2", "and the dog", 4), session_id=sid))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == "t2"]
    r2 = collect(outs)
    t1_tokens = reference_greedy(tiny_model_dir, encode_words("the cat"), 3)
    history = encode_words("the cat") + t1_tokens
    assert r2.usage.cached_tokens == len(history)
    assert list(r2.token_ids) == reference_greedy(
        tiny_model_dir, history + encode_words("and the dog"), 4
    )


def test_prefix_reuse_reports_cached_tokens_and_same_tokens(tiny_model_dir: Path) -> None:
    prefix = encode_words("the cat sat on the mat and the dog sat in the box")  # 13 tokens
    a = prefix + encode_words(". who is it ?")
    b = prefix + encode_words("with a hat ?")
    cold = make_engine(tiny_model_dir, cache=CacheConfig(chunk_size=4, prefix_cache_bytes=0))
    want = cold.generate(greedy("cold", b, 10))
    engine = make_engine(tiny_model_dir, cache=CacheConfig(chunk_size=4))
    first = engine.generate(greedy("a", a, 10))
    assert first.usage.cached_tokens == 0
    second = engine.generate(greedy("b", b, 10))
    assert second.usage.cached_tokens == 12  # three complete chunks of 4
    assert second.token_ids == want.token_ids
    assert list(want.token_ids) == reference_greedy(tiny_model_dir, b, 10)
    # an identical prompt reuses every complete chunk but leaves one token to compute
    again = engine.generate(greedy("b2", b, 10))
    assert again.usage.cached_tokens == (len(b) - 1) // 4 * 4
    assert again.token_ids == want.token_ids


def _until_finished(engine: LLMEngine, rid: str) -> list:
    outs: list = []
    for _ in range(200):
        outs += [o for o in engine.step() if o.request_id == rid]
        if outs and outs[-1].finished:
            return outs
    raise AssertionError(f"{rid} did not finish")


@pytest.mark.parametrize(
    ("variant", "runner"), [("rope", "past_present"), ("gqa", "shared_buffer")]
)
def test_chunks_are_copied_after_the_final_output_not_while_streaming(
    tiny_models: dict[str, Path], variant: str, runner: str
) -> None:
    engine = make_engine(tiny_models[variant], runner=RunnerConfig(runner=runner))
    reads: list[tuple] = []
    read_kv = engine.runner.read_kv
    engine.runner.read_kv = lambda *a: reads.append(a) or read_kv(*a)  # type: ignore[method-assign]
    prompt = encode_words("the cat sat on the mat and the dog sat in the box")  # 13 tokens
    engine.add_request(greedy("a", prompt, 6))
    _until_finished(engine, "a")
    assert reads == [] and len(engine.prefix_index) == 0  # nothing copied while "a" streamed
    assert engine.has_unfinished()  # its chunks are still to share
    assert engine.step() == []
    # 13 + 6 tokens, the last one without KV yet: 18 positions, four chunks of 4
    assert [(a[1], a[2]) for a in reads] == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert len(engine.prefix_index) == 4
    assert engine.runner.kv_len(0) == 0 and not engine.has_unfinished()  # slot freed


def test_closing_pushes_the_chunks_of_a_just_finished_sequence(tiny_model_dir: Path) -> None:
    store = MemoryKvChunkStore(dtype="float32")
    engine = LLMEngine(
        EngineConfig(model_dir=str(tiny_model_dir), cache=CacheConfig(chunk_size=4)),
        chunk_store=store,
    )
    prompt = encode_words("the cat sat on the mat and the dog sat in the box")  # 13 tokens
    engine.add_request(greedy("a", prompt, 6))
    _until_finished(engine, "a")
    assert store.blobs == {}  # shared by the next step, which never comes
    engine.close()
    assert len(store.blobs) == 4  # 18 positions of KV: four chunks of 4


def test_a_prompt_reuses_the_chunks_of_a_sequence_still_running(tiny_model_dir: Path) -> None:
    prefix = encode_words("the cat sat on the mat and the dog sat in the box")  # 13 tokens
    a = prefix + encode_words(". who is it ?")
    b = prefix + encode_words("with a hat ?")
    engine = make_engine(tiny_model_dir)
    outs: dict[str, list] = {"a": [], "b": []}
    engine.add_request(greedy("a", a, 30))
    for step in range(200):
        if step == 3:
            assert len(engine.prefix_index) == 0  # "a" decodes; its chunks are not copied yet
            engine.add_request(greedy("b", b, 10))
        for out in engine.step():
            outs[out.request_id].append(out)
        if not engine.has_unfinished():
            break
    second = collect(outs["b"])
    assert second.usage.cached_tokens == 12  # shared on demand from "a"'s slot
    assert list(second.token_ids) == reference_greedy(tiny_model_dir, b, 10)
    assert list(collect(outs["a"]).token_ids) == reference_greedy(tiny_model_dir, a, 30)


def test_finished_chunks_are_copied_a_few_per_step_unless_a_request_needs_the_slot(
    tiny_model_dir: Path,
) -> None:
    prompt = encode_words("the cat sat on the mat and the dog sat in the box")  # 13 tokens
    engine = make_engine(tiny_model_dir, scheduler=SchedulerConfig(max_num_seqs=2))
    reads: list[tuple] = []
    read_kv = engine.runner.read_kv
    engine.runner.read_kv = lambda *a: reads.append(a) or read_kv(*a)  # type: ignore[method-assign]
    engine.add_request(greedy("long", "hello", 40))
    engine.add_request(greedy("a", prompt, 6))
    _until_finished(engine, "a")
    engine.step()  # "long" still decodes: two of "a"'s four chunks
    assert len(reads) == 2
    engine.step()
    assert len(reads) == 4
    # Three slots, "long" running, "b" and "b2" finishing together, "c" waiting
    # for a slot: one of them is copied out and freed at once, whatever the
    # budget; the other waits for the budget.
    engine = make_engine(tiny_model_dir, scheduler=SchedulerConfig(max_num_seqs=3))
    reads.clear()
    read_kv = engine.runner.read_kv
    engine.runner.read_kv = lambda *a: reads.append(a) or read_kv(*a)  # type: ignore[method-assign]
    other = encode_words("a bird sat on the mat and the dog sat in the box")  # 13 tokens
    engine.add_request(greedy("long", "hello", 40))
    engine.add_request(greedy("b", prompt, 6))
    engine.add_request(greedy("b2", other, 6))
    engine.add_request(greedy("c", "two birds", 3))
    _until_finished(engine, "b")
    assert reads == [] and engine.scheduler.num_waiting == 1
    first = engine.step()
    assert len(reads) == 4 and len(engine.prefix_index) == 4  # "b" only
    assert "c" in [o.request_id for o in first]  # admitted in the same step
    engine.step()
    assert len(reads) == 6  # then two of "b2"'s per step


def test_context_limit_yields_the_rest_of_the_window(short_context_model_dir: Path) -> None:
    engine = make_engine(short_context_model_dir)
    assert engine.context_length == 16
    r = engine.generate(greedy("r", [5, 6, 7], 100))
    assert len(r.token_ids) == 13
    assert r.finish_reason is FinishReason.CONTEXT_LENGTH
    with pytest.raises(InvalidArgument, match="context window is 16 tokens"):
        engine.add_request(greedy("big", list(range(3, 19)), 1))


@pytest.mark.parametrize(
    ("params", "constant"),
    [
        (SamplingParams(temperature=1.5, top_k=5, top_p=0.9, seed=3), True),
        (SamplingParams(temperature=0.8, min_p=0.05, seed=4), True),
        # Never constant; the last three act on nothing at the first pick.
        (SamplingParams(temperature=1.2, repetition_penalty=1.3, seed=5), False),
        (SamplingParams(temperature=1.2, frequency_penalty=1.5, seed=6), False),
        (SamplingParams(temperature=1.2, presence_penalty=1.5, seed=7), False),
        (SamplingParams(temperature=1.2, dry_multiplier=2.0, dry_allowed_length=1, seed=8), False),
    ],
)
def test_sampler_args_built_once_pick_the_general_paths_tokens(
    tiny_model_dir: Path, params: SamplingParams, constant: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sampled rows whose sampler args never change draw through args built once
    per sequence (TokenPicker._constant_args); the tokens are those of the
    per-step path, alone and two at a time, with min_new_tokens' EOS bans
    (per-step) before the rows become constant; rows with penalties never do."""

    def requests(tag: str) -> list[GenerationRequest]:
        return [
            GenerationRequest(
                f"{tag}{i}",
                tuple(encode_words(prompt)),
                sampling=params,
                stopping=StoppingCriteria(max_new_tokens=24, min_new_tokens=4 * i),
            )
            for i, prompt in enumerate(["the cat", "where is the big red box"])
        ]

    def tokens(tag: str) -> list[tuple[int, ...]]:
        engine = make_engine(tiny_model_dir)
        alone = [engine.generate(r).token_ids for r in requests(tag + "a")]
        together = engine.run_to_completion(requests(tag + "b"))
        return alone + [together[f"{tag}b{i}"].token_ids for i in range(2)]

    drawn = []
    once = sampler.sample_constant
    monkeypatch.setattr(sampler, "sample_constant", lambda *a: drawn.append(1) or once(*a))
    fast = tokens("f")
    assert bool(drawn) == constant  # the path was taken, or not
    monkeypatch.setattr(TokenPicker, "_constant_args", lambda self, seq: None)
    assert fast == tokens("g")


def test_seeds_reproduce_and_differ(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)

    def sample(rid: str, seed: int | None) -> tuple[int, ...]:
        req = GenerationRequest(
            rid,
            tuple(encode_words("the cat")),
            sampling=SamplingParams(temperature=1.5, seed=seed),
            stopping=StoppingCriteria(max_new_tokens=16, ignore_eos=True),
        )
        r = engine.generate(req)
        if seed is not None:
            assert r.seed == seed
        return r.token_ids

    assert sample("a", 7) == sample("b", 7)
    assert sample("c", 7) != sample("d", 8)
    # concurrent requests with the same seed give the same tokens too
    reqs = [
        GenerationRequest(
            f"p{i}",
            tuple(encode_words("the cat")),
            sampling=SamplingParams(temperature=1.5, seed=7),
            stopping=StoppingCriteria(max_new_tokens=16, ignore_eos=True),
        )
        for i in range(3)
    ]
    results = engine.run_to_completion(reqs)
    assert {r.token_ids for r in results.values()} == {sample("e", 7)}


def test_eos_stop_token_and_min_new_tokens(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    prompt = encode_words("the cat sat")
    free = engine.generate(greedy("free", prompt, 20))
    stop_id = free.token_ids[3]
    first = free.token_ids.index(stop_id)
    r = engine.generate(greedy("stop", prompt, 20, stop_token_ids=(stop_id,)))
    assert r.finish_reason is FinishReason.STOP_SEQUENCE
    assert r.token_ids == free.token_ids[: first + 1]
    r = engine.generate(
        greedy("min", prompt, 20, stop_token_ids=(stop_id,), min_new_tokens=first + 2)
    )
    assert stop_id not in r.token_ids[: first + 2]
    # EOS stops unless ignored
    eos_req = GenerationRequest(
        "eos",
        tuple(prompt),
        stopping=StoppingCriteria(max_new_tokens=50),
    )
    r = engine.generate(eos_req)
    if EOS_ID in free.token_ids:
        assert r.finish_reason is FinishReason.EOS_TOKEN and r.token_ids[-1] == EOS_ID


def test_stop_string_truncates_text_and_never_streams_part_of_it(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    prompt = encode_words("the cat sat")
    free = engine.generate(greedy("free", prompt, 12))
    words = free.text.split(" ")
    stop = " ".join(words[3:5])
    engine.add_request(greedy("s", prompt, 12, stop_sequences=(stop,)))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    r = collect(outs)
    assert r.finish_reason is FinishReason.STOP_SEQUENCE and r.stop_sequence == stop
    assert r.text == free.text[: free.text.index(stop)]
    streamed = ""
    for o in outs:
        streamed += o.text
        assert stop not in streamed
    r = engine.generate(
        greedy("inc", prompt, 12, stop_sequences=(stop,), include_stop_sequence=True)
    )
    assert r.text == free.text[: free.text.index(stop) + len(stop)]


def test_max_new_tokens_time_limit_and_logprobs(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    r = engine.generate(greedy("m", "hello", 5))
    assert len(r.token_ids) == 5 and r.finish_reason is FinishReason.MAX_TOKENS
    assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens == 1
    r = engine.generate(greedy("t", "hello", 4000, time_limit_ms=1))
    assert r.finish_reason is FinishReason.TIME_LIMIT and len(r.token_ids) < 4000
    req = dataclasses.replace(greedy("lp", "hello", 4), top_logprobs=3)
    r = engine.generate(req)
    assert len(r.logprobs) == 4
    for tok, lp in zip(r.token_ids, r.logprobs, strict=True):
        assert lp.token_id == tok and len(lp.top) == 3
        assert lp.top[0].token_id == tok  # greedy picks the most likely
        assert lp.top[0].logprob >= lp.top[1].logprob >= lp.top[2].logprob
        assert lp.logprob == pytest.approx(lp.top[0].logprob)


def test_abort_frees_and_reports_cancelled(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    engine.add_request(greedy("a", "hello", 50))
    engine.add_request(greedy("b", "the cat", 5))
    engine.step()
    assert engine.abort("a")
    assert not engine.abort("nope")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    a = [o for o in outs if o.request_id == "a"]
    assert a[-1].finished and a[-1].finish_reason is FinishReason.CANCELLED
    assert (
        collect([o for o in outs if o.request_id == "b"]).finish_reason is FinishReason.MAX_TOKENS
    )
    assert engine.runner.kv_len(0) == 0 and not engine.scheduler.running


def test_queue_full_and_duplicate_request_id(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, scheduler=SchedulerConfig(max_queue=2))
    engine.add_request(greedy("a", "hello", 5))
    with pytest.raises(InvalidArgument, match="already in flight"):
        engine.add_request(greedy("a", "hello", 5))
    engine.add_request(greedy("b", "hello", 5))
    with pytest.raises(ResourceExhausted, match="queue"):
        engine.add_request(greedy("c", "hello", 5))


def test_high_priority_runs_first(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, scheduler=SchedulerConfig(max_num_seqs=1))
    engine.add_request(greedy("low", "hello", 3))
    engine.add_request(dataclasses.replace(greedy("high", "hello", 3), priority=Priority.HIGH))
    first = engine.step()
    assert [o.request_id for o in first] == ["high"]


def test_session_idle_ttl(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    sid = engine.create_session(idle_ttl_s=0.05).session_id
    time.sleep(0.1)
    with pytest.raises(NotFound):
        engine.get_session(sid)


def test_parked_session_kv_beyond_the_budget_is_dropped_and_recomputed(
    tiny_model_dir: Path,
) -> None:
    from genai_service.config import SessionConfig

    eng = LLMEngine(
        EngineConfig(
            model_dir=str(tiny_model_dir),
            cache=CacheConfig(chunk_size=4, prefix_cache_bytes=0),
            sessions=SessionConfig(max_parked_kv_bytes=1),  # no parked KV survives
        )
    )
    sid = eng.create_session().session_id
    t1 = encode_words("hello , who are you ?")
    r1 = eng.generate(dataclasses.replace(greedy("p1", t1, 5), session_id=sid))
    while eng.has_unfinished():
        eng.step()  # the commit step parks the history's KV, then the budget drops it
    assert eng.sessions.get(sid).kv is None and eng.counters["session_kv_evicted"] == 1
    t2 = encode_words("what is the time ?")
    r2 = eng.generate(dataclasses.replace(greedy("p2", t2, 5), session_id=sid))
    history = t1 + list(r1.token_ids)
    assert r2.usage.cached_tokens == 0  # recomputed, and still the same tokens
    assert list(r2.token_ids) == reference_greedy(tiny_model_dir, history + t2, 5)


def test_merged_outputs_concatenate_and_keep_the_end_fields() -> None:
    from genai_service.contract.request import (
        FinishReason,
        RequestOutput,
        TokenLogprob,
        Usage,
        merge_outputs,
    )

    lp = TokenLogprob(5, "a", -0.5, ())
    a = RequestOutput("r", (5,), "a", (lp,))
    b = RequestOutput("r", (6, 7), "bc", (), True, FinishReason.MAX_TOKENS, usage=Usage(3, 3, 0))
    merged = merge_outputs(a, b)
    assert merged.token_ids == (5, 6, 7) and merged.text == "abc" and merged.logprobs == (lp,)
    assert merged.finished and merged.finish_reason is FinishReason.MAX_TOKENS
    assert merged.usage == Usage(3, 3, 0)
