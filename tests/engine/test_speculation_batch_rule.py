"""The batch rule of speculative decoding (``--speculate-batch-rule``): from
two sequences up a step guesses only while guessing steps are measured to
give tokens faster than plain ones; the tokens are a plain decode's either way."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from genai_service.config import EngineConfig, SchedulerConfig, SpeculationConfig
from genai_service.contract.request import GenerationRequest, SamplingParams, StoppingCriteria
from genai_service.engine.engine import LLMEngine
from genai_service.engine.speculation.batch_rule import (
    BURST,
    FIRST_PATIENCE,
    MARGIN,
    MAX_PATIENCE,
    BatchRule,
)
from tests.tiny_model import encode_words

PROMPT = "the cat sat on the mat and the dog sat on the cat and the cat sat on the"


def drive(
    rule: BatchRule, batch: int, steps: int, rates: dict[bool, float], sampled: int = 0
) -> list[bool]:
    """``steps`` steps of ``batch`` sequences, each of the kind the rule asks
    for, timed as ``rates`` (tokens per second of each kind, 4 tokens a
    step); the kinds the steps took."""
    kinds = []
    for _ in range(steps):
        speculate = rule.speculate(batch, sampled)
        kinds.append(speculate)
        rule.observe(batch, sampled, speculate, 4, 4 / rates[speculate])
    return kinds


def runs(kinds: list[bool]) -> list[tuple[bool, int]]:
    """Run-length encoding: (kind, consecutive steps)."""
    out: list[tuple[bool, int]] = []
    for kind in kinds:
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + 1)
        else:
            out.append((kind, 1))
    return out


def check_tries(
    runs_: list[tuple[bool, int]], chosen: bool, step_s: dict[bool, float], patience: int
) -> None:
    """``runs_`` (run-length encoded steps, starting with a run of ``chosen``
    and ending before the last, which may be cut short): ``chosen`` runs,
    with tries of the other kind of ``BURST`` steps, each after ``patience``
    times the seconds that the other's last try took, then twice that ... up
    to ``MAX_PATIENCE`` times (steps of each kind take ``step_s``)."""
    tries = [n for kind, n in runs_ if kind != chosen]
    gaps = [n for kind, n in runs_ if kind == chosen]
    assert len(tries) >= 4 and all(n == BURST for n in tries)
    cost = BURST * step_s[not chosen]
    want = [min(MAX_PATIENCE, patience * 2**i) * cost / step_s[chosen] for i in range(len(gaps))]
    assert all(w - 2 <= n <= w + 2 for n, w in zip(gaps, want, strict=True)), (gaps, want)


def test_plain_wins_then_speculation_is_tried_ever_more_rarely() -> None:
    rule = BatchRule("measured")
    rates = {True: 80.0, False: 100.0}
    kinds = drive(rule, 4, 30000, rates)
    got = runs(kinds)
    assert got[0] == (True, BURST)  # speculation first: a burst of it
    # Then the try of plain steps, which wins: plain from then on.
    assert got[1][0] is False
    step_s = {k: 4 / r for k, r in rates.items()}
    check_tries([(False, got[1][1] - BURST), *got[2:-1]], False, step_s, FIRST_PATIENCE)
    assert sum(kinds) < 0.02 * len(kinds)


def test_speculation_wins_and_plain_is_tried_ever_more_rarely() -> None:
    rule = BatchRule("measured")
    rates = {True: 150.0, False: 100.0}
    kinds = drive(rule, 2, 30000, rates)
    got = runs(kinds)
    assert got[:2] == [(True, BURST), (False, BURST)]
    # The try of plain steps lost, so speculation keeps on, as the first
    # choice it won again: the next try waits twice as long.
    step_s = {k: 4 / r for k, r in rates.items()}
    check_tries(got[2:-1], True, step_s, 2 * FIRST_PATIENCE)
    assert kinds.count(False) < 0.02 * len(kinds)


def test_nearly_equal_kinds_do_not_switch() -> None:
    """Within ``MARGIN`` of each other, the kind chosen first stays chosen."""
    rule = BatchRule("measured")
    kinds = drive(rule, 3, 20000, {True: 100.0, False: 100.0 * (MARGIN - 0.01)})
    assert all(n == BURST for kind, n in runs(kinds) if not kind)  # its tries only
    assert rule.speculate(3)


def test_the_choice_follows_a_change_in_what_pays() -> None:
    """Speculation chosen for long (its tries of plain steps far apart), then
    its acceptance falls: its rate falls below plain's, which is tried at once
    and takes over within a few bursts; speculation is tried again soon
    (patience starts over on a switch), and takes over again once it pays."""
    rule = BatchRule("measured")
    drive(rule, 3, 20000, {True: 150.0, False: 100.0})
    assert rule.speculate(3)
    kinds = drive(rule, 3, 3000, {True: 60.0, False: 100.0})  # acceptance fell
    assert kinds[: 2 * BURST] == [True] * (2 * BURST)  # two bursts pull its mean rate down
    assert kinds[2 * BURST : 3 * BURST] == [False] * BURST  # the early try, which wins
    assert not any(kinds[3 * BURST : 60])
    first_try = kinds.index(True, 3 * BURST)
    # after 16 times what speculation's last try took (8 steps at 150 tok/s)
    assert abs(first_try - 3 * BURST - FIRST_PATIENCE * BURST * 100 / 150) <= 2
    assert kinds[-1000:].count(True) < 50
    kinds = drive(rule, 3, 20000, {True: 150.0, False: 100.0})  # and came back
    assert kinds[-2000:].count(False) < 50


def test_each_batch_size_and_count_of_sampling_sequences_is_measured_on_its_own() -> None:
    rule = BatchRule("measured")
    drive(rule, 2, 200, {True: 150.0, False: 100.0})
    drive(rule, 4, 200, {True: 150.0, False: 100.0}, sampled=0)
    drive(rule, 4, 200, {True: 60.0, False: 100.0}, sampled=4)
    assert rule.speculate(2) and rule.speculate(4, 0)
    assert not rule.speculate(4, 4)
    assert rule.speculate(4, 2)  # not measured yet: speculation first


def test_one_sequence_and_the_always_rule_always_speculate() -> None:
    measured, always = BatchRule("measured"), BatchRule("always")
    assert all(drive(measured, 1, 200, {True: 1.0, False: 100.0}))
    assert all(drive(always, 4, 200, {True: 1.0, False: 100.0}))
    with pytest.raises(ValueError, match="--speculate-batch-rule must be one of measured, always"):
        BatchRule("sometimes")
    with pytest.raises(ValueError, match="--speculate-batch-rule must be one of"):
        SpeculationConfig(num_tokens=4, batch_rule="sometimes")


def test_a_drafts_catch_up_is_not_timed() -> None:
    """Speculation 1.2x as fast as plain steps, but its first step after plain
    ones costs eight more plain steps (the draft catching up): that step is
    reported untimed, and the rule keeps speculating, with tries of plain
    steps ever more rarely. Timed, the catch-up would make every try of plain
    steps look like a fall of speculation's rate."""
    rule = BatchRule("measured")
    plain_s, spec_s = 4 / 100.0, 4 / 120.0
    kinds, last = [], None
    for _ in range(40000):
        kind = rule.speculate(2)
        catch_up = kind and last is False
        rule.observe(
            2,
            0,
            kind,
            4,
            spec_s + 8 * plain_s if catch_up else (spec_s if kind else plain_s),
            timed=not catch_up,
        )
        kinds.append(kind)
        last = kind
    assert kinds.count(False) < 0.01 * len(kinds)
    # Plain steps only in tries (never chosen), one after 32, 64 ... 256 times
    # what a try takes: no early tries prompted by a catch-up.
    tries = [n for kind, n in runs(kinds)[:-1] if not kind]
    assert all(n == BURST for n in tries)
    assert len(tries) <= 20


