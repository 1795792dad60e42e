"""Sampler unit tests on small hand-set distributions (no ONNX Runtime)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from genai_service.contract.request import SamplingParams
from genai_service.engine.sampling.sampler import (
    SampleOutput,
    SamplingRow,
    constant_args,
    penalize,
    prepare,
    sample,
    sample_constant,
)
from genai_service.engine.sampling.sampler_kernels import DRAW_BLOCK

# A known distribution over V=8: logits are log-probabilities.
PROBS = np.array([0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.015, 0.005])
LOGITS = np.log(PROBS).astype(np.float32)
N_DRAWS = 2000
TOL = 0.035  # ~3.5 sigma of a frequency estimated from 2000 draws


def make_row(
    params: SamplingParams | None = None,
    seed: int = 0,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    **kwargs: object,
) -> SamplingRow:
    return SamplingRow(
        params=params or SamplingParams(),
        rng=np.random.default_rng(seed),
        prompt_token_ids=prompt,
        output_token_ids=output,
        **kwargs,  # type: ignore[arg-type]
    )


def run(logits: np.ndarray, rows: Sequence[SamplingRow]) -> SampleOutput:
    batch = np.asarray(logits, dtype=np.float32).reshape(len(rows), -1)
    return sample(batch, prepare(rows))


def draws(params: SamplingParams, n: int = N_DRAWS, seed: int = 0, **kwargs: object) -> np.ndarray:
    """``n`` consecutive steps of one request (one generator) on LOGITS."""
    row = make_row(params, seed=seed, **kwargs)
    args = prepare([row])
    logits = LOGITS[None, :]
    return np.array([sample(logits, args).token_ids[0] for _ in range(n)])


def frequencies(tokens: np.ndarray, vocab: int = 8) -> np.ndarray:
    return np.bincount(tokens, minlength=vocab) / tokens.size


def renormalised(keep: Sequence[int], probs: np.ndarray = PROBS) -> np.ndarray:
    out = np.zeros_like(probs)
    out[list(keep)] = probs[list(keep)]
    return out / out.sum()


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


# --- greedy -----------------------------------------------------------------


def test_greedy_is_argmax_and_ties_pick_lowest_id() -> None:
    logits = np.array(
        [LOGITS, LOGITS[::-1], [0.0, 3.0, 1.0, 3.0, 3.0, -1.0, 0.0, 0.0]], dtype=np.float32
    )
    for params in (SamplingParams(), SamplingParams(temperature=0.0)):
        out = run(logits, [make_row(params) for _ in range(3)])
        assert out.token_ids.tolist() == [0, 7, 1]
        assert out.token_ids.dtype == np.int64
        assert out.logprobs is None
        assert all(t.size == 0 for t in out.top_token_ids)


def test_greedy_rows_draw_nothing_and_sampled_rows_draw_alike_every_step() -> None:
    """A sampled row draws one exponential variate per block of DRAW_BLOCK
    tokens and one per place in a block at every step (here one block),
    whichever path it takes."""
    greedy, sampled = make_row(seed=5), make_row(SamplingParams(temperature=1.0), seed=5)
    top_k = make_row(SamplingParams(temperature=1.0, top_k=2), seed=5)
    args = prepare([greedy, sampled, top_k])
    for _ in range(3):
        sample(np.stack([LOGITS, LOGITS, LOGITS]), args)
    reference = np.random.default_rng(5)
    assert greedy.rng.random() == reference.random()
    for row in (sampled, top_k):
        reference = np.random.default_rng(5)
        reference.standard_exponential(3 * (1 + DRAW_BLOCK))
        assert row.rng.random() == reference.random()


def test_caller_logits_are_not_modified() -> None:
    logits = np.stack([LOGITS, LOGITS])
    before = logits.copy()
    params = SamplingParams(
        temperature=0.8,
        top_k=3,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.5,
        frequency_penalty=0.5,
        presence_penalty=0.5,
    )
    rows = [
        make_row(params, prompt=[0, 1], output=[1, 2, 2], banned_token_ids=[3]),
        make_row(SamplingParams(repetition_penalty=2.0), prompt=[0], banned_token_ids=[1]),
    ]
    run(logits, rows)
    np.testing.assert_array_equal(logits, before)


# --- temperature --------------------------------------------------------------


def test_low_temperature_is_almost_always_argmax() -> None:
    assert set(draws(SamplingParams(temperature=0.01), n=300).tolist()) == {0}


def test_temperature_two_spreads_to_analytic_frequencies() -> None:
    tokens = draws(SamplingParams(temperature=2.0))
    expected = np.sqrt(PROBS) / np.sqrt(PROBS).sum()  # softmax(log p / 2)
    np.testing.assert_allclose(frequencies(tokens), expected, atol=TOL)
    assert frequencies(tokens)[0] < PROBS[0] - 0.05  # flatter than temperature 1


def test_temperature_one_matches_the_model_distribution() -> None:
    np.testing.assert_allclose(frequencies(draws(SamplingParams(temperature=1.0))), PROBS, atol=TOL)


# --- truncation ----------------------------------------------------------------


def test_top_k_never_samples_outside_the_top_k() -> None:
    tokens = draws(SamplingParams(temperature=1.0, top_k=2))
    assert set(tokens.tolist()) == {0, 1}
    np.testing.assert_allclose(frequencies(tokens), renormalised([0, 1]), atol=TOL)


@pytest.mark.parametrize(
    ("top_p", "nucleus"),
    [(0.3, [0]), (0.6, [0, 1]), (0.7, [0, 1, 2]), (0.85, [0, 1, 2, 3]), (0.0, [0])],
)
def test_top_p_keeps_exactly_the_expected_nucleus(top_p: float, nucleus: list[int]) -> None:
    tokens = draws(SamplingParams(temperature=1.0, top_p=top_p))
    assert set(tokens.tolist()) == set(nucleus)
    np.testing.assert_allclose(frequencies(tokens), renormalised(nucleus), atol=TOL)


def test_top_p_applies_to_the_distribution_renormalised_after_top_k() -> None:
    # After top_k=2 the top token holds 0.40 / 0.65 = 0.615 >= 0.6 on its own;
    # on the unrenormalised distribution the nucleus would be {0, 1}.
    assert set(draws(SamplingParams(temperature=1.0, top_k=2, top_p=0.6)).tolist()) == {0}


@pytest.mark.parametrize(("min_p", "kept"), [(0.3, [0, 1, 2]), (0.2, [0, 1, 2, 3]), (0.7, [0])])
def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability(
    min_p: float, kept: list[int]
) -> None:
    tokens = draws(SamplingParams(temperature=1.0, min_p=min_p))
    assert set(tokens.tolist()) == set(kept)
    np.testing.assert_allclose(frequencies(tokens), renormalised(kept), atol=TOL)


def test_top_p_nucleus_of_half_a_flat_vocabulary() -> None:
    # A flat distribution: the 0.5-nucleus holds ~half of 4096 tokens.
    v = 4096
    logits = np.random.default_rng(3).uniform(0.0, 0.1, v).astype(np.float32)
    probs = np.exp(logits.astype(np.float64))
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    size = int(np.searchsorted(np.cumsum(probs[order]), 0.5)) + 1
    nucleus = set(order[:size].tolist())
    args = prepare([make_row(SamplingParams(temperature=1.0, top_p=0.5), seed=1)])
    seen = {int(sample(logits[None, :], args).token_ids[0]) for _ in range(300)}
    assert seen <= nucleus
    assert len(seen) > 200  # still spread over the wide nucleus


def test_neutral_values_are_exact_no_ops() -> None:
    neutral = SamplingParams(
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        repetition_penalty=1.0,
        frequency_penalty=0.0,
        presence_penalty=0.0,
    )
    plain = SamplingParams(temperature=1.0)
    kwargs = {"prompt": [0, 1], "output": [0, 2, 2]}
    np.testing.assert_array_equal(draws(neutral, n=200, **kwargs), draws(plain, n=200, **kwargs))
    top_k_vocab = SamplingParams(temperature=1.0, top_k=8)
    np.testing.assert_array_equal(draws(top_k_vocab, n=200), draws(plain, n=200))
    args = prepare([make_row(neutral, **kwargs)])
    logits = LOGITS[None, :]
    assert penalize(logits, args) is logits


# --- penalties -------------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = np.array([[2.0, -1.0, 0.5, -0.5, 3.0, 0.0, 1.0, 1.0]], dtype=np.float32)
    row = make_row(SamplingParams(repetition_penalty=2.0), prompt=[0, 1, 5], output=[2, 1])
    got = penalize(logits, prepare([row]))
    # seen (prompt + output): 0, 1, 2, 5
    np.testing.assert_array_equal(got, [[1.0, -2.0, 0.25, -0.5, 3.0, 0.0, 1.0, 1.0]])
    # greedy still applies penalties: the prompt's favourite token loses
    greedy = np.array([[2.0, 1.5, 0, 0, 0, 0, 0, 0]], dtype=np.float32)
    assert run(greedy, [make_row()]).token_ids[0] == 0
    rep = make_row(SamplingParams(repetition_penalty=2.0), prompt=[0])
    assert run(greedy, [rep]).token_ids[0] == 1


def test_frequency_penalty_scales_with_count_presence_does_not() -> None:
    logits = np.zeros((1, 8), dtype=np.float32)
    history = {"prompt": [6, 6], "output": [3, 3, 3, 5]}
    freq = penalize(logits, prepare([make_row(SamplingParams(frequency_penalty=0.5), **history)]))
    pres = penalize(logits, prepare([make_row(SamplingParams(presence_penalty=0.5), **history)]))
    both = penalize(
        logits,
        prepare([make_row(SamplingParams(frequency_penalty=0.5, presence_penalty=1.0), **history)]),
    )
    np.testing.assert_array_equal(freq[0], [0, 0, 0, -1.5, 0, -0.5, 0, 0])
    np.testing.assert_array_equal(pres[0], [0, 0, 0, -0.5, 0, -0.5, 0, 0])
    np.testing.assert_array_equal(both[0], [0, 0, 0, -2.5, 0, -1.5, 0, 0])  # prompt untouched

    # The difference decides the greedy choice: token 3 repeated three times.
    greedy = np.array([[0, 0, 0, 2.0, 0, 1.2, 0, 0]], dtype=np.float32)
    by_freq = make_row(SamplingParams(frequency_penalty=0.5), **history)
    by_pres = make_row(SamplingParams(presence_penalty=0.5), **history)
    assert run(greedy, [by_freq]).token_ids[0] == 5  # 2.0 - 1.5 < 1.2 - 0.5
    assert run(greedy, [by_pres]).token_ids[0] == 3  # 2.0 - 0.5 > 1.2 - 0.5


def test_banned_ids_are_never_chosen() -> None:
    assert run(LOGITS, [make_row(banned_token_ids=[0])]).token_ids[0] == 1
    tokens = draws(SamplingParams(temperature=1.0), banned_token_ids=[0, 1])
    assert not {0, 1} & set(tokens.tolist())
    np.testing.assert_allclose(frequencies(tokens), renormalised(range(2, 8)), atol=TOL)


def test_out_of_vocabulary_ids_are_ignored() -> None:
    row = make_row(SamplingParams(repetition_penalty=2.0), prompt=[0, 99], banned_token_ids=[-1, 8])
    got = penalize(LOGITS[None, :], prepare([row]))
    np.testing.assert_array_equal(got[0, 1:], LOGITS[1:])
    assert got[0, 0] == LOGITS[0] * 2.0


def test_everything_banned_falls_back_to_raw_argmax_without_nan() -> None:
    everything = list(range(8))
    rows = [
        make_row(banned_token_ids=everything, want_logprobs=True),
        make_row(SamplingParams(temperature=0.7, top_p=0.9, top_k=3), banned_token_ids=everything),
        make_row(SamplingParams(temperature=1.0, min_p=1.5)),  # min_p > 1 empties the row
    ]
    out = run(np.stack([LOGITS] * 3), rows)
    assert out.token_ids.tolist() == [0, 0, 0]
    assert out.logprobs is not None and np.isfinite(out.logprobs).all()


# --- the draw across blocks ------------------------------------------------------

# PROBS spread over four draw blocks of a 1,024-token vocabulary (the rest of
# the vocabulary masked), so the race between blocks decides most draws.
SPREAD_IDS = np.array([3, 100, 300, 301, 520, 700, 900, 1023])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),  # the dense row
        SamplingParams(temperature=1.0, top_k=8),  # a candidate list
        SamplingParams(temperature=1.0, top_p=0.999),  # the dense nucleus
        SamplingParams(temperature=1.0, typical_p=0.9999),  # the extended row
    ],
)
def test_draws_across_blocks_follow_the_distribution(params: SamplingParams) -> None:
    logits = np.full(1024, -np.inf, dtype=np.float32)
    logits[SPREAD_IDS] = LOGITS
    args = prepare([make_row(params, seed=9)])
    tokens = np.array([sample(logits[None], args).token_ids[0] for _ in range(N_DRAWS)])
    assert set(tokens.tolist()) <= set(SPREAD_IDS.tolist())
    got = np.array([np.mean(tokens == t) for t in SPREAD_IDS])
    np.testing.assert_allclose(got, PROBS, atol=TOL)


def test_two_close_distributions_drawn_with_one_seed_mostly_agree() -> None:
    """What a draft model's sampled guess relies on (docs/design.md,
    "Speculative decoding"): two distributions that differ a little, each
    drawn with a generator of the same seed, pick the same token far more
    often than one inverse CDF in token-id order lets them (there every token
    moves by all the mass that moved below it), nearly as often as any draw
    can (their overlap, the sum of the smaller probability of each token)."""
    gen = np.random.default_rng(3)
    v, seeds = 2048, 400
    a = (gen.standard_normal(v) * 2).astype(np.float32)
    b = (a + gen.standard_normal(v) * 0.3).astype(np.float32)
    p, q = (np.exp(x - x.max()) / np.exp(x - x.max()).sum() for x in (a.astype(float), b))
    cp, cq = np.cumsum(p), np.cumsum(q)
    starts = np.maximum(np.concatenate([[0.0], cp[:-1]]), np.concatenate([[0.0], cq[:-1]]))
    inverse_cdf = np.clip(np.minimum(cp, cq) - starts, 0.0, None).sum()  # 0.24 here
    overlap = np.minimum(p, q).sum()  # 0.89 here
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=1000)):
        same = 0
        for seed in range(seeds):
            rows = [make_row(params, seed=seed), make_row(params, seed=seed)]
            picked = run(np.stack([a, b]), rows).token_ids
            same += int(picked[0] == picked[1])
        assert same / seeds > max(inverse_cdf + 0.25, overlap - 0.1), (params, same / seeds)


# --- reproducibility -----------------------------------------------------------


def test_same_seed_same_tokens_different_seed_differs() -> None:
    params = SamplingParams(temperature=1.5)
    first = draws(params, n=100, seed=42)
    np.testing.assert_array_equal(first, draws(params, n=100, seed=42))
    assert not np.array_equal(first, draws(params, n=100, seed=43))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=20),
        SamplingParams(temperature=1.2, min_p=0.05, repetition_penalty=1.3),
        SamplingParams(temperature=1.0, top_p=0.95, top_k=2000, frequency_penalty=0.4),
    ],
)
def test_a_rows_tokens_do_not_depend_on_the_rest_of_the_batch(params: SamplingParams) -> None:
    v, steps = 3000, 12
    gen = np.random.default_rng(11)
    logits = [(gen.standard_normal(v) * 2).astype(np.float32) for _ in range(steps)]
    others = [
        SamplingParams(),
        SamplingParams(temperature=0.5, top_p=0.5),
        SamplingParams(temperature=1.0, top_k=5, presence_penalty=1.0),
        SamplingParams(temperature=2.0, min_p=0.2),
        SamplingParams(temperature=0.9, top_k=1500),
    ]

    def decode(batch_size: int) -> list[int]:
        target = make_row(params, seed=7, prompt=[1, 2, 3], output=[], banned_token_ids=[4])
        rows = [make_row(p, seed=100 + i, output=[9, 9]) for i, p in enumerate(others)]
        tokens: list[int] = []
        for step in range(steps):
            pos = step % batch_size  # the target moves around the batch
            batch_rows = rows[: batch_size - 1]
            batch_rows.insert(pos, target)
            batch = np.stack(
                [
                    logits[step] if r is target else gen.standard_normal(v).astype(np.float32)
                    for r in batch_rows
                ]
            )
            tokens.append(int(sample(batch, prepare(batch_rows)).token_ids[pos]))
            target.output_token_ids = [*target.output_token_ids, tokens[-1]]
        return tokens

    alone = decode(1)
    assert decode(4) == alone
    assert decode(6) == alone


# --- logprobs --------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_sorted_alternatives() -> None:
    gen = np.random.default_rng(0)
    logits = (gen.standard_normal((4, 50)) * 2).astype(np.float32)
    rows = [
        make_row(
            SamplingParams(temperature=0.5, top_k=3, repetition_penalty=1.5),
            prompt=[1, 2],
            want_logprobs=True,
            top_logprobs=5,
        ),
        make_row(want_logprobs=True),
        make_row(SamplingParams(temperature=1.0), top_logprobs=50, banned_token_ids=[0]),
        make_row(SamplingParams(temperature=1.0)),
    ]
    out = run(logits, rows)
    ref = log_softmax(logits)
    assert out.logprobs is not None and out.logprobs.dtype == np.float32
    for i in (0, 1, 2):
        np.testing.assert_allclose(out.logprobs[i], ref[i, out.token_ids[i]], atol=1e-5)
    for i, n in ((0, 5), (2, 50)):
        ids, lps = out.top_token_ids[i], out.top_logprobs[i]
        assert ids.dtype == np.int64 and lps.dtype == np.float32
        np.testing.assert_array_equal(ids, np.argsort(-ref[i], kind="stable")[:n])
        np.testing.assert_allclose(lps, ref[i, ids], atol=1e-5)
        assert np.all(np.diff(lps) <= 0)
    assert out.top_token_ids[1].size == 0 and out.top_logprobs[3].size == 0


def test_top_alternatives_break_ties_by_lowest_id() -> None:
    logits = np.array([[1.0, 2.0, 0.0, 2.0, 2.0, 1.0, 0.0, -1.0]], dtype=np.float32)
    out = run(np.stack([logits, logits]), [make_row(top_logprobs=4), make_row(top_logprobs=2)])
    assert out.top_token_ids[0].tolist() == [1, 3, 4, 0]
    assert out.top_token_ids[1].tolist() == [1, 3]


# --- properties and speed ----------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    logits=st.lists(st.integers(-3, 3), min_size=2, max_size=24),
    data=st.data(),
    temperature=st.floats(0.05, 3.0),
    top_p=st.one_of(st.none(), st.floats(0.0, 1.0)),
    seed=st.integers(0, 2**32 - 1),
)
def test_sampled_token_is_in_the_top_k_and_never_banned(
    logits: list[int], data: st.DataObject, temperature: float, top_p: float | None, seed: int
) -> None:
    v = len(logits)
    banned = data.draw(st.sets(st.integers(0, v - 1), max_size=v - 1))
    top_k = data.draw(st.integers(1, v))
    row = make_row(
        SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p),
        seed=seed,
        banned_token_ids=sorted(banned),
    )
    x = np.array(logits, dtype=np.float32)
    token = int(run(x, [row]).token_ids[0])
    assert token not in banned
    allowed = np.sort(np.delete(x, sorted(banned)))[::-1]
    assert x[token] >= allowed[min(top_k, allowed.size) - 1]  # ties at the k-th value kept


def test_speed_of_a_large_vocabulary_batch(capsys: pytest.CaptureFixture[str]) -> None:
    v = 49152
    gen = np.random.default_rng(0)
    greedy, nucleus = SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9)
    cases = [
        (16, "greedy", greedy),
        (1, "greedy", greedy),
        (8, "greedy", greedy),
        (1, "temperature=0.7 top_p=0.9", nucleus),
        (8, "temperature=0.7 top_p=0.9", nucleus),
    ]
    lines = []
    for b, label, params in cases:
        logits = (gen.standard_normal((b, v)) * 3).astype(np.float32)
        args = prepare([make_row(params, seed=i) for i in range(b)])
        out = sample(logits, args)
        if params.greedy:
            np.testing.assert_array_equal(out.token_ids, logits.argmax(axis=1))
        reps = 20
        start = time.perf_counter()
        for _ in range(reps):
            sample(logits, args)
        ms = (time.perf_counter() - start) / reps * 1e3
        lines.append(f"sample() B={b:<2} V={v} {label}: {ms:.3f} ms")
    with capsys.disabled():
        print("\n" + "\n".join(lines))  # timing is reported, not asserted


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(temperature=0.7, top_k=3), SamplingParams(temperature=1.0)],
)
def test_a_masked_row_with_nothing_to_pick_keeps_to_its_mask(params: SamplingParams) -> None:
    # Every allowed logit is -inf or NaN: the row cannot be sampled. An unmasked
    # row falls back to the raw argmax; a masked one to its lowest allowed id.
    logits = np.array(
        [[0.0, 5.0, -np.inf, np.nan, -np.inf, 1.0], [0.0, 5.0, -np.inf, -np.inf, -np.inf, 1.0]],
        dtype=np.float32,
    )
    allowed = np.array([False, False, True, True, True, False])
    out = run(
        logits, [make_row(params, allowed=allowed), make_row(params, banned_token_ids=range(6))]
    )
    assert out.token_ids.tolist() == [2, 1]
    # The greedy fast path of the engine picks the same.
    from genai_service.engine.sampling_rows import greedy_pick

    assert greedy_pick(logits[0], allowed) == 2
    assert greedy_pick(logits[1], np.zeros(6, dtype=bool)) == 1  # allows nothing: raw argmax


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    vocab=st.sampled_from([1, 7, 257, 300, 2048, 49152]),
    top_k=st.sampled_from([0, 1, 2, 5, 50, 400]),
    min_p=st.sampled_from([0.0, 0.01, 0.2]),
    top_p=st.sampled_from([1.0, 0.999999, 0.9, 0.5, 0.05]),
    temperature=st.sampled_from([1e-3, 0.3, 0.7, 1.0, 1.7, 50.0]),
    masked=st.sampled_from([0, 1, 3, 10_000, 10**9]),
    batch=st.integers(1, 4),
    repetition=st.sampled_from([None, 1.3]),
    poison=st.sampled_from([None, None, None, np.nan, np.inf]),
    bounded=st.booleans(),
)
def test_the_one_row_path_draws_what_the_batched_path_draws(
    seed: int,
    vocab: int,
    top_k: int,
    min_p: float,
    top_p: float,
    temperature: float,
    masked: int,
    batch: int,
    repetition: float | None,
    poison: float | None,
    bounded: bool,
) -> None:
    """A step with few sampled rows takes them one by one (``_sample_one_row``);
    each must pick exactly the token of the batched form (and draw as much).
    Row 0 has the drawn parameters; the others vary them (greedy and dense
    rows among them), so handled and declined rows mix in one step.
    ``bounded``: temperature-only rows race only the blocks that can win
    (``_sample_bounded_row``, at any vocabulary)."""
    from genai_service.engine.sampling import sampler

    gen = np.random.default_rng(seed)
    logits = (gen.standard_normal((batch, vocab)) * gen.uniform(0.5, 6.0)).astype(np.float32)
    # banned / masked; 10**9: every token (the raw-argmax fallback)
    logits[:, gen.permutation(vocab)[: min(masked, vocab)]] = -np.inf
    if gen.random() < 0.2:
        logits[:, gen.integers(0, vocab, 3)] = logits[0].max()  # ties at the top
    if poison is not None:  # a NaN or +inf logit in one row
        logits[gen.integers(0, batch), gen.integers(0, vocab)] = poison
    params = [
        SamplingParams(
            temperature=temperature,
            top_k=top_k or None,
            min_p=min_p or None,
            top_p=top_p,
            repetition_penalty=repetition,
        ),
        SamplingParams(),  # greedy
        SamplingParams(temperature=temperature, top_p=top_p),  # dense: nothing cut
        SamplingParams(temperature=1.0, top_k=3, min_p=0.05),
    ][:batch]
    history = gen.integers(0, vocab, 20).tolist()

    def rows() -> list[SamplingRow]:
        return [
            make_row(p, seed=seed + j, prompt=history[:10], output=history[10:])
            for j, p in enumerate(params)
        ]

    one_by_one, batched = prepare(rows()), prepare(rows())
    s = np.flatnonzero(batched.temperature > 0)
    limit, sampler.ROW_PATH_MAX_ROWS = sampler.ROW_PATH_MAX_ROWS, 4  # every batch here
    least = sampler.BOUNDED_RACE_MIN_VOCAB
    if bounded:
        sampler.BOUNDED_RACE_MIN_VOCAB = 1
    try:
        for _ in range(3):  # the generators must advance alike too
            a = sampler.sample(logits, one_by_one)
            x = sampler.penalize(logits, batched)
            b = sampler._sample_rows(logits, x, s, batched)
            assert a.token_ids[s].tolist() == b.tolist()
    finally:
        sampler.ROW_PATH_MAX_ROWS = limit
        sampler.BOUNDED_RACE_MIN_VOCAB = least
    # (it declines only a top-k row with fewer than k finite logits)
    if masked < vocab - top_k:
        assert sampler._sample_one_row(logits, logits, 0, one_by_one) is not None


@pytest.mark.parametrize("large_vocab", [False, True])
def test_a_batchs_uncut_rows_one_by_one_draw_what_the_batched_path_draws(
    monkeypatch: pytest.MonkeyPatch, large_vocab: bool
) -> None:
    """Past ``ROW_PATH_MAX_ROWS`` sampled rows, those that nothing cuts
    (temperature only, top-p alone) still go one by one, and from
    ``ROW_PATH_MIN_VOCAB`` up every sampled row does; the others stay
    batched: every row draws the batched form's token, step after step."""
    from genai_service.engine.sampling import sampler

    if large_vocab:
        monkeypatch.setattr(sampler, "ROW_PATH_MIN_VOCAB", 1000)
    gen = np.random.default_rng(11)
    v = 3000
    logits = (gen.standard_normal((7, v)) * 3).astype(np.float32)
    logits[4] *= 0.05  # nearly flat: its nucleus lies below the first levels
    params = [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=0.7, top_k=40),
        SamplingParams(),  # greedy
        SamplingParams(temperature=1.2, top_p=0.95),
        SamplingParams(temperature=0.9, min_p=0.05),
        SamplingParams(temperature=0.8, top_p=0.8, min_p=0.1, repetition_penalty=1.3),
    ]

    def rows() -> list[SamplingRow]:
        return [make_row(p, seed=j, output=[1, 2, 3]) for j, p in enumerate(params)]

    mixed, batched = prepare(rows()), prepare(rows())
    for args in (mixed, batched):  # (a direct caller's: requests are capped at 100)
        args.temperature[4] = np.inf  # -inf / inf is NaN: its maximum is max / inf
    logits[4, :50] = -np.inf
    s = np.flatnonzero(batched.temperature > 0)
    for _ in range(4):
        a = sampler.sample(logits, mixed)
        with np.errstate(invalid="ignore"):  # as sample() calls it
            b = sampler._sample_rows(logits, sampler.penalize(logits, batched), s, batched)
        assert a.token_ids[s].tolist() == b.tolist()


