"""Speculative decoding with a draft model (``--draft-model``): the tokens are
those of a plain decode whatever the draft guesses, greedy and seeded, batched,
in sessions, with constraints and stop rules; the draft's KV follows the
sequence's tokens through rejections; a draft whose vocabulary differs is
refused."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from genai_service.config import EngineConfig, SchedulerConfig, SpeculationConfig
from genai_service.contract.request import (
    Constraint,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
)
from genai_service.engine.engine import LLMEngine
from genai_service.engine.runner.model_runner import PastPresentRunner, StepItem
from genai_service.engine.sampling import sampler
from genai_service.engine.speculation import DraftModel, draft_model
from genai_service.model.model_dir import load_model_spec
from tests.tiny_model import GQA_SPEC, TinyModelSpec, build_tiny_model, encode_bytes, encode_words

PROMPT = "the cat sat on the mat and the dog sat on the cat and the cat sat on the"
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=7)


@pytest.fixture(scope="module")
def drafts(
    tmp_path_factory: pytest.TempPathFactory, tiny_models: dict[str, Path]
) -> dict[str, Path]:
    """Drafts for the GQA tiny model (same "words" vocabulary): itself (every
    greedy guess right), one layer of it (a poor draft, the shared-buffer
    runner), and another model's weights on plain attention (past/present)."""
    one = build_tiny_model(
        tmp_path_factory.mktemp("one-layer"), dataclasses.replace(GQA_SPEC, num_layers=1)
    )
    other = build_tiny_model(tmp_path_factory.mktemp("other"), TinyModelSpec(seed=5))
    return {"same": tiny_models["gqa"], "one_layer": one, "other": other}


def engine_for(
    target: Path,
    draft: Path | None,
    num_tokens: int = 4,
    max_batch: int = 4,
    min_confidence: float = 0.0,
    **kw: object,
) -> LLMEngine:
    # batch rule "always": what the measured rule chooses depends on timing;
    # these tests check what speculation computes (the rule's own tests:
    # test_speculation_batch_rule.py). No confidence stop unless asked: the tiny
    # models' flat distributions would end nearly every guess at its first token
    # (its own tests: test_an_unsure_draft_ends_its_greedy_guess*).
    spec = (
        SpeculationConfig(
            num_tokens,
            max_batch,
            draft_model=str(draft),
            mode="draft",
            batch_rule="always",
            min_confidence=min_confidence,
        )
        if draft is not None
        else SpeculationConfig()
    )
    return LLMEngine(EngineConfig(model_dir=str(target), speculation=spec, **kw))  # type: ignore[arg-type]


def request(rid: str, text: str, n: int, **kw: object) -> GenerationRequest:
    stopping = kw.pop("stopping", StoppingCriteria(max_new_tokens=n, ignore_eos=True))
    return GenerationRequest(rid, tuple(encode_words(text)), stopping=stopping, **kw)  # type: ignore[arg-type]


def mixed_requests() -> list[GenerationRequest]:
    return [
        request("greedy", PROMPT, 48),  # alone from token 24 on (max_batch 1 speculates)
        request("sampled", "a bird saw it and the", 24, sampling=SAMPLED),
        request("short", "the dog", 6),
        request("logprobs", "the mat and", 20, sampling=SAMPLED, top_logprobs=2),
    ]