# -- in the engine: timings rewritten so the rule's choice is known ---------------------


def engine(model: Path, rule: str = "measured", num_tokens: int = 1) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model_dir=str(model),
            speculation=SpeculationConfig(num_tokens=num_tokens, max_batch=4, batch_rule=rule),
            scheduler=SchedulerConfig(max_num_seqs=4),
        )
    )


def requests(n: int) -> list[GenerationRequest]:
    out = []
    for i in range(4):
        sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=i) if i % 2 else SamplingParams()
        out.append(
            GenerationRequest(
                str(i),
                tuple(encode_words(" ".join(PROMPT.split()[i:]))),
                sampling=sampling,
                stopping=StoppingCriteria(max_new_tokens=n, ignore_eos=True),
            )
        )
    return out


@pytest.mark.parametrize("speculation_pays", [False, True])
def test_engine_steps_follow_the_rule_and_keep_plain_tokens(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, speculation_pays: bool
) -> None:
    """Four streams (two greedy, two sampled) decode 90 tokens with prompt
    lookup guessing one token: when guessing steps are timed slower, the
    engine stops guessing after its first measurements (counted in
    ``spec_rule_plain_steps``) and tries again later; when faster, it keeps
    guessing but for the tries of plain steps. The tokens equal a plain
    engine's in both cases."""
    model = tiny_models["gqa"]
    plain = LLMEngine(EngineConfig(model_dir=str(model), scheduler=SchedulerConfig(max_num_seqs=4)))
    want = plain.run_to_completion(requests(90))

    eng = engine(model)
    assert eng.speculation is not None
    rule = eng.speculation.rule
    real = rule.observe
    slow, fast = (1.0, 0.1) if speculation_pays else (0.1, 1.0)  # seconds per step, plain/guessing

    def timed(
        batch: int, sampled: int, speculated: bool, tokens: int, seconds: float, timed: bool
    ) -> None:
        real(batch, sampled, speculated, tokens, fast if speculated else slow, timed)

    monkeypatch.setattr(rule, "observe", timed)
    got = eng.run_to_completion(requests(90))
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in want.items()}
    skipped = eng.counters["spec_rule_plain_steps"]
    assert eng.counters["spec_draft_tokens"] > 0
    if speculation_pays:
        assert 0 < skipped <= 2 * BURST  # the tries of plain steps
    else:
        assert skipped > 40


