"""Golden cases for the sampler's reproducibility contract (docs/design.md,
"Sampling"): the same logits, parameters and seed give the same tokens, so a
faster sampler must reproduce the draws of the one these were recorded with.

Every case rebuilds its logits from a fixed seed (numpy's PCG64 and
``standard_normal`` are stable across releases), runs several decode steps with
one generator per row, appends each chosen token to the row's output (as the
engine does, so the penalties move) and records the tokens, a digest of the top
alternatives' ids and the sum of all raw logprobs returned. ``tests/unit/data/sampler_golden.json`` holds the record;
``test_sampler_golden.py`` checks the sampler still reproduces it exactly.

Regenerate (only when the contract itself changes, never to make a faster
sampler pass): ``.venv/bin/python -m tests.unit.sampler_golden``; record only
the cases of a new mix: ``... -m tests.unit.sampler_golden --add``.
"""

from __future__ import annotations

import hashlib
import json
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from genai_service.contract.request import MIROSTAT_DEFAULT_TAU, SamplingParams
from genai_service.engine.sampling.sampler import MirostatState, SamplingRow, prepare, sample

GOLDEN_PATH = Path(__file__).parent / "data" / "sampler_golden.json"

P = SamplingParams
# Row parameter mixes; a batch of 8 cycles through one mix.
MIXES: dict[str, list[SamplingParams]] = {
    "greedy": [P()],
    "temperature": [P(temperature=0.7), P(temperature=1.0), P(temperature=1.6)],
    "top_k": [
        P(temperature=0.7, top_k=50),
        P(temperature=1.0, top_k=1),
        P(temperature=1.3, top_k=7),
    ],
    "top_p": [
        P(temperature=0.7, top_p=0.9),
        P(temperature=1.0, top_p=0.5),
        P(temperature=1.0, top_p=0.999),
    ],
    "min_p": [
        P(temperature=0.8, min_p=0.05),
        P(temperature=1.0, min_p=0.2),
        P(temperature=1.5, min_p=1e-4),
    ],
    "combined": [
        P(temperature=0.7, top_k=50, top_p=0.9),
        P(temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.1),
        P(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02),
        P(temperature=1.0, top_k=2000, top_p=0.95, frequency_penalty=0.4),
        P(temperature=1.2, top_p=0.8, presence_penalty=0.6, repetition_penalty=1.3),
        P(),
        P(repetition_penalty=1.2),
        P(temperature=0.5, top_k=5, min_p=0.1, frequency_penalty=0.2, presence_penalty=0.2),
    ],
    # The stages issue 26 added (recorded when they were; ``--add`` records new mixes only).
    "surface": [
        P(temperature=0.9, typical_p=0.8),
        P(temperature=1.0, top_a=0.3, top_k=40),
        P(temperature=0.8, xtc_probability=0.5, xtc_threshold=0.05, top_p=0.95),
        P(temperature=1.0, mirostat=2, mirostat_tau=4.0),
        P(temperature=0.7, dry_multiplier=0.8, top_k=50, logit_bias=((3, 2.0), (5, -100.0))),
        P(dry_multiplier=1.5, repetition_penalty=1.2, repetition_penalty_last_n=16),
        P(temperature=1.0, allowed_token_ids=tuple(range(0, 4097, 3)), min_p=0.01),
        P(temperature=1.2, typical_p=0.95, xtc_probability=1.0, mirostat=2, mirostat_eta=0.3),
    ],
}


@dataclass(frozen=True)
class Case:
    name: str
    vocab: int
    batch: int
    mix: str
    logits: str  # "peaked" | "flat" | "ties"
    steps: int
    ban: str = ""  # "" | "some" (a few ids in every other row) | "all" (row 0 fully banned)


