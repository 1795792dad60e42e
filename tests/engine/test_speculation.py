"""Prompt-lookup speculative decoding: drafts, the runners' verification step,
and an engine whose output is the same with speculation as without."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from genai_service.config import CacheConfig, EngineConfig, RunnerConfig, SpeculationConfig
from genai_service.contract.request import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    StoppingCriteria,
)
from genai_service.engine.engine import LLMEngine
from genai_service.engine.runner.model_runner import PastPresentRunner, StepItem
from genai_service.engine.runner.shared_buffer_runner import SharedBufferRunner
from genai_service.engine.speculation import MAX_BACKOFF_STEPS, PromptLookup
from genai_service.model.model_dir import load_model_spec
from tests.tiny_model import encode_words, reference_logits

RUNNERS = ["gqa", "rope"]  # shared-buffer and past/present runners

# -- drafts --------------------------------------------------------------------------------


def lookup(num_tokens: int = 3, ngram_max: int = 3, ngram_min: int = 1) -> PromptLookup:
    return PromptLookup(SpeculationConfig(num_tokens, ngram_max=ngram_max, ngram_min=ngram_min))


def brute_force(tokens: list[int], limit: int, sizes: range) -> list[int]:
    """The latest earlier occurrence of the longest matching suffix, by scanning."""
    for n in reversed(sizes):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for e in range(len(tokens) - 1, n - 1, -1):
            if tokens[e - n : e] == suffix:
                return tokens[e : e + limit]
    return []


def test_draft_follows_the_latest_occurrence_of_the_longest_suffix() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3]
    assert lookup().guess(0, tokens, 10) == [8, 5, 1]
    # only the last token matches earlier: the 1-gram "7" was followed by 4
    assert lookup().guess(0, [7, 4, 6, 6, 7], 10) == [4, 6, 6]
    # the 3-gram (6, 6, 7) beats the later 1-gram 7
    assert lookup().guess(0, [6, 6, 7, 1, 7, 2, 6, 6, 7], 10) == [1, 7, 2]


def test_no_draft_without_an_earlier_occurrence_or_room() -> None:
    assert lookup().guess(0, [5, 6, 7], 10) == []  # the suffix never matches itself
    assert lookup().guess(0, [5], 10) == []
    assert lookup().guess(0, [1, 2, 1, 2], 0) == []  # no room left (max_new_tokens)
    assert lookup(num_tokens=2).guess(0, [1, 2, 3, 4, 1], 10) == [2, 3]
    assert lookup().guess(0, [1, 2, 3, 4, 1], 1) == [2]
    assert lookup().guess(0, [1, 2, 1], 10) == [2, 1]  # continuation reaches the end


def test_incremental_index_equals_a_fresh_scan() -> None:
    rng = np.random.default_rng(0)
    drafter = lookup(num_tokens=4, ngram_max=3, ngram_min=1)
    tokens = [int(t) for t in rng.integers(0, 6, 20)]
    for _ in range(200):
        got = drafter.guess(1, tokens, 4)
        assert got == brute_force(tokens, 4, range(1, 4))
        tokens.extend(int(t) for t in rng.integers(0, 6, int(rng.integers(1, 4))))
    drafter.forget(1)
    assert drafter.guess(1, [3, 3], 4) == [3]  # a new index for a new context


def test_a_sequence_whose_drafts_fail_backs_off() -> None:
    drafter = lookup()
    tokens = [1, 2, 3, 1, 2]
    skipped = []
    for accepted in (0, 0, 0, 2, 0):
        assert drafter.guess(4, tokens, 10) == [3, 1, 2]
        drafter.feedback(4, accepted)
        n = 0
        while not drafter.guess(4, tokens, 10):
            n += 1
        skipped.append(n)
        drafter.feedback(4, 1)  # the draft after the pause was accepted
    # a one-step pause after a failure that follows a success; none after a success
    assert skipped == [1, 1, 1, 0, 1]
    # failures in a row double the pause (1, 2, 4, ...; every other one counted
    # here), up to MAX_BACKOFF_STEPS
    other = lookup()
    pauses = []
    for _ in range(7):
        while not other.guess(5, tokens, 10):
            pass
        other.feedback(5, 0)
        n = 0
        while not other.guess(5, tokens, 10):
            n += 1
        pauses.append(n)
        other.feedback(5, 0)
    assert pauses == [1, 4, 16] + [MAX_BACKOFF_STEPS] * 4
    other.forget(5)
    assert other.guess(5, tokens, 10) == [3, 1, 2]


# -- the runners' verification step --------------------------------------------------------


def make_runner(kind: str, model_dir: Path) -> SharedBufferRunner | PastPresentRunner:
    spec = load_model_spec(model_dir)
    if kind == "gqa":
        return SharedBufferRunner(spec, RunnerConfig(), max_slots=2, max_len=64)
    return PastPresentRunner(spec, RunnerConfig())


@pytest.mark.parametrize("kind", RUNNERS)
def test_verify_returns_every_positions_logits_and_truncate_drops_kv(
    kind: str, tiny_models: dict[str, Path]
) -> None:
    model_dir = tiny_models[kind]
    runner = make_runner(kind, model_dir)
    assert runner.can_verify
    ids = encode_words("the cat sat on the mat")
    runner.run([StepItem(3, ids[:3], 0)])
    rows = runner.verify(StepItem(3, ids[3:], 3))
    assert rows.shape == (len(ids) - 3, load_model_spec(model_dir).vocab_size)
    for j, row in enumerate(rows):
        np.testing.assert_allclose(row, reference_logits(model_dir, ids[: 4 + j]), atol=1e-4)
    assert runner.kv_len(3) == len(ids)
    runner.truncate(3, 4)  # keep "the cat sat on"; the rest was a rejected draft
    assert runner.kv_len(3) == 4
    other = encode_words("a dog")
    logits = runner.run([StepItem(3, other, 4)])
    np.testing.assert_allclose(logits[0], reference_logits(model_dir, ids[:4] + other), atol=1e-4)
    with pytest.raises(ValueError, match="cannot keep"):
        runner.truncate(3, 7)


# -- the engine ------------------------------------------------------------------------------


def engine_for(model_dir: Path, num_tokens: int = 0, max_batch: int = 1) -> LLMEngine:
    # batch rule "always": the measured rule's choice depends on timing (its
    # own tests: test_speculation_batch_rule.py).
    return LLMEngine(
        EngineConfig(
            model_dir=str(model_dir),
            speculation=SpeculationConfig(
                num_tokens=num_tokens, max_batch=max_batch, batch_rule="always"
            ),
        )
    )


def request(rid: str, text: str, n: int, **kw) -> GenerationRequest:
    stopping = kw.pop("stopping", StoppingCriteria(max_new_tokens=n, ignore_eos=True))
    return GenerationRequest(rid, tuple(encode_words(text)), stopping=stopping, **kw)


PROMPT = "the cat sat on the mat and the dog sat on the cat and the cat sat on the"


def run_both(
    model_dir: Path, requests: list[GenerationRequest], num_tokens: int = 4, max_batch: int = 1
) -> tuple[dict[str, GenerationResult], dict[str, GenerationResult], LLMEngine]:
    plain = engine_for(model_dir).run_to_completion(requests)
    spec_engine = engine_for(model_dir, num_tokens, max_batch)
    return plain, spec_engine.run_to_completion(requests), spec_engine


@pytest.mark.parametrize("kind", RUNNERS)
def test_greedy_output_is_the_same_with_speculation(
    kind: str, tiny_models: dict[str, Path]
) -> None:
    reqs = [request("a", PROMPT, 24)]
    plain, spec, engine = run_both(tiny_models[kind], reqs)
    assert spec["a"].token_ids == plain["a"].token_ids
    assert spec["a"].text == plain["a"].text
    assert engine.counters["spec_draft_tokens"] > 0
    assert engine.runner.kv_len(0) == 0  # released


def oracle(engine: LLMEngine, answer: tuple[int, ...], prompt_len: int, wrong: bool = False):
    """A drafter that knows the answer (or is always wrong): acceptance under control."""

    def propose(seq_id: int, tokens: list[int], limit: int) -> list[int]:
        done = len(tokens) - prompt_len
        draft = list(answer[done : done + min(4, limit)])
        return [(t + 1) % engine.vocab_size for t in draft] if wrong else draft

    assert engine.speculation is not None and engine.speculation.lookup is not None
    engine.speculation.lookup.guess = propose  # type: ignore[method-assign]


@pytest.mark.parametrize("kind", RUNNERS)
def test_an_accepted_draft_gives_several_tokens_per_step(
    kind: str, tiny_models: dict[str, Path]
) -> None:
    model_dir = tiny_models[kind]
    want = engine_for(model_dir).generate(request("a", PROMPT, 13))
    engine = engine_for(model_dir, num_tokens=4)
    prompt_len = len(encode_words(PROMPT))
    oracle(engine, want.token_ids, prompt_len)
    engine.add_request(request("a", PROMPT, 13))
    steps = []
    while engine.has_unfinished():
        outs = [o for o in engine.step() if o.request_id == "a"]
        if outs:
            steps.append(len(outs[0].token_ids))
            assert len(outs) == 1  # one delta per request per step
            seq = engine._requests.get("a")
            if seq is not None:  # the KV covers every token but the last one
                assert engine.runner.kv_len(seq.seq_id) == len(seq.token_ids) - 1
    # prefill gives the first token; then 4 drafts + 1 per step; 12 left = 5 + 5 + 2
    assert steps == [1, 5, 5, 2]
    assert engine.counters["spec_accepted_tokens"] == 4 + 4 + 1
    assert engine.counters["spec_draft_tokens"] == 4 + 4 + 1  # room for 1 only at the end


@pytest.mark.parametrize("kind", RUNNERS)
def test_a_rejected_draft_costs_nothing_but_time(kind: str, tiny_models: dict[str, Path]) -> None:
    model_dir = tiny_models[kind]
    want = engine_for(model_dir).generate(request("a", PROMPT, 10))
    engine = engine_for(model_dir, num_tokens=4)
    oracle(engine, want.token_ids, len(encode_words(PROMPT)), wrong=True)
    got = engine.generate(request("a", PROMPT, 10))
    assert got.token_ids == want.token_ids
    assert engine.counters["spec_accepted_tokens"] == 0
    assert engine.counters["spec_draft_tokens"] > 0


@pytest.mark.parametrize("kind", RUNNERS)
def test_stop_rules_inside_an_accepted_draft(kind: str, tiny_models: dict[str, Path]) -> None:
    model_dir = tiny_models[kind]
    want = engine_for(model_dir).generate(request("a", PROMPT, 12))
    stop_word = want.text.split()[5]  # a word a few tokens in
    stopping = StoppingCriteria(max_new_tokens=12, ignore_eos=True, stop_sequences=(stop_word,))
    plain = engine_for(model_dir).generate(request("s", PROMPT, 12, stopping=stopping))
    assert plain.finish_reason is FinishReason.STOP_SEQUENCE

    def speculating(stopping: StoppingCriteria) -> GenerationResult:
        engine = engine_for(model_dir, num_tokens=4)
        oracle(engine, want.token_ids, len(encode_words(PROMPT)))
        got = engine.generate(request("s", PROMPT, 0, stopping=stopping))
        assert got.usage.completion_tokens == len(got.token_ids)
        return got

    # a stop string inside an accepted draft
    got = speculating(stopping)
    assert (got.text, got.token_ids, got.finish_reason) == (
        plain.text,
        plain.token_ids,
        plain.finish_reason,
    )
    # max_new_tokens inside an accepted draft
    got = speculating(StoppingCriteria(max_new_tokens=3, ignore_eos=True))
    assert got.token_ids == want.token_ids[:3]
    assert got.finish_reason is FinishReason.MAX_TOKENS


@pytest.mark.parametrize("kind", RUNNERS)
def test_seeded_sampling_and_logprobs_are_the_same_with_speculation(
    kind: str, tiny_models: dict[str, Path]
) -> None:
    sampling = SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.1, seed=11)
    reqs = [request("a", PROMPT, 20, sampling=sampling, top_logprobs=2)]
    plain, spec, engine = run_both(tiny_models[kind], reqs)
    assert spec["a"].token_ids == plain["a"].token_ids
    assert [lp.token_id for lp in spec["a"].logprobs] == list(plain["a"].token_ids)
    np.testing.assert_allclose(
        [lp.logprob for lp in spec["a"].logprobs],
        [lp.logprob for lp in plain["a"].logprobs],
        atol=1e-4,
    )
    assert engine.counters["spec_draft_tokens"] > 0


def test_several_sequences_speculate_up_to_max_batch(tiny_models: dict[str, Path]) -> None:
    reqs = [
        request("a", PROMPT, 16),
        request("b", "the dog sat on the mat and the dog sat on the", 16),
        request("c", "a bird saw it and a bird saw", 4),
    ]
    plain, spec, engine = run_both(tiny_models["gqa"], reqs, max_batch=2)
    for rid in "abc":
        assert spec[rid].token_ids == plain[rid].token_ids
    assert engine.counters["spec_draft_tokens"] > 0  # once "c" finished


def test_session_turns_are_the_same_with_speculation(tiny_models: dict[str, Path]) -> None:
    results = []
    for num_tokens in (0, 4):
        engine = engine_for(tiny_models["gqa"], num_tokens)
        sid = engine.create_session().session_id
        turns = []
        for i, text in enumerate((PROMPT, "and the dog sat on the")):
            turns.append(engine.generate(request(f"t{i}", text, 12, session_id=sid)))
        results.append([(t.token_ids, t.usage.cached_tokens) for t in turns])
    assert results[0] == results[1]
    assert results[1][1][1] > 0  # the second turn reused the first one's KV


def test_speculation_needs_a_graph_that_can_verify(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(SharedBufferRunner, "can_verify", property(lambda self: False))
    with pytest.raises(ValueError, match="num_logits_to_keep"):
        engine_for(tiny_models["gqa"], num_tokens=4)


def test_server_flags(tmp_path: Path) -> None:
    from genai_service.__main__ import build_parser, config_from_args

    def config(*flags: str) -> SpeculationConfig:
        args = build_parser().parse_args(["--model", str(tmp_path), *flags])
        return config_from_args(args).engine.speculation

    assert config() == SpeculationConfig(num_tokens=0)
    assert config("--speculate", "4", "--speculate-max-batch", "2") == SpeculationConfig(4, 2)
    with pytest.raises(ValueError, match=r"num_tokens must be in \[0, 32\], got -1"):
        config("--speculate", "-1")
    with pytest.raises(ValueError, match=r"num_tokens must be in \[0, 32\], got 33"):
        config("--speculate", "33")
    with pytest.raises(ValueError, match="max_batch must be > 0, got 0"):
        config("--speculate", "4", "--speculate-max-batch", "0")


def test_a_speculating_server_streams_the_same_tokens(tiny_models: dict[str, Path]) -> None:
    """Through GenerateStream (deltas may carry several tokens either way: the
    frontend merges the ones its consumer has not taken yet)."""
    from genai_client import Client
    from genai_service.config import ServerConfig
    from tests.server_harness import ServerThread, free_port

    streams = {}
    for k in (0, 4):
        engine = EngineConfig(
            model_dir=str(tiny_models["gqa"]), speculation=SpeculationConfig(num_tokens=k)
        )
        srv = ServerThread(ServerConfig(engine=engine, port=free_port())).start()
        try:
            with Client(srv.target) as client:
                deltas = list(
                    client.stream(
                        token_ids=encode_words(PROMPT), max_new_tokens=24, ignore_eos=True
                    )
                )
        finally:
            srv.stop()
        streams[k] = [d.token_ids for d in deltas if d.token_ids]
    flat = {k: [t for ids in v for t in ids] for k, v in streams.items()}
    assert flat[4] == flat[0] and len(flat[0]) == 24


@pytest.mark.parametrize("n", [5, 6, 7])
def test_chunks_shared_after_a_finish_inside_a_draft_are_the_plain_ones(
    n: int, tiny_models: dict[str, Path]
) -> None:
    """The runner still holds the rest of the draft's KV when the sequence finishes
    mid-draft; the chunks it shares must cover its own tokens only. (Equal up to
    float rounding: a draft's positions are computed in one several-token step.)"""
    model_dir = tiny_models["gqa"]
    prompt = encode_words("the cat sat on the mat and the dog")  # 9 tokens, chunks of 4
    engines = {}
    for k in (0, 4):
        config = EngineConfig(
            model_dir=str(model_dir),
            cache=CacheConfig(chunk_size=4),
            speculation=SpeculationConfig(num_tokens=k),
        )
        engines[k] = LLMEngine(config)
    answer = engines[0].generate(GenerationRequest("a", tuple(prompt), stopping=stopping_for(n)))
    oracle(engines[4], answer.token_ids, len(prompt))
    got = engines[4].generate(GenerationRequest("a", tuple(prompt), stopping=stopping_for(n)))
    assert got.token_ids == answer.token_ids
    assert engines[4].counters["spec_accepted_tokens"] > 0
    plain, spec = engines[0].prefix_index, engines[4].prefix_index
    keys = list(plain._entries)
    # prompt + all but the last generated token have KV: (9 + n - 1) // 4 chunks
    assert len(keys) == (len(prompt) + n - 1) // 4 == len(spec)
    for key in keys:
        for (k1, v1), (k2, v2) in zip(plain.get(key), spec.get(key), strict=True):
            np.testing.assert_allclose(k1, k2, atol=1e-5)
            np.testing.assert_allclose(v1, v2, atol=1e-5)


def stopping_for(n: int) -> StoppingCriteria:
    return StoppingCriteria(max_new_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("kind", RUNNERS)
def test_speculation_stops_at_the_context_window(
    kind: str, tiny_models: dict[str, Path], short_context_model_dir: Path
) -> None:
    model_dir = short_context_model_dir if kind == "rope" else tiny_models[kind]
    # 16 positions for the short model; the GQA one is capped to 20 here
    cap = None if kind == "rope" else 20
    results = []
    for k in (0, 4):
        config = EngineConfig(
            model_dir=str(model_dir),
            max_context_length=cap,
            speculation=SpeculationConfig(num_tokens=k),
        )
        engine = LLMEngine(config)
        results.append(engine.generate(request("c", "the cat sat on the mat and the", 64)))
    assert results[0].finish_reason is FinishReason.CONTEXT_LENGTH
    assert (results[1].token_ids, results[1].finish_reason) == (
        results[0].token_ids,
        results[0].finish_reason,
    )