@pytest.mark.parametrize("scale", [4.0, 1.0, 0.2, 0.02, None])
def test_the_one_row_nucleus_is_the_batched_one(scale: float | None) -> None:
    """``_dense_nucleus_row`` (its first two levels from one pass) keeps the
    tokens ``dense_nucleus`` keeps, at whatever level the nucleus is found:
    the first (peaked rows), the second (4.0 at 0.99), past both (None: one
    spike over a flat tail of tokens ~2^-16 of it), or the bound (flat rows)."""
    from genai_service.engine.sampling import sampler, sampler_kernels

    gen = np.random.default_rng(7)
    for top_p in (0.5, 0.9, 0.99):
        if scale is None:
            row = (gen.standard_normal(20000) * 0.01).astype(np.float32)
            row[123] = 9.0  # exp(-9 / 0.8) ~ 2^-16 for every other token
        else:
            row = (gen.standard_normal(20000) * scale).astype(np.float32)
        t = np.float32(0.8)
        m = row.max() / t
        e = np.empty((1, row.size), np.float32)
        blocks = sampler._masses(row[None], np.array([t]), np.array([m]), e)
        total = np.cumsum(blocks[0], dtype=np.float64)[-1:]
        _, cols, vals = sampler_kernels.dense_nucleus(
            e, np.zeros(1, np.int64), total, np.array([top_p])
        )
        got_cols, got_vals = sampler._dense_nucleus_row(np.divide(row, t), m, np.float64(top_p))
        assert got_cols.tolist() == cols.tolist()
        assert got_vals.tobytes() == vals.tobytes()


