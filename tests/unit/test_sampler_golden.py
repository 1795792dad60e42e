"""The sampler reproduces the recorded draws exactly (see ``sampler_golden``):
the same seed gives the same tokens across sampler rewrites."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.unit.sampler_golden import GOLDEN_PATH, Case, cases, run_case

GOLDEN: dict[str, Any] = json.loads(GOLDEN_PATH.read_text())
CASES = list(cases())


def test_the_record_covers_every_case() -> None:
    assert sorted(GOLDEN) == sorted(case.name for case in CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_sampler_reproduces_the_recorded_tokens(case: Case) -> None:
    want, got = GOLDEN[case.name], run_case(case)
    assert got["tokens"] == want["tokens"]
    assert got["top_ids_sha256"] == want["top_ids_sha256"]
    assert got["logprob_sum"] == pytest.approx(want["logprob_sum"], rel=1e-6, abs=1e-6)