@pytest.mark.parametrize("draft", ["same", "one_layer", "other"])
@pytest.mark.parametrize("max_batch", [1, 4])
def test_tokens_are_those_of_a_plain_decode(
    draft: str,
    max_batch: int,
    tiny_models: dict[str, Path],
    drafts: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from genai_service.engine.runner.shared_buffer_runner import SharedBufferRunner

    target = tiny_models["gqa"]
    plain = engine_for(target, None).run_to_completion(mixed_requests())
    twin_calls = []
    real_twin = SharedBufferRunner._run_twin
    monkeypatch.setattr(
        SharedBufferRunner,
        "_run_twin",
        lambda self, *a: twin_calls.append(len(a[2])) or real_twin(self, *a),
    )
    engine = engine_for(target, drafts[draft], max_batch=max_batch)
    got = engine.run_to_completion(mixed_requests())
    # At max_batch 4 several sequences' checks share a call (the graph's twin).
    assert bool(twin_calls) == (max_batch > 1)
    for rid, want in plain.items():
        assert got[rid].token_ids == want.token_ids, rid
        assert got[rid].finish_reason is want.finish_reason
    np.testing.assert_allclose(
        [lp.logprob for lp in got["logprobs"].logprobs],
        [lp.logprob for lp in plain["logprobs"].logprobs],
        atol=1e-4,
    )
    c = engine.counters
    assert c["spec_draft_tokens.draft"] == c["spec_draft_tokens"] > 0
    if draft == "same":  # its greedy guesses are the target's own greedy picks
        assert c["spec_accepted_tokens.draft"] > 0
    assert engine.info().speculative_mode == "draft"
    assert engine.info().draft_model_id == drafts[draft].name
    assert engine.speculation.draft.runner.active == 0  # type: ignore[union-attr]  # all released


def test_a_right_draft_gives_k_plus_one_tokens_per_step(
    tiny_models: dict[str, Path], drafts: dict[str, Path]
) -> None:
    engine = engine_for(tiny_models["gqa"], drafts["same"], num_tokens=4)
    engine.add_request(request("a", PROMPT, 13))
    steps = []
    while engine.has_unfinished():
        outs = [o for o in engine.step() if o.request_id == "a" and o.token_ids]
        steps.extend(len(o.token_ids) for o in outs)
    # prefill gives the first token; then 4 guesses + 1 per step; 12 left = 5 + 5 + 2
    assert steps == [1, 5, 5, 2]
    assert engine.counters["spec_accepted_tokens"] == engine.counters["spec_draft_tokens"] == 9
    assert engine.counters["spec_guesses"] == engine.counters["spec_guesses.draft"] == 3


@pytest.mark.parametrize("constant", [True, False])
def test_a_right_draft_guesses_every_sampled_pick(
    constant: bool,
    tiny_models: dict[str, Path],
    drafts: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The target as its own draft, sampled: each guess draws from a copy of the
    sequence's generator, so it is the target's own pick and every one is
    accepted, whether the guess draws through args built once (a row whose
    args never change) or built per guess (a repetition penalty)."""
    sampling = SAMPLED if constant else dataclasses.replace(SAMPLED, repetition_penalty=1.2)
    engine = engine_for(tiny_models["gqa"], drafts["same"], num_tokens=4)
    guesses = []
    once = sampler.sample_constant
    monkeypatch.setattr(sampler, "sample_constant", lambda *a: guesses.append(1) or once(*a))
    engine.generate(request("a", PROMPT, 21, sampling=sampling))
    c = engine.counters
    assert c["spec_accepted_tokens"] == c["spec_draft_tokens"] == 16
    assert bool(guesses) == constant


def test_a_wider_draft_still_guesses_every_sampled_pick(
    tiny_models: dict[str, Path], drafts: dict[str, Path]
) -> None:
    """The sampler draws per pick by the row's width (a variate per block of
    256 tokens and per place in one): a draft's logits of another width are
    fitted to the target's before a sampled guess, so its draws stay in step
    with the target's (here the target itself, its 85-wide rows widened by 300
    columns of -inf: two blocks against one)."""
    engine = engine_for(tiny_models["gqa"], drafts["same"], num_tokens=4)
    runner = engine.speculation.draft.runner  # type: ignore[union-attr]
    real = runner.run

    def widened(items: Any) -> np.ndarray:
        out = real(items)
        return np.concatenate([out, np.full((out.shape[0], 300), -np.inf, out.dtype)], axis=1)

    runner.run = widened
    got = engine.generate(request("a", PROMPT, 21, sampling=SAMPLED))
    plain = engine_for(tiny_models["gqa"], None).generate(
        request("a", PROMPT, 21, sampling=SAMPLED)
    )
    assert got.token_ids == plain.token_ids
    c = engine.counters
    assert c["spec_accepted_tokens"] == c["spec_draft_tokens"] == 16


def test_a_drafts_row_is_cut_or_padded_to_the_targets_width() -> None:
    fit = DraftModel._target_width
    target = types.SimpleNamespace(target_vocab=300)
    row = np.arange(600, dtype=np.float32)
    assert fit(target, row).tolist() == row[:300].tolist()
    narrow = fit(target, row[:200])
    assert narrow.shape == (300,) and narrow.dtype == np.float32
    assert narrow[:200].tolist() == row[:200].tolist() and np.isneginf(narrow[200:]).all()
    same = row[:300]
    assert fit(target, same) is same


def test_guess_probability_is_the_drafts_softmax() -> None:
    row = np.random.default_rng(3).normal(0.0, 3.0, 500).astype(np.float32)
    z = row.astype(np.float64)
    p = np.exp(z - z.max())
    p /= p.sum()
    for token in (int(np.argmax(row)), 17):
        assert draft_model.guess_probability(row, token) == pytest.approx(p[token], rel=1e-5)


def test_an_unsure_draft_ends_its_greedy_guess_after_the_token_it_doubts(
    tiny_models: dict[str, Path],
    drafts: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--draft-min-confidence: a greedy guess ends after its first token to which the
    draft gives less probability, or at N (or the request's room); the tokens
    stay a plain decode's."""
    tau, n = 0.2, 4
    seen: list[float] = []
    probability = draft_model.guess_probability
    monkeypatch.setattr(
        draft_model, "guess_probability", lambda *a: seen.append(probability(*a)) or seen[-1]
    )
    calls: list[tuple[list[float], int, list[int]]] = []
    propose = DraftModel.propose

    def recorded(self: DraftModel, wants: list) -> dict[int, list[int]]:
        if not wants:
            return propose(self, wants)
        seen.clear()
        out = propose(self, wants)
        calls.append((list(seen), min(n, wants[0].limit), list(out.values())[0] if out else []))
        return out

    monkeypatch.setattr(DraftModel, "propose", recorded)
    target = tiny_models["gqa"]
    got = engine_for(target, drafts["same"], n, max_batch=1, min_confidence=tau).generate(
        request("a", PROMPT, 48)
    )
    assert got.token_ids == engine_for(target, None).generate(request("a", PROMPT, 48)).token_ids
    lengths = []
    for probs, limit, guess in calls:
        if not guess:
            continue
        assert len(probs) == len(guess)  # one probability per guessed token, no more
        assert all(p >= tau for p in probs[:-1])
        assert probs[-1] < tau or len(guess) == limit
        lengths.append(len(guess))
    assert min(lengths) < n and max(lengths) == n  # both endings happened