@pytest.mark.parametrize("v", [151936, 65536, 3 * DRAW_BLOCK + 77, DRAW_BLOCK, 300])
def test_the_bounded_race_draws_the_whole_rows_token(
    monkeypatch: pytest.MonkeyPatch, v: int
) -> None:
    """From ``BOUNDED_RACE_MIN_VOCAB`` up, a temperature-only row races only
    the blocks that can win (``_sample_bounded_row``): step after step the
    whole row's token (``_sample_dense_row``), on peaked, flat, tied, partly
    banned (whole blocks too) and constant rows, a short last block included
    (151,936 is Qwen's vocabulary); and the masses it sums for its candidate
    blocks are the whole row's, bit for bit."""
    from genai_service.engine.sampling import sampler

    gen = np.random.default_rng(v)
    rows = [
        (gen.standard_normal(v) * 4).astype(np.float32),  # peaked
        (gen.standard_normal(v) * 0.3).astype(np.float32),  # flat
        np.round(gen.standard_normal(v)).astype(np.float32),  # ties everywhere
        np.zeros(v, dtype=np.float32),  # constant: many blocks can win
        np.where(gen.random(v) < 0.6, -np.inf, gen.standard_normal(v) * 2).astype(np.float32),
    ]
    rows[1][gen.integers(0, v, 3)] += 12.0  # a few spikes over a flat tail
    rows[4][: 2 * DRAW_BLOCK] = -np.inf  # whole blocks without mass
    rows[4][-1] = 3.0  # (in the short last block, where there is one)
    masses = []
    bounded_row = sampler._sample_bounded_row

    def recorded(
        raw: np.ndarray, row: np.ndarray, tops: np.ndarray, m: np.float32, i: int, args: object
    ) -> int:
        masses.append((row, args.temperature[i], m))  # type: ignore[attr-defined]
        return bounded_row(raw, row, tops, m, i, args)  # type: ignore[arg-type]

    monkeypatch.setattr(sampler, "_sample_bounded_row", recorded)
    for j, row in enumerate(rows):
        for temperature in (1e-4, 0.2, 0.7, 1.5, 100.0):
            draws = {}
            for bounded in (True, False):
                monkeypatch.setattr(sampler, "BOUNDED_RACE_MIN_VOCAB", 1 if bounded else 1 << 40)
                r = make_row(SamplingParams(temperature=temperature), seed=10 * j)
                draws[bounded] = [sample(row[None], prepare([r])).token_ids[0] for _ in range(12)]
                draws[bounded].append(r.rng.integers(1 << 62))  # the generator in step after
            assert draws[True] == draws[False], (j, temperature)
    assert len(masses) == len(rows) * 5 * 12

    # The masses of the blocks it gathers (a third of them here, the last
    # one always) against the whole row's, every bit.
    for row, t, m in masses[::12]:
        whole, blocks = sampler._row_masses(np.divide(row, t), m)
        nb = blocks.size
        picked = np.union1d(gen.permutation(nb)[: max(1, nb // 3)], [nb - 1])
        ids, e, starts, mass = sampler._blocks_masses(row, picked, t, m)
        expected = (picked[:, None] * DRAW_BLOCK + np.arange(DRAW_BLOCK)).reshape(-1)
        assert ids.tolist() == expected[expected < v].tolist()
        assert e.tobytes() == whole[ids].tobytes()
        assert mass.tobytes() == blocks[picked].tobytes()
        assert starts.tolist() == list(range(0, e.size, DRAW_BLOCK))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_p=0.9),  # dense masses, then the nucleus
        SamplingParams(temperature=1.3),  # dense masses and the whole-row draw
        SamplingParams(temperature=0.7, top_k=50, repetition_penalty=1.2),
    ],
)
def test_rows_in_blocks_for_the_cache_change_no_bit(
    monkeypatch: pytest.MonkeyPatch, params: SamplingParams
) -> None:
    """Large batches go through their O(V) passes a row (dense masses) or a
    block of rows (logprobs' log-sum-exp) at a time: the same tokens,
    logprobs and alternatives, bit for bit, whatever the block."""
    from genai_service.engine.sampling import sampler_kernels

    v = 3 * 4096 + 77
    logits = np.random.default_rng(3).standard_normal((5, v)).astype(np.float32) * 4

    def run(block: int) -> SampleOutput:
        monkeypatch.setattr(sampler_kernels, "CACHE_ELEMENTS", block)
        monkeypatch.setattr(sampler_kernels, "LSE_BLOCK_ELEMENTS", block)
        rows = [
            make_row(params, seed=i, output=[1, 2], top_logprobs=3, want_logprobs=True)
            for i in range(5)
        ]
        return sample(logits, prepare(rows))

    # The masses themselves, every bit (a draw seldom shows a last-bit change).
    from genai_service.engine.sampling import sampler

    t = np.array([0.7, 1.0, 1.3, 0.3, 2.0], dtype=np.float32)
    m = logits.max(axis=1) / t
    monkeypatch.setattr(sampler_kernels, "CACHE_ELEMENTS", 1 << 40)
    whole = np.empty_like(logits)
    whole_blocks = sampler._masses(logits, t, m, whole)
    monkeypatch.setattr(sampler_kernels, "CACHE_ELEMENTS", v)
    by_row = np.empty_like(logits)
    row_blocks = sampler._masses(logits, t, m, by_row)
    assert whole.tobytes() == by_row.tobytes()
    assert whole_blocks.tobytes() == row_blocks.tobytes()

    one = run(1 << 40)
    for block in (v, 2 * v):
        blocks = run(block)
        assert one.token_ids.tolist() == blocks.token_ids.tolist()
        assert one.logprobs is not None and blocks.logprobs is not None
        assert one.logprobs.tobytes() == blocks.logprobs.tobytes()
        for a, b in zip(one.top_logprobs, blocks.top_logprobs, strict=True):
            assert a.tobytes() == b.tobytes()


