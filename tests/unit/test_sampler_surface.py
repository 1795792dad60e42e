"""The decoding surface past the classic samplers (issue 26, part 1): top-a,
typical-p, XTC, Mirostat v2, DRY, logit_bias, banned/allowed ids, bad words and
the repetition window, each on a known distribution; their validation."""

from __future__ import annotations

import numpy as np
import pytest

from genai_common.errors import InvalidArgument
from genai_service.config import LimitsConfig
from genai_service.contract.request import GenerationRequest, SamplingParams
from genai_service.engine.sampling import sampler_kernels as kernels
from genai_service.engine.sampling.sampler import (
    MirostatState,
    SamplingRow,
    penalize,
    prepare,
    sample,
)
from genai_service.engine.validation import validate_request

PROBS = np.array([0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.015, 0.005])
LOGITS = np.log(PROBS).astype(np.float32)
N_DRAWS = 3000
TOL = 0.03


def row(params: SamplingParams, seed: int = 0, **kwargs: object) -> SamplingRow:
    return SamplingRow(
        params=params,
        rng=np.random.default_rng(seed),
        prompt_token_ids=kwargs.pop("prompt", ()),  # type: ignore[arg-type]
        output_token_ids=kwargs.pop("output", ()),  # type: ignore[arg-type]
        **kwargs,  # type: ignore[arg-type]
    )


def draws(params: SamplingParams, n: int = N_DRAWS, **kwargs: object) -> np.ndarray:
    args = prepare([row(params, **kwargs)])
    return np.array([sample(LOGITS[None], args).token_ids[0] for _ in range(n)])


def frequencies(tokens: np.ndarray) -> np.ndarray:
    return np.bincount(tokens, minlength=PROBS.size) / tokens.size


def renormalised(keep: list[int]) -> np.ndarray:
    out = np.zeros_like(PROBS)
    out[keep] = PROBS[keep]
    return out / out.sum()


@pytest.mark.parametrize(("top_a", "kept"), [(1.0, [0, 1]), (0.5, [0, 1, 2, 3]), (0.0, None)])
def test_top_a_keeps_the_tokens_above_top_a_times_the_top_probability_squared(
    top_a: float, kept: list[int] | None
) -> None:
    # p_max^2 = 0.16: 1.0 keeps p >= 0.16 (two tokens), 0.5 keeps p >= 0.08 (four).
    f = frequencies(draws(SamplingParams(temperature=1.0, top_a=top_a)))
    want = PROBS if kept is None else renormalised(kept)
    np.testing.assert_allclose(f, want, atol=TOL)
    if kept is not None:
        assert f[max(kept) + 1 :].sum() == 0


def test_xtc_with_probability_one_drops_all_top_choices_but_the_least_likely() -> None:
    # Above 0.12: 0.40, 0.25 and 0.15; all but 0.15 go.
    f = frequencies(draws(SamplingParams(temperature=1.0, xtc_probability=1.0, xtc_threshold=0.12)))
    np.testing.assert_allclose(f, renormalised([2, 3, 4, 5, 6, 7]), atol=TOL)
    assert f[:2].sum() == 0


def test_xtc_does_nothing_with_fewer_than_two_tokens_above_the_threshold() -> None:
    plain = draws(SamplingParams(temperature=1.0, xtc_probability=0.0))
    f = frequencies(draws(SamplingParams(temperature=1.0, xtc_probability=1.0, xtc_threshold=0.3)))
    np.testing.assert_allclose(f, frequencies(plain), atol=TOL)
    assert f[0] > 0.3


def test_xtc_at_half_probability_removes_the_top_choices_about_half_the_time() -> None:
    f = frequencies(draws(SamplingParams(temperature=1.0, xtc_probability=0.5, xtc_threshold=0.12)))
    want = 0.5 * PROBS + 0.5 * renormalised([2, 3, 4, 5, 6, 7])
    np.testing.assert_allclose(f, want, atol=TOL)


def _typical_set(typical_p: float) -> list[int]:
    """Locally typical sampling by its definition, independently of the sampler."""
    surprise = -np.log(PROBS)
    entropy = float((PROBS * surprise).sum())
    order = sorted(range(PROBS.size), key=lambda t: (abs(surprise[t] - entropy), t))
    kept, mass = [], 0.0
    for t in order:
        kept.append(t)
        mass += PROBS[t]
        if mass >= typical_p:
            break
    return sorted(kept)


