"""The decoding surface through the engine on the tiny model: logit_bias,
banned and allowed ids, bad words, DRY, the extended samplers and Mirostat's
state across session turns (the sampler's own tests: tests/unit/test_sampler_surface.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from genai_common.errors import InvalidArgument
from genai_service.config import CacheConfig, EngineConfig, RunnerConfig, SchedulerConfig
from genai_service.contract.request import (
    FinishReason,
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
)
from genai_service.engine.engine import LLMEngine
from genai_service.engine.sessions.sessions import session_from_record, session_record
from tests.tiny_model import (
    VOCAB_SIZE,
    WORDS,
    encode_words,
    make_feed,
    reference_greedy,
    run_model,
)

PROMPT = encode_words("the cat sat on the mat and the dog sat on the")


def engine(model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(model_dir), cache=CacheConfig(chunk_size=4)))


def request(
    rid: str, n: int = 12, prompt: list[int] = PROMPT, **sampling: object
) -> GenerationRequest:
    return GenerationRequest(
        rid,
        tuple(prompt),
        sampling=SamplingParams(**sampling),  # type: ignore[arg-type]
        stopping=StoppingCriteria(max_new_tokens=n, ignore_eos=True),
    )


def test_logit_bias_forces_a_token_and_bans_another(tiny_model_dir: Path) -> None:
    eng = engine(tiny_model_dir)
    forced = WORDS.index("box")
    out = eng.generate(request("f", logit_bias=((forced, 100.0),)))
    assert list(out.token_ids) == [forced] * 12
    plain = reference_greedy(tiny_model_dir, PROMPT, 12)
    first = plain[0]
    out = eng.generate(request("b", logit_bias=((first, -100.0),)))
    assert out.token_ids[0] != first


def test_banned_and_allowed_ids_and_bad_words(tiny_model_dir: Path) -> None:
    eng = engine(tiny_model_dir)
    plain = reference_greedy(tiny_model_dir, PROMPT, 12)
    out = eng.generate(request("ban", banned_token_ids=tuple(set(plain))))
    assert not set(out.token_ids) & set(plain)
    allowed = (WORDS.index("red"), WORDS.index("tree"))
    out = eng.generate(request("only", temperature=1.0, seed=3, allowed_token_ids=allowed))
    assert set(out.token_ids) <= set(allowed)
    # A two-word bad word: its second word never follows its first.
    a, b = plain[0], plain[1]
    words = f"{WORDS[a]} {WORDS[b]}"
    out = eng.generate(request("bad", bad_words=(words,)))
    ids = list(PROMPT) + list(out.token_ids)
    pairs = zip(ids[len(PROMPT) - 1 : -1], ids[len(PROMPT) :], strict=True)
    assert (a, b) not in set(pairs)
    assert list(out.token_ids) != plain


def test_dry_at_a_prohibitive_penalty_never_repeats_a_bigram(tiny_model_dir: Path) -> None:
    eng = engine(tiny_model_dir)
    out = eng.generate(
        request("dry", n=20, dry_multiplier=100.0, dry_base=10.0, dry_allowed_length=1)
    )
    ids = list(PROMPT) + list(out.token_ids)
    for j in range(len(PROMPT), len(ids)):
        earlier = set(zip(ids[: j - 1], ids[1:j], strict=True))
        assert (ids[j - 1], ids[j]) not in earlier or len(earlier) >= VOCAB_SIZE


@pytest.mark.parametrize(
    "fields",
    [
        {"typical_p": 0.7},
        {"top_a": 0.2},
        {"xtc_probability": 0.5, "xtc_threshold": 0.05},
        {"mirostat": 2, "mirostat_tau": 3.0},
        {"top_k": 5, "top_p": 0.9, "typical_p": 0.9, "xtc_probability": 1.0, "dry_multiplier": 0.8},
    ],
)
def test_the_extended_samplers_are_reproducible_with_a_seed(
    tiny_model_dir: Path, fields: dict
) -> None:
    eng = engine(tiny_model_dir)
    a = eng.generate(request("a", temperature=1.0, seed=11, **fields))
    # The same request beside others in one batch: the same tokens.
    results = eng.run_to_completion(
        [
            request("x", temperature=0.8, seed=1),
            request("b", temperature=1.0, seed=11, **fields),
            request("y"),
        ]
    )
    assert results["b"].token_ids == a.token_ids
    assert len(a.token_ids) == 12


def test_mirostat_mu_continues_across_session_turns_and_in_the_record(
    tiny_model_dir: Path,
) -> None:
    eng = engine(tiny_model_dir)
    sid = eng.wait(eng.create_session()).session_id
    miro = {"temperature": 1.0, "seed": 5, "mirostat": 2, "mirostat_tau": 2.0}
    eng.generate(dataclasses.replace(request("t1", **miro), session_id=sid))
    session = eng.sessions.get(sid)
    mu1 = session.mirostat_mu
    assert mu1 is not None and mu1 != 4.0  # moved from 2 tau
    restored = session_from_record(sid, session_record(session), VOCAB_SIZE)
    assert restored is not None and restored.mirostat_mu == mu1
    eng.generate(
        dataclasses.replace(request("t2", prompt=encode_words("and"), **miro), session_id=sid)
    )
    mu2 = eng.sessions.get(sid).mirostat_mu
    assert mu2 is not None and mu2 != mu1
    eng.wait(eng.reset_session(sid))
    assert eng.sessions.get(sid).mirostat_mu is None


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize(
    ("model", "runner", "chunk"),
    [("rope", "past_present", 4), ("rope", "past_present", 512), ("gqa", "shared_buffer", 4)],
)
def test_prompt_logprobs_are_the_models_at_every_prompt_position(
    tiny_models: dict[str, Path], model: str, runner: str, chunk: int
) -> None:
    model_dir = tiny_models[model]
    eng = LLMEngine(
        EngineConfig(
            model_dir=str(model_dir),
            runner=RunnerConfig(runner=runner),
            cache=CacheConfig(chunk_size=4),
            scheduler=SchedulerConfig(max_num_batched_tokens=chunk),
        )
    )
    logits, _ = run_model(model_dir, make_feed(model_dir, np.array([PROMPT])))
    ref = _log_softmax(logits[0])  # [len, vocab]: a full recompute, every position
    plain = eng.generate(request("warm", n=4))  # its chunks now in the prefix cache
    out = eng.generate(dataclasses.replace(request("p", n=4), prompt_logprobs=3))
    assert out.token_ids == plain.token_ids
    lps = out.prompt_logprobs
    assert [lp.token_id for lp in lps] == PROMPT[1:]
    for i, lp in enumerate(lps):
        assert lp.logprob == pytest.approx(ref[i, PROMPT[i + 1]], abs=1e-4)
        assert [t.token_id for t in lp.top] == list(np.argsort(-ref[i], kind="stable")[:3])
        assert lp.text == WORDS[PROMPT[i + 1]]
    assert out.usage.cached_tokens == 0  # computed whole, not reused


def test_prompt_logprobs_refused_on_a_turn_with_history(tiny_model_dir: Path) -> None:
    eng = engine(tiny_model_dir)
    sid = eng.wait(eng.create_session()).session_id
    first = eng.generate(dataclasses.replace(request("t1", n=2), session_id=sid, prompt_logprobs=1))
    assert len(first.prompt_logprobs) == len(PROMPT) - 1  # the first turn computes its prompt
    with pytest.raises(InvalidArgument) as err:
        eng.generate(dataclasses.replace(request("t2", n=2), session_id=sid, prompt_logprobs=1))
    assert str(err.value).startswith("prompt_logprobs: not on a session turn that has history")


def test_n_completions_share_one_prefill_and_each_equals_its_own_seed(
    tiny_model_dir: Path,
) -> None:
    eng = engine(tiny_model_dir)
    before = eng.counters["computed_tokens"]
    out = eng.generate(dataclasses.replace(request("g", temperature=1.0, seed=40), n=3))
    computed = eng.counters["computed_tokens"] - before
    assert [c.index for c in out.completions] == [0, 1, 2]
    assert out.seed == 40
    # The prompt once, then every member's last prompt token and its decode steps.
    assert computed == len(PROMPT) + 2 + 3 * 11
    assert eng.counters["completion_shared_prompt_tokens"] == 2 * (len(PROMPT) - 1)
    assert out.usage.prompt_tokens == len(PROMPT)
    assert out.usage.completion_tokens == 3 * 12
    for c in out.completions:
        alone = eng.generate(request(f"a{c.index}", temperature=1.0, seed=40 + c.index))
        assert c.token_ids == alone.token_ids
    assert out.token_ids == out.completions[0].token_ids
    assert len({c.token_ids for c in out.completions}) > 1


def test_best_of_returns_the_completions_of_highest_cumulative_logprob(
    tiny_model_dir: Path,
) -> None:
    eng = engine(tiny_model_dir)
    out = eng.generate(dataclasses.replace(request("b", temperature=1.5, seed=7), n=2, best_of=4))
    scores = []
    for i in range(4):
        alone = eng.generate(
            dataclasses.replace(request(f"s{i}", temperature=1.5, seed=7 + i), top_logprobs=1)
        )
        scores.append((-sum(lp.logprob for lp in alone.logprobs), i, alone.token_ids))
    best = sorted(scores)[:2]
    assert [c.token_ids for c in out.completions] == [t for _, _, t in best]
    assert all(not c.logprobs for c in out.completions)  # not asked for
    assert out.usage.completion_tokens == 4 * 12


def test_n_is_validated_and_refused_on_a_session_turn(tiny_model_dir: Path) -> None:
    eng = engine(tiny_model_dir)
    with pytest.raises(InvalidArgument) as err:
        eng.generate(dataclasses.replace(request("x"), n=17))
    assert str(err.value) == "n: 17 is out of range; allowed [1, 16]"
    with pytest.raises(InvalidArgument) as err:
        eng.generate(dataclasses.replace(request("y"), n=3, best_of=2))
    assert str(err.value) == "best_of: 2 is out of range; allowed [3, 16]"
    sid = eng.wait(eng.create_session()).session_id
    with pytest.raises(InvalidArgument) as err:
        eng.generate(dataclasses.replace(request("z"), n=2, session_id=sid))
    assert str(err.value).startswith("n: several completions are not possible in a session")


def test_aborting_a_request_for_several_completions_ends_every_member(
    tiny_model_dir: Path,
) -> None:
    eng = engine(tiny_model_dir)
    eng.add_request(dataclasses.replace(request("c", n=40, temperature=1.0), n=3))
    outputs = eng.step() + eng.step()
    assert eng.abort("c")
    while eng.has_unfinished():
        outputs += eng.step()
    end = [o for o in outputs if o.finished]
    assert len(end) == 1 and end[0].index == -1
    reasons = {o.index: o.finish_reason for o in outputs if o.finish_reason is not None}
    assert reasons == {
        0: FinishReason.CANCELLED,
        1: FinishReason.CANCELLED,
        2: FinishReason.CANCELLED,
        -1: FinishReason.CANCELLED,
    }
    assert not eng.completions.active