def cases() -> Iterator[Case]:
    for vocab in (8, 300, 4097, 49152):
        steps = 40 if vocab < 49152 else 12
        for batch in (1, 8):
            for mix in MIXES:
                kinds = ("peaked", "flat", "ties") if vocab <= 4097 else ("peaked", "flat")
                for kind in kinds:
                    ban = "some" if mix in ("combined", "top_p") else ""
                    yield Case(
                        f"v{vocab}-b{batch}-{mix}-{kind}", vocab, batch, mix, kind, steps, ban
                    )
        yield Case(f"v{vocab}-b8-combined-allbanned", vocab, 8, "combined", "peaked", steps, "all")


def _logits(kind: str, gen: np.random.Generator, batch: int, vocab: int) -> np.ndarray:
    if kind == "peaked":  # a realistic shape: a broad body and a few strong candidates
        x = gen.standard_normal((batch, vocab)) * 2.5
        top = gen.integers(0, vocab, size=(batch, 6))
        np.put_along_axis(x, top, x.max(axis=1, keepdims=True) + gen.uniform(0, 6, (batch, 6)), 1)
        return x.astype(np.float32)
    if kind == "flat":
        return gen.uniform(0.0, 0.1, (batch, vocab)).astype(np.float32)
    return gen.integers(-3, 4, (batch, vocab)).astype(np.float32)  # many exact ties


def run_case(case: Case) -> dict[str, Any]:
    gen = np.random.default_rng(zlib.crc32(case.name.encode()))  # ``hash`` is salted
    mix = MIXES[case.mix]
    rows = []
    for i in range(case.batch):
        banned: list[int] = []
        if case.ban == "some" and i % 2:
            banned = sorted({int(t) for t in gen.integers(0, case.vocab, 3)})
        if case.ban == "all" and i == 0:
            banned = list(range(case.vocab))
        prompt = gen.integers(0, case.vocab, size=min(512, 4 * case.vocab)).tolist()
        params = mix[i % len(mix)]
        breakers = np.zeros(case.vocab, dtype=bool)
        breakers[: max(1, case.vocab // 50)] = True
        rows.append(
            SamplingRow(
                params=params,
                rng=np.random.default_rng(1000 + i),
                prompt_token_ids=prompt,
                output_token_ids=[],
                top_logprobs=(0, 3, 0, 5)[i % 4],
                banned_token_ids=banned,
                want_logprobs=i % 3 == 0,
                dry_breakers=breakers if params.dry_multiplier else None,
                mirostat=(
                    MirostatState(2.0 * (params.mirostat_tau or MIROSTAT_DEFAULT_TAU))
                    if params.mirostat
                    else None
                ),
            )
        )
    tokens: list[list[int]] = []
    top_ids = hashlib.sha256()  # the alternatives' ids, exactly, in few bytes
    lp_sum = 0.0  # their logprobs and the chosen tokens', compared with a tolerance
    for _ in range(case.steps):
        logits = _logits(case.logits, gen, case.batch, case.vocab)
        out = sample(logits, prepare(rows))
        tokens.append(out.token_ids.tolist())
        if out.logprobs is not None:
            lp_sum += float(out.logprobs.astype(np.float64).sum())
        for ids, lps in zip(out.top_token_ids, out.top_logprobs, strict=True):
            top_ids.update(ids.tobytes() + b"|")
            lp_sum += float(lps.astype(np.float64).sum())
        for row, t in zip(rows, out.token_ids.tolist(), strict=True):
            row.output_token_ids = [*row.output_token_ids, t]
    return {"tokens": tokens, "top_ids_sha256": top_ids.hexdigest(), "logprob_sum": lp_sum}


def record() -> dict[str, Any]:
    return {case.name: run_case(case) for case in cases()}


def main() -> None:
    GOLDEN_PATH.parent.mkdir(parents=True, exist_ok=True)
    if "--add" in sys.argv[1:]:  # record the cases the file lacks, keep the rest as it is
        golden = json.loads(GOLDEN_PATH.read_text())
        golden |= {c.name: run_case(c) for c in cases() if c.name not in golden}
    else:
        golden = record()
    GOLDEN_PATH.write_text(json.dumps(golden, separators=(",", ":")) + "\n")
    print(f"wrote {GOLDEN_PATH} ({GOLDEN_PATH.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