def test_a_drafts_catch_up_after_plain_steps_is_reported_untimed(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a draft model (the target itself: every guess is kept), the first
    speculating step after the rule's plain steps feeds the draft what it
    missed and is reported untimed; speculating steps after speculating ones
    (one token a sequence to learn) are timed."""
    model = tiny_models["gqa"]
    eng = LLMEngine(
        EngineConfig(
            model_dir=str(model),
            speculation=SpeculationConfig(
                num_tokens=1, max_batch=4, draft_model=str(model), mode="draft"
            ),
            scheduler=SchedulerConfig(max_num_seqs=4),
        )
    )
    assert eng.speculation is not None
    rule = eng.speculation.rule
    real = rule.observe
    seen: list[tuple[bool, bool]] = []

    def timed(
        batch: int, sampled: int, speculated: bool, tokens: int, seconds: float, timed: bool
    ) -> None:
        if batch == 4:
            seen.append((speculated, timed))
        real(batch, sampled, speculated, tokens, 0.1 if speculated else 1.0, timed)

    monkeypatch.setattr(rule, "observe", timed)
    greedy = [dataclasses.replace(r, sampling=SamplingParams()) for r in requests(90)]
    eng.run_to_completion(greedy)
    resumed = [i for i in range(1, len(seen)) if seen[i][0] and not seen[i - 1][0]]
    assert resumed  # a try of plain steps, then speculation again
    assert all(not seen[i][1] for i in resumed)
    steady = [i for i in range(1, len(seen)) if seen[i][0] and seen[i - 1][0]]
    assert len(steady) > BURST and all(seen[i][1] for i in steady)


def test_the_always_rule_guesses_at_every_step(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    eng = engine(tiny_models["gqa"], rule="always")
    assert eng.speculation is not None
    rule = eng.speculation.rule
    real = rule.observe
    monkeypatch.setattr(
        rule, "observe", lambda b, n, s, t, _, timed: real(b, n, s, t, 1.0 if s else 0.1, timed)
    )
    eng.run_to_completion(requests(60))
    assert eng.counters["spec_rule_plain_steps"] == 0
    assert eng.counters["spec_draft_tokens"] > 0


def test_the_flag_reaches_the_config(tmp_path: Path) -> None:
    from genai_service.__main__ import build_parser, config_from_args

    def rule(*flags: str) -> str:
        args = build_parser().parse_args(["--model", str(tmp_path), "--speculate", "4", *flags])
        return config_from_args(args).engine.speculation.batch_rule

    assert rule() == "measured"
    assert rule("--speculate-batch-rule", "always") == "always"
    with pytest.raises(SystemExit):  # argparse refuses a value not among the choices
        rule("--speculate-batch-rule", "sometimes")