def test_a_sampled_guess_is_never_cut_by_the_confidence_stop(
    tiny_models: dict[str, Path], drafts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sampled guesses land on the target's token about as often whatever the
    draft gave them (the coupled race): the stop reads no probability for them
    and every guess is as long as N and the request's room allow."""
    read: list[int] = []
    monkeypatch.setattr(draft_model, "guess_probability", lambda *a: read.append(1) or 0.0)
    lengths: list[tuple[int, int]] = []
    propose = DraftModel.propose

    def recorded(self: DraftModel, wants: list) -> dict[int, list[int]]:
        out = propose(self, wants)
        for w in wants:
            if w.seq.seq_id in out:
                lengths.append((len(out[w.seq.seq_id]), min(4, w.limit)))
        return out

    monkeypatch.setattr(DraftModel, "propose", recorded)
    req = request("s", PROMPT, 40, sampling=SAMPLED)
    engine = engine_for(tiny_models["gqa"], drafts["same"], 4, max_batch=1, min_confidence=0.9)
    got = engine.generate(req)
    assert got.token_ids == engine_for(tiny_models["gqa"], None).generate(req).token_ids
    assert not read
    assert lengths and all(n == limit for n, limit in lengths)


def test_in_a_call_of_several_sequences_a_doubting_one_rides_along(
    tiny_models: dict[str, Path], drafts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guessing in one draft call, a sequence that doubts its token keeps guessing
    while another in the call is sure (the call runs anyway); alone, it stops."""
    # One request's guesses are sure, the other's all doubted.
    monkeypatch.setattr(
        draft_model, "guess_probability", lambda row, tok: float(doubting[0] is None)
    )
    doubting: list[str | None] = [None]
    guess = DraftModel._guess

    def judged(self: DraftModel, seq: Any, *a: Any) -> int:
        doubting[0] = "doubt" if seq.request.request_id == "doubt" else None
        return guess(self, seq, *a)

    monkeypatch.setattr(DraftModel, "_guess", judged)
    calls: list[dict[str, int]] = []
    propose = DraftModel.propose

    def recorded(self: DraftModel, wants: list) -> dict[int, list[int]]:
        out = propose(self, wants)
        rid = {w.seq.seq_id: w.seq.request.request_id for w in wants}
        calls.append({rid[sid]: len(guess) for sid, guess in out.items()})
        return out

    monkeypatch.setattr(DraftModel, "propose", recorded)
    reqs = [
        request("sure", PROMPT, 24),
        request("doubt", "a bird saw it and the", 40),
    ]
    engine = engine_for(tiny_models["gqa"], drafts["same"], 4, max_batch=4, min_confidence=0.5)
    got = engine.run_to_completion(reqs)
    plain = engine_for(tiny_models["gqa"], None).run_to_completion(reqs)
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in plain.items()}
    together = [c for c in calls if len(c) == 2]
    assert any(c["doubt"] > 1 for c in together)  # rode along past its doubted first token
    alone = [c["doubt"] for c in calls if set(c) == {"doubt"}]
    assert alone and set(alone) == {1}


def test_a_draft_call_stops_when_every_sequence_in_it_doubts(
    tiny_models: dict[str, Path], drafts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(draft_model, "guess_probability", lambda row, tok: float("nan"))
    engine = engine_for(tiny_models["gqa"], drafts["same"], 4, max_batch=4, min_confidence=0.5)
    reqs = [request(str(i), " ".join(PROMPT.split()[i:]), 16) for i in range(3)]
    got = engine.run_to_completion(reqs)
    plain = engine_for(tiny_models["gqa"], None).run_to_completion(reqs)
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in plain.items()}
    c = engine.counters
    # A NaN probability is a doubt: every guess is its first token, one draft call each round.
    assert c["spec_draft_tokens"] == c["spec_guesses"] > 0
    draft = engine.speculation.draft  # type: ignore[union-attr]
    assert draft is not None and draft.steps <= c["spec_guesses"]


def test_a_guess_rejected_whole_halves_the_next_until_one_is_kept_whole() -> None:
    class Runner:
        def kv_len(self, seq_id: int) -> int:
            return 0

    draft = DraftModel(
        Runner(),  # type: ignore[arg-type]
        model_id="d",
        num_tokens=6,
        target_vocab=10,
        draft_vocab=10,
        max_len=100,
        catchup_tokens=8,
        parked_bytes=0,
    )
    seq = types.SimpleNamespace(seq_id=1)
    spans = []
    for length, kept in [(6, 0), (3, 1), (3, 0), (1, 0), (1, 1), (6, 2), (6, 0), (3, 3)]:
        draft._checking[1] = (0, length)
        draft.accepted(seq, kept)  # type: ignore[arg-type]
        spans.append(draft._span.get(1, 6))
    assert spans == [3, 3, 1, 1, 6, 6, 3, 6]  # a guess kept in part changes nothing


def test_a_poor_drafts_guesses_shrink(
    tiny_models: dict[str, Path], drafts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    guesses: list[tuple[int, int]] = []  # (length, room)
    propose = DraftModel.propose

    def proposed(self: DraftModel, wants: list) -> dict[int, list[int]]:
        out = propose(self, wants)
        guesses.extend((len(g), wants[0].limit) for g in out.values())
        return out

    monkeypatch.setattr(DraftModel, "propose", proposed)
    engine = engine_for(tiny_models["gqa"], drafts["other"], 8, max_batch=1)
    assert len(engine.generate(request("a", PROMPT, 60)).token_ids) == 60
    assert guesses[0][0] == 8
    assert any(length < 4 for length, room in guesses if room >= 8)  # shrunk, not by room


def draft_kv_matches_a_recompute(engine: LLMEngine, rid: str, draft_dir: Path) -> int:
    """The draft's KV of a running sequence is that of a fresh prefill of the
    tokens it claims to hold: rejected guesses never stay in it."""
    seq = engine._requests[rid]
    draft = engine.speculation.draft  # type: ignore[union-attr]
    assert draft is not None
    held = draft.runner.kv_len(seq.seq_id)
    assert held <= len(seq.token_ids) - 1
    if held:
        fresh = PastPresentRunner(load_model_spec(draft_dir), engine.config.runner)
        fresh.run([StepItem(0, seq.token_ids[:held], 0)])
        for (k1, v1), (k2, v2) in zip(
            draft.runner.read_kv(seq.seq_id, 0, held), fresh.read_kv(0, 0, held), strict=True
        ):
            np.testing.assert_allclose(k1, k2, atol=1e-4)
            np.testing.assert_allclose(v1, v2, atol=1e-4)
    return held


def test_the_drafts_kv_is_rolled_back_with_the_targets(
    tiny_models: dict[str, Path], drafts: dict[str, Path]
) -> None:
    engine = engine_for(tiny_models["gqa"], drafts["one_layer"], num_tokens=3)
    engine.add_request(request("a", PROMPT, 40))
    checked = 0
    while engine.has_unfinished():
        engine.step()
        if "a" in engine._requests:
            checked += draft_kv_matches_a_recompute(engine, "a", drafts["one_layer"]) > 0
    assert checked > 5
    assert engine.counters["spec_draft_tokens"] > engine.counters["spec_accepted_tokens"]


def test_a_draft_whose_guesses_fail_backs_off(
    tiny_models: dict[str, Path], drafts: dict[str, Path]
) -> None:
    engine = engine_for(tiny_models["gqa"], drafts["other"], num_tokens=4)
    got = engine.generate(request("a", PROMPT, 60))
    assert len(got.token_ids) == 60
    c = engine.counters
    assert c["spec_accepted_tokens"] < c["spec_draft_tokens"] / 4  # a poor draft indeed
    # Backing off 1, 2, 4 ... 16 steps after each failed guess: far fewer guesses than steps.
    assert c["spec_guesses"] < 30


def test_session_turns_keep_the_drafts_kv(
    tiny_models: dict[str, Path], drafts: dict[str, Path]
) -> None:
    texts = (PROMPT, "and the dog sat on the", "the bird saw the cat")
    results = {}
    for draft in (None, drafts["same"]):
        engine = engine_for(tiny_models["gqa"], draft)
        sid = engine.create_session().session_id
        turns = [
            engine.generate(request(f"t{i}", t, 12, session_id=sid)) for i, t in enumerate(texts)
        ]
        results[draft] = [(t.token_ids, t.usage.cached_tokens) for t in turns]
        while engine.has_unfinished():  # the last turn's commit step
            engine.step()
        if draft is not None:
            spec = engine.speculation.draft  # type: ignore[union-attr]
            assert isinstance(spec, DraftModel)
            assert spec.parked_sessions == 1
            # The draft was fed the first prompt and then, each turn, only what
            # was new to it: never the history again.
            history = len(encode_words(PROMPT)) + sum(12 + len(t.split()) for t in texts[1:]) + 12
            assert spec.catchup_fed <= history
    assert results[None] == results[drafts["same"]]


def test_a_rewound_session_reuses_the_drafts_kv_only_as_far_as_it_agrees(
    tiny_models: dict[str, Path], drafts: dict[str, Path]
) -> None:
    outs = {}
    for draft in (None, drafts["same"]):
        engine = engine_for(tiny_models["gqa"], draft)
        sid = engine.create_session().session_id
        engine.generate(request("t0", PROMPT, 10, session_id=sid))
        engine.generate(request("t1", "and the dog", 10, session_id=sid))
        engine.rewind_session(sid, turns=1)
        outs[draft] = engine.generate(request("t2", "a bird saw", 10, session_id=sid)).token_ids
        if draft is not None:
            # The target as its own draft: a restored draft KV that did not
            # match the tokens would make some greedy guess wrong.
            c = engine.counters
            assert c["spec_accepted_tokens"] == c["spec_draft_tokens"] > 0
    assert outs[None] == outs[drafts["same"]]


def test_closing_or_resetting_a_session_drops_its_parked_draft_kv(
    tiny_models: dict[str, Path], drafts: dict[str, Path]
) -> None:
    engine = engine_for(tiny_models["gqa"], drafts["same"])
    draft = engine.speculation.draft  # type: ignore[union-attr]
    assert draft is not None
    sids = [engine.create_session().session_id for _ in range(2)]
    for i, sid in enumerate(sids):
        engine.generate(request(f"t{i}", PROMPT, 8, session_id=sid))
    while engine.has_unfinished():  # the commit steps
        engine.step()
    assert draft.parked_sessions == 2
    engine.close_session(sids[0])
    engine.reset_session(sids[1])
    assert draft.parked_sessions == 0 and draft._parked_total == 0


@pytest.mark.parametrize("end", ["close", "reset"])
def test_a_session_ended_while_its_turn_commits_parks_no_draft_kv(
    tiny_models: dict[str, Path], drafts: dict[str, Path], end: str
) -> None:
    engine = engine_for(tiny_models["gqa"], drafts["same"])
    draft = engine.speculation.draft  # type: ignore[union-attr]
    assert draft is not None
    sid = engine.create_session().session_id
    engine.generate(request("t0", PROMPT, 8, session_id=sid))
    assert engine.has_unfinished()  # the turn's last token is still to be committed
    getattr(engine, f"{end}_session")(sid)
    while engine.has_unfinished():
        engine.step()
    assert draft.parked_sessions == 0 and draft.runner.active == 0


def test_stop_sequences_and_max_tokens_inside_a_guess(
    tiny_models: dict[str, Path], drafts: dict[str, Path]
) -> None:
    target = tiny_models["gqa"]
    want = engine_for(target, None).generate(request("a", PROMPT, 12))
    stop_word = want.text.split()[5]
    for stopping in (
        StoppingCriteria(max_new_tokens=12, ignore_eos=True, stop_sequences=(stop_word,)),
        StoppingCriteria(max_new_tokens=3, ignore_eos=True),
    ):
        plain = engine_for(target, None).generate(request("s", PROMPT, 0, stopping=stopping))
        got = engine_for(target, drafts["same"]).generate(
            request("s", PROMPT, 0, stopping=stopping)
        )
        assert (got.text, got.token_ids, got.finish_reason) == (
            plain.text,
            plain.token_ids,
            plain.finish_reason,
        )
    assert got.finish_reason is FinishReason.MAX_TOKENS


def test_constrained_output_is_the_same_with_a_draft(bytes_models: dict[str, Path]) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False},
    }

    def requests() -> list[GenerationRequest]:
        return [
            GenerationRequest(
                f"r{i}",
                tuple(encode_bytes("Answer in JSON: ")),
                sampling=s,
                stopping=StoppingCriteria(max_new_tokens=120),
                constraint=Constraint("json_schema", json.dumps(schema)),
            )
            for i, s in enumerate((SamplingParams(), SAMPLED))
        ]

    target = bytes_models["gqa"]
    plain = engine_for(target, None).run_to_completion(requests())
    engine = engine_for(target, target)
    got = engine.run_to_completion(requests())
    for rid, want in plain.items():
        assert got[rid].token_ids == want.token_ids
        if got[rid].finish_reason is FinishReason.EOS_TOKEN:  # the grammar completed
            json.loads(got[rid].text)
    assert engine.counters["spec_accepted_tokens.draft"] > 0


def test_auto_mode_lets_prompt_lookup_take_longer_guesses(
    tiny_models: dict[str, Path], drafts: dict[str, Path]
) -> None:
    target = tiny_models["gqa"]
    config = SpeculationConfig(2, 4, draft_model=str(drafts["same"]), batch_rule="always")  # "auto"
    engine = LLMEngine(EngineConfig(model_dir=str(target), speculation=config))
    reqs = [request("a", PROMPT, 40), request("b", "a bird saw it", 30, sampling=SAMPLED)]
    got = engine.run_to_completion(reqs)
    plain = engine_for(target, None).run_to_completion(reqs)
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in plain.items()}
    c = engine.counters
    assert c["spec_draft_tokens.draft"] > 0 and c["spec_draft_tokens.prompt_lookup"] > 0
    assert engine.info().speculative_mode == "auto"


def test_a_draft_with_another_vocabulary_is_refused(
    tiny_models: dict[str, Path], bytes_models: dict[str, Path]
) -> None:
    with pytest.raises(ValueError) as info:
        engine_for(tiny_models["gqa"], bytes_models["gqa"])
    assert str(info.value) == (
        f"draft_model {bytes_models['gqa']}: token id 3 is 'the' in the target's vocabulary "
        "and 'Ā' in the draft's (85 and 259 tokens); the draft's token ids and strings must "
        "equal the target's"
    )


def test_batched_guessing_spans_all_speculating_sequences(
    tiny_models: dict[str, Path], drafts: dict[str, Path]
) -> None:
    """With max_batch 4, four greedy streams guess together: the draft's decode
    calls are batched (fewer calls than guessed tokens)."""
    engine = engine_for(tiny_models["gqa"], drafts["same"], num_tokens=4, max_batch=4)
    reqs = [request(str(i), " ".join(PROMPT.split()[i:]), 24) for i in range(4)]
    got = engine.run_to_completion(reqs)
    assert all(len(r.token_ids) == 24 for r in got.values())
    draft = engine.speculation.draft  # type: ignore[union-attr]
    assert draft is not None
    assert draft.steps * 2 < engine.counters["spec_draft_tokens"]


def test_config_errors() -> None:
    with pytest.raises(ValueError, match=r"--draft-model needs --speculate N"):
        SpeculationConfig(0, draft_model="d")
    with pytest.raises(ValueError, match="--speculative-mode draft needs --draft-model DIR"):
        SpeculationConfig(4, mode="draft")
    with pytest.raises(ValueError, match="prompt-lookup never uses --draft-model"):
        SpeculationConfig(4, draft_model="d", mode="prompt-lookup")
    with pytest.raises(ValueError, match="--speculative-mode must be one of"):
        SpeculationConfig(4, mode="eagle")
    assert SpeculationConfig(4).resolved_mode == "prompt-lookup"
    assert SpeculationConfig(4, draft_model="d").resolved_mode == "auto"
    assert SpeculationConfig(0).resolved_mode == ""
    for bad in (-0.1, 1.0, float("nan")):
        with pytest.raises(ValueError, match=r"--draft-min-confidence must be in \[0, 1\), got"):
            SpeculationConfig(4, draft_model="d", min_confidence=bad)


def test_server_flags_and_the_refusal_at_start(
    tiny_models: dict[str, Path], bytes_models: dict[str, Path]
) -> None:
    from genai_service.__main__ import build_parser, config_from_args

    def config(*flags: str) -> SpeculationConfig:
        args = build_parser().parse_args(["--model", str(tiny_models["gqa"]), *flags])
        return config_from_args(args).engine.speculation

    draft = str(tiny_models["gqa"])
    assert config("--speculate", "4", "--draft-model", draft) == SpeculationConfig(
        4, draft_model=draft
    )
    assert config(
        "--speculate", "3", "--draft-model", draft, "--speculative-mode", "draft"
    ).resolved_mode == ("draft")
    assert config(
        "--speculate", "8", "--draft-model", draft, "--draft-min-confidence", "0.5"
    ) == SpeculationConfig(8, draft_model=draft, min_confidence=0.5)
    # genai-server itself exits with the message before it starts anything.
    argv = ["--model", draft, "--speculate", "4", "--draft-model", str(bytes_models["gqa"])]
    done = subprocess.run(
        [sys.executable, "-m", "genai_service", *argv], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert "token id 3 is 'the' in the target's vocabulary" in done.stdout + done.stderr


def test_get_model_info_reports_the_mode_and_the_draft(
    tiny_models: dict[str, Path], drafts: dict[str, Path]
) -> None:
    from genai_client import Client
    from genai_service.config import ServerConfig
    from tests.server_harness import ServerThread, free_port

    engine = EngineConfig(
        model_dir=str(tiny_models["gqa"]),
        speculation=SpeculationConfig(4, 2, draft_model=str(drafts["one_layer"]), mode="draft"),
        scheduler=SchedulerConfig(max_num_seqs=4),
    )
    srv = ServerThread(ServerConfig(engine=engine, port=free_port())).start()
    try:
        with Client(srv.target) as client:
            info = client.model_info()
            assert (info.speculative_mode, info.speculative_tokens, info.draft_model_id) == (
                "DRAFT",
                4,
                drafts["one_layer"].name,
            )
            streamed = [
                t
                for d in client.stream(
                    token_ids=encode_words(PROMPT), max_new_tokens=24, ignore_eos=True
                )
                for t in d.token_ids
            ]
    finally:
        srv.stop()
    plain = engine_for(tiny_models["gqa"], None).generate(request("a", PROMPT, 24))
    assert streamed == list(plain.token_ids)


def test_metrics_label_the_counters_by_proposer() -> None:
    from prometheus_client import generate_latest

    from genai_service.server.metrics import Metrics

    metrics = Metrics()
    metrics.engine.snapshot = {
        "spec_guesses": 4,
        "spec_guesses.draft": 3,
        "spec_guesses.prompt_lookup": 1,
        "spec_draft_tokens": 12,
        "spec_accepted_tokens": 7,
        "spec_draft_tokens.draft": 10,
        "spec_accepted_tokens.draft": 6,
        "spec_draft_tokens.prompt_lookup": 2,
        "spec_accepted_tokens.prompt_lookup": 1,
        "steps": 5,
    }
    text = generate_latest(metrics.registry).decode()
    lines = {line for line in text.splitlines() if line.startswith("genai_engine_")}
    assert lines >= {
        'genai_engine_spec_draft_tokens{proposer="draft"} 10.0',
        'genai_engine_spec_draft_tokens{proposer="prompt_lookup"} 2.0',
        'genai_engine_spec_accepted_tokens{proposer="draft"} 6.0',
        'genai_engine_spec_accepted_tokens{proposer="prompt_lookup"} 1.0',
        'genai_engine_spec_guesses{proposer="draft"} 3.0',
        'genai_engine_spec_guesses{proposer="prompt_lookup"} 1.0',
        "genai_engine_steps 5.0",
    }
    assert "genai_engine_spec_draft_tokens 12.0" not in lines  # the labelled family only


def test_sampled_guesses_draw_what_the_target_will_draw(
    tiny_models: dict[str, Path], drafts: dict[str, Path]
) -> None:
    """A draft picks its sampled guesses with a copy of the request's generator:
    the target as its own draft then agrees on every sampled guess (a greedy
    guess would agree only where the draw lands on the likeliest token)."""
    target = tiny_models["gqa"]
    reqs = [request("s", PROMPT, 40, sampling=SamplingParams(temperature=1.0, top_k=20, seed=3))]
    plain = engine_for(target, None).run_to_completion(reqs)
    engine = engine_for(target, drafts["same"], num_tokens=4)
    got = engine.run_to_completion(reqs)
    assert got["s"].token_ids == plain["s"].token_ids
    c = engine.counters
    assert c["spec_draft_tokens"] > 20
    assert c["spec_accepted_tokens"] == c["spec_draft_tokens"]


def test_a_long_prompt_is_fed_to_the_draft_in_chunks(
    tiny_models: dict[str, Path], drafts: dict[str, Path]
) -> None:
    """The draft learns a prompt at most --max-num-batched-tokens tokens a
    step (a prefill of its own, spread over the target's decode steps); the
    sequence guesses once the draft has caught up."""
    target = tiny_models["gqa"]
    prompt = " ".join([PROMPT] * 4)  # 76 tokens
    engine = engine_for(
        target, drafts["same"], scheduler=SchedulerConfig(max_num_batched_tokens=16)
    )
    draft = engine.speculation.draft  # type: ignore[union-attr]
    assert draft is not None
    engine.add_request(request("a", prompt, 30))
    fed = []  # draft tokens fed to catch up, per step
    while engine.has_unfinished():
        before = draft.catchup_fed
        engine.step()
        fed.append(draft.catchup_fed - before)
    assert max(fed) == 16  # never more than the budget in one step
    assert sum(fed) >= len(encode_words(prompt))  # the whole prompt, over several steps
    assert sum(1 for n in fed if n == 16) >= 4
    assert engine.counters["spec_accepted_tokens"] > 0  # then it guesses
    plain = engine_for(target, None).generate(request("a", prompt, 30))
    got = engine.run_to_completion([request("b", prompt, 30)])["b"]
    assert got.token_ids == plain.token_ids


def test_a_failing_draft_model_costs_its_guesses_not_the_request(
    tiny_models: dict[str, Path], drafts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = engine_for(tiny_models["gqa"], drafts["one_layer"])
    draft = engine.speculation.draft  # type: ignore[union-attr]
    assert draft is not None

    calls = []

    def broken(items: object) -> np.ndarray:
        calls.append(items)
        raise RuntimeError("draft ORT failure")

    monkeypatch.setattr(draft.runner, "run", broken)
    monkeypatch.setattr(draft.runner, "verify_batch", broken)
    got = engine.generate(request("a", PROMPT, 40))
    plain = engine_for(tiny_models["gqa"], None).generate(request("a", PROMPT, 40))
    assert got.token_ids == plain.token_ids
    assert engine.counters["spec_draft_tokens"] == 0
    # A draft that keeps failing backs off (1, 2, 4, ... steps): not asked every step.
    assert 3 <= len(calls) <= 6


def test_a_sequence_with_ids_past_the_drafts_vocabulary_gets_no_guesses(
    tiny_models: dict[str, Path], drafts: dict[str, Path]
) -> None:
    engine = engine_for(tiny_models["gqa"], drafts["same"])
    draft = engine.speculation.draft  # type: ignore[union-attr]
    assert draft is not None
    draft.draft_vocab = max(encode_words(PROMPT))  # as if its embedding were smaller
    got = engine.generate(request("a", PROMPT, 20))
    plain = engine_for(tiny_models["gqa"], None).generate(request("a", PROMPT, 20))
    assert got.token_ids == plain.token_ids
    assert engine.counters["spec_draft_tokens"] == 0
    assert draft.runner.active == 0  # never fed


def test_a_speculating_steps_other_decodes_ride_in_its_check_call(
    tiny_models: dict[str, Path], drafts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With several sequences' checks in one call (the GQA graph's twin), the
    step's sequences that do not guess this step (backing off, out of guesses)
    decode in that same call: fewer model calls, the same tokens."""
    from genai_service.engine.runner.shared_buffer_runner import SharedBufferRunner

    def run(ride: bool) -> tuple[dict, int]:
        if not ride:
            monkeypatch.setattr(SharedBufferRunner, "checks_in_one_call", property(lambda s: False))
        engine = engine_for(tiny_models["gqa"], drafts["other"], max_batch=4)
        calls = []
        real = engine.runner.run
        monkeypatch.setattr(engine.runner, "run", lambda items: calls.append(items) or real(items))
        got = engine.run_to_completion(mixed_requests())
        monkeypatch.undo()
        return {rid: r.token_ids for rid, r in got.items()}, len(calls)

    riding, ride_calls = run(True)
    alone, alone_calls = run(False)
    assert riding == alone
    assert ride_calls < alone_calls, (ride_calls, alone_calls)