@pytest.mark.parametrize("typical_p", [0.3, 0.5, 0.9])
def test_typical_p_keeps_the_tokens_nearest_the_entropy(typical_p: float) -> None:
    kept = _typical_set(typical_p)
    assert len(kept) < PROBS.size
    f = frequencies(draws(SamplingParams(temperature=1.0, typical_p=typical_p)))
    np.testing.assert_allclose(f, renormalised(kept), atol=TOL)


def test_mirostat_first_step_truncates_at_mu_and_moves_mu_by_eta_times_the_error() -> None:
    state = MirostatState(6.0)  # 2 * tau
    params = SamplingParams(temperature=1.0, mirostat=2, mirostat_tau=3.0, mirostat_eta=0.1)
    token = int(sample(LOGITS[None], prepare([row(params, mirostat=state)])).token_ids[0])
    # surprise <= 6 bits keeps p >= 1/64: every token but 0.015 and 0.005
    kept = PROBS[:6] / PROBS[:6].sum()
    assert token < 6
    assert state.mu == pytest.approx(6.0 - 0.1 * (-np.log2(kept[token]) - 3.0))


def test_mirostat_mu_moves_the_observed_surprise_toward_tau() -> None:
    tau = 1.6  # below the distribution's entropy (2.4 bits): truncation can reach it
    state = MirostatState(2 * tau)
    params = SamplingParams(temperature=1.0, mirostat=2, mirostat_tau=tau, mirostat_eta=0.1)
    args = prepare([row(params, mirostat=state)])
    surprises = []
    for _ in range(3000):
        mu = state.mu
        sample(LOGITS[None], args)
        surprises.append((mu - state.mu) / 0.1 + tau)  # the step's observed surprise
    assert np.mean(surprises[1000:]) == pytest.approx(tau, abs=0.1)
    assert 1.0 < state.mu < 3.5


def test_dry_penalises_the_continuation_of_a_repeated_sequence() -> None:
    # ... 10 11 12 | 13 ... 10 11 12: choosing 13 would repeat a run of n = 3.
    ctx = np.array([5, 10, 11, 12, 13, 6, 10, 11, 12])
    breakers = np.zeros(20, dtype=bool)
    ids, pen = kernels.dry_penalties(
        ctx, breakers, multiplier=0.8, base=1.75, allowed_length=2, last_n=0
    )
    assert ids.tolist() == [13]
    assert pen[0] == pytest.approx(0.8 * 1.75 ** (3 - 2))
    # a run shorter than allowed_length is free
    ids, _ = kernels.dry_penalties(
        ctx, breakers, multiplier=0.8, base=1.75, allowed_length=4, last_n=0
    )
    assert ids.size == 0
    # a sequence breaker inside the run cuts it to n = 1
    breakers[11] = True
    ids, _ = kernels.dry_penalties(
        ctx, breakers, multiplier=0.8, base=1.75, allowed_length=2, last_n=0
    )
    assert ids.size == 0
    # outside the window: nothing to match
    breakers[11] = False
    ids, _ = kernels.dry_penalties(
        ctx, breakers, multiplier=0.8, base=1.75, allowed_length=2, last_n=4
    )
    assert ids.size == 0


def test_dry_takes_the_longest_match_and_caps_the_penalty() -> None:
    run = list(range(10, 40))
    # 39 ends the context; 7 followed all 30 tokens of the run, 8 only "37 38 39"
    ctx = np.array([*run, 7, *run[-3:], 8, *run])
    breakers = np.zeros(50, dtype=bool)
    ids, pen = kernels.dry_penalties(
        ctx, breakers, multiplier=1.0, base=10.0, allowed_length=2, last_n=0
    )
    assert ids.tolist() == [7, 8]
    assert pen[0] == pytest.approx(kernels.DRY_MAX_PENALTY)  # n = 30: 10^28, capped
    assert pen[1] == pytest.approx(10.0 ** (3 - 2))


def test_dry_moves_the_sampler_through_the_logits() -> None:
    vocab = 8
    params = SamplingParams(dry_multiplier=2.0, dry_base=2.0, dry_allowed_length=1)
    r = row(params, prompt=[1, 2, 3, 1, 2], output=[], dry_breakers=np.zeros(vocab, dtype=bool))
    x = penalize(LOGITS[None], prepare([r]))
    # 3 followed "1 2" (n = 2): 2 * 2^(2 - 1) = 4 off its logit; the rest untouched
    np.testing.assert_allclose(x[0, 3], LOGITS[3] - 4.0, rtol=1e-6)
    np.testing.assert_array_equal(np.delete(x[0], 3), np.delete(LOGITS, 3))