# -- args built once (sample_constant) -------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.7, top_k=50),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
        SamplingParams(temperature=1.3, top_k=5, min_p=0.05),
        SamplingParams(temperature=0.7, top_p=0.8, min_p=0.1),
        SamplingParams(temperature=0.7, top_k=40000),
    ],
)
def test_constant_args_draw_what_sample_draws(params: SamplingParams) -> None:
    """A row whose args are built once draws, step after step, exactly the
    tokens of the general path with the same generator (the same draws per step)."""
    rng = np.random.default_rng(7)
    once = constant_args(make_row(params, seed=11))
    assert once is not None
    general = make_row(params, seed=11)
    for step in range(60):
        logits = (rng.standard_normal(49_152) * (1 + step % 5)).astype(np.float32)
        if step % 7 == 3:
            logits[rng.integers(0, 49_152, 3000)] = -np.inf  # masked tokens
        want = run(logits, [general]).token_ids[0]
        assert sample_constant(logits, once) == want, step


@pytest.mark.parametrize(
    "row",
    [
        make_row(SamplingParams()),  # greedy
        make_row(SamplingParams(temperature=0.7, repetition_penalty=1.1), output=(3,)),
        make_row(SamplingParams(temperature=0.7, frequency_penalty=0.5), output=(3,)),
        # Penalties and bans with nothing to act on yet still change later steps:
        make_row(SamplingParams(temperature=0.7, frequency_penalty=0.5)),
        make_row(SamplingParams(temperature=0.7, presence_penalty=0.5)),
        make_row(SamplingParams(temperature=0.7, dry_multiplier=0.8), prompt=(1, 2, 3)),
        make_row(SamplingParams(temperature=0.7), bad_words=((5, 6),)),
        make_row(SamplingParams(temperature=0.7, logit_bias=((3, 1.0),))),
        make_row(SamplingParams(temperature=0.7, typical_p=0.9)),
        make_row(SamplingParams(temperature=0.7), banned_token_ids=(2,)),
        make_row(SamplingParams(temperature=0.7), top_logprobs=2, want_logprobs=True),
        make_row(SamplingParams(temperature=0.7), allowed=np.ones(8, dtype=bool)),
    ],
)
def test_constant_args_refuse_rows_that_change_between_steps(row: SamplingRow) -> None:
    assert constant_args(row) is None