def test_logit_bias_bans_and_forces_tokens_greedy_and_sampled() -> None:
    ban_top = SamplingParams(logit_bias=((0, -100.0),))
    assert sample(LOGITS[None], prepare([row(ban_top)])).token_ids[0] == 1
    force = SamplingParams(temperature=1.0, logit_bias=((7, 100.0),))
    assert set(draws(force, n=200).tolist()) == {7}
    f = frequencies(draws(SamplingParams(temperature=1.0, logit_bias=((0, -100.0),))))
    np.testing.assert_allclose(f, renormalised([1, 2, 3, 4, 5, 6, 7]), atol=TOL)


def test_logit_bias_is_added_after_the_penalties() -> None:
    params = SamplingParams(repetition_penalty=2.0, logit_bias=((0, 1.0),))
    x = penalize(LOGITS[None], prepare([row(params, output=[0])]))
    assert x[0, 0] == pytest.approx(LOGITS[0] * 2.0 + 1.0)  # negative logit: multiplied


def test_banned_and_allowed_token_ids() -> None:
    f = frequencies(draws(SamplingParams(temperature=1.0, banned_token_ids=(0, 1))))
    np.testing.assert_allclose(f, renormalised([2, 3, 4, 5, 6, 7]), atol=TOL)
    f = frequencies(draws(SamplingParams(temperature=1.0, allowed_token_ids=(3, 5))))
    np.testing.assert_allclose(f, renormalised([3, 5]), atol=TOL)
    greedy = SamplingParams(allowed_token_ids=(4, 6))
    assert sample(LOGITS[None], prepare([row(greedy)])).token_ids[0] == 4


def test_allowed_ids_and_a_constraint_mask_both_apply() -> None:
    mask = np.zeros(PROBS.size, dtype=bool)
    mask[[2, 3, 4]] = True
    params = SamplingParams(temperature=1.0, allowed_token_ids=(3, 4, 5))
    f = frequencies(draws(params, allowed=mask))
    np.testing.assert_allclose(f, renormalised([3, 4]), atol=TOL)


def test_bad_words_ban_the_last_token_after_the_rest() -> None:
    ctx = np.array([1, 2, 3])
    assert kernels.bad_word_bans(ctx, [(2, 3, 4), (3, 5), (6,), (9, 7)]) == [4, 5, 6]
    r = row(SamplingParams(), output=[1, 2], bad_words=[(2, 0)])
    assert sample(LOGITS[None], prepare([r])).token_ids[0] == 1  # 0 is banned after 2
    r = row(SamplingParams(), output=[1, 3], bad_words=[(2, 0)])
    assert sample(LOGITS[None], prepare([r])).token_ids[0] == 0


def test_repetition_penalty_last_n_penalises_only_the_window() -> None:
    params = SamplingParams(repetition_penalty=2.0, repetition_penalty_last_n=2)
    x = penalize(LOGITS[None], prepare([row(params, prompt=[0, 1], output=[2, 3])]))
    np.testing.assert_array_equal(x[0, :2], LOGITS[:2])  # outside the last 2 tokens
    np.testing.assert_allclose(x[0, 2:4], LOGITS[2:4] * 2.0)


def test_an_extended_row_draws_the_same_whatever_shares_the_batch() -> None:
    params = SamplingParams(temperature=0.9, typical_p=0.8, xtc_probability=0.5, top_a=0.1)
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((12, 300)).astype(np.float32) * 3
    others = [SamplingParams(temperature=0.7, top_k=50), SamplingParams(), params]
    batch_tokens = []
    rows = [row(others[0], seed=1), row(params, seed=7), row(others[1]), row(others[2], seed=9)]
    args = prepare(rows)
    for j in range(12):
        batch = np.stack([logits[(j + 5) % 12], logits[j], logits[(j + 1) % 12], logits[j]])
        batch_tokens.append(int(sample(batch, args).token_ids[1]))
    # The same generator seeded alike, stepped alike: the same draws.
    args_alone = prepare([row(params, seed=7)])
    alone = [int(sample(logits[j : j + 1], args_alone).token_ids[0]) for j in range(12)]
    assert batch_tokens == alone


def test_rows_without_the_new_fields_take_no_new_path() -> None:
    args = prepare([row(SamplingParams(temperature=0.7, top_k=50, top_p=0.9))])
    assert args.extended == [] and not len(args.bias) and not len(args.only)


def _request(**sampling: object) -> GenerationRequest:
    return GenerationRequest("r", (1, 2, 3), sampling=SamplingParams(**sampling))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"typical_p": 0.0}, "sampling.typical_p: 0.0 is out of range; allowed (0, 1]"),
        ({"top_a": 1.5}, "sampling.top_a: 1.5 is out of range; allowed [0, 1]"),
        ({"xtc_threshold": -0.1}, "sampling.xtc_threshold: -0.1 is out of range; allowed [0, 1]"),
        ({"xtc_probability": 2.0}, "sampling.xtc_probability: 2.0 is out of range; allowed [0, 1]"),
        ({"dry_multiplier": 101.0}, "sampling.dry_multiplier: 101.0 is out of range; allowed [0, 100]"),
        ({"dry_base": 0.5}, "sampling.dry_base: 0.5 is out of range; allowed [1, 10]"),
        ({"dry_allowed_length": 0}, "sampling.dry_allowed_length: 0 is out of range; allowed [1, 1024]"),
        ({"mirostat": 1}, "sampling.mirostat: 1 is not a known value (Mirostat v1 is not supported; use 2, Mirostat v2); allowed 0 (off) or 2"),
        ({"mirostat": 3}, "sampling.mirostat: 3 is not a known value; allowed 0 (off) or 2"),
        ({"mirostat_tau": 0.0}, "sampling.mirostat_tau: 0.0 is out of range; allowed (0, 100]"),
        ({"mirostat_eta": 1.5}, "sampling.mirostat_eta: 1.5 is out of range; allowed (0, 1]"),
        ({"logit_bias": ((5, 101.0),)}, "sampling.logit_bias[5]: 101.0 is out of range; allowed [-100, 100]"),
        ({"logit_bias": ((99, 1.0),)}, "sampling.logit_bias key: 99 is out of range; allowed [0, 15]"),
        ({"banned_token_ids": (3, 16)}, "sampling.banned_token_ids[1]: 16 is out of range; allowed [0, 15]"),
        ({"allowed_token_ids": (20,)}, "sampling.allowed_token_ids[0]: 20 is out of range; allowed [0, 15]"),
        ({"bad_words": ("",)}, "sampling.bad_words[0]: 0 characters; allowed 1 to 256"),
        ({"dry_sequence_breakers": ("x" * 65,)}, "sampling.dry_sequence_breakers[0]: 65 characters; allowed 1 to 64"),
    ],
)  # fmt: skip
def test_each_new_field_is_validated_with_an_exact_message(fields: dict, message: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        validate_request(
            _request(**fields),
            vocab_size=16,
            context_length=64,
            history_len=0,
            limits=LimitsConfig(),
        )
    assert str(err.value) == message


def test_logit_bias_entries_are_bounded_by_the_server_limit() -> None:
    with pytest.raises(InvalidArgument) as err:
        validate_request(
            _request(logit_bias=tuple((i, 1.0) for i in range(5))),
            vocab_size=16,
            context_length=64,
            history_len=0,
            limits=LimitsConfig(max_logit_bias=4),
        )
    assert str(err.value) == "sampling.logit_bias: 5 entries; allowed at most 4"


def test_min_p_comes_after_top_p() -> None:
    # top_p 0.7 keeps {0.40, 0.25, 0.15} of the whole distribution; min_p 0.3
    # (p >= 0.12) then keeps all three. Min-p first would leave {0.40, 0.25,
    # 0.15} renormalised, whose 0.7 nucleus is only the first two.
    params = SamplingParams(temperature=1.0, top_p=0.7, min_p=0.3)
    f = frequencies(draws(params))
    np.testing.assert_allclose(f, renormalised([0, 1, 2]), atol=TOL)
    with_k = frequencies(draws(SamplingParams(temperature=1.0, top_k=6, top_p=0.7, min_p=0.3)))
    np.testing.assert_allclose(with_k, renormalised([0, 1, 2]), atol=TOL)
    # the extended path (top-a here keeps everything) in the same order
    ext = SamplingParams(temperature=1.0, top_p=0.7, min_p=0.3, top_a=0.01)
    np.testing.assert_allclose(frequencies(draws(ext)), renormalised([0, 1, 2]), atol=TOL)
    # and min_p 0.5 (p >= 0.2) of that nucleus: the first two
    f = frequencies(draws(SamplingParams(temperature=1.0, top_p=0.7, min_p=0.5)))
    np.testing.assert_allclose(f, renormalised([0, 1]), atol=TOL)
