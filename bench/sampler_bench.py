"""``python -m bench.sampler_bench``: the sampler's cost per decode step.

    python -m bench.sampler_bench                  # table on stdout, JSON under bench/results/
    python -m bench.sampler_bench --repeats 50 --out /tmp/sampler.json
    python -m bench.sampler_bench --vocab 262144   # Gemma 3's vocabulary

One step is ``prepare(rows)`` + ``sample(logits, args)`` as the engine calls
them, at V = 49,152 (the default model's vocabulary) for a batch of 1 and 8, on
peaked, language-model-like logits: Zipf-shaped probabilities over a random
token order with a per-step sharpness, plus noise; the table shows the median
of the repeats and whether the first steps picked the same tokens as
``sampler_golden.json``: the draws of the sampler as it was recorded, so a
change to the sampler that changes what a seed draws shows here. First
recorded from the sampler before it was vectorised (issue 14; its speed
against that baseline, measured while both existed: docs/benchmarks-archive.md,
the "Sampler microbenchmark" tables); recorded again with ``--record`` when
the draw itself changed (2026-12-07: a race between blocks instead of an
inverse CDF over them, docs/design.md "Sampling"), never to make a faster
sampler pass.

``measure() -> dict`` and ``markdown(result) -> list[str]`` are the API for a
caller that includes this table in a bigger report.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from genai_service.contract.request import SamplingParams
from genai_service.engine.sampling import sampler
from genai_service.engine.sampling.sampler import SampleOutput, SamplingArgs, SamplingRow

VOCAB = 49152
BATCHES = (1, 8)
HISTORY = 512  # prompt + output tokens seen by the repetition penalty
N_LOGITS = 16  # distinct steps' logits, cycled
CONFIGS: list[tuple[str, SamplingParams, int]] = [  # label, params, top_logprobs
    ("greedy", SamplingParams(), 0),
    ("temperature 0.7", SamplingParams(temperature=0.7), 0),
    ("+ top_k 50", SamplingParams(temperature=0.7, top_k=50), 0),
    ("+ top_p 0.9", SamplingParams(temperature=0.7, top_p=0.9), 0),
    ("temp + top_p + top_k", SamplingParams(temperature=0.7, top_p=0.9, top_k=50), 0),
    (
        "+ repetition 1.1",
        SamplingParams(temperature=0.7, top_p=0.9, top_k=50, repetition_penalty=1.1),
        0,
    ),
    (
        "+ top_logprobs 5",
        SamplingParams(temperature=0.7, top_p=0.9, top_k=50, repetition_penalty=1.1),
        5,
    ),
]

Sampler = Callable[[np.ndarray, SamplingArgs], SampleOutput]


def lm_logits(gen: np.random.Generator, batch: int, vocab: int = VOCAB) -> np.ndarray:
    """[batch, vocab] float32 logits shaped like a small LM's: Zipf ranks
    sharpened by a per-row factor in [0.8, 1.8], noise 0.3 (at temperature
    0.7 the 0.9-nucleus is a handful to a few hundred tokens)."""
    ranks = np.log(np.arange(1, vocab + 1, dtype=np.float64))
    out = np.empty((batch, vocab), dtype=np.float32)
    for i in range(batch):
        sharp = gen.uniform(0.8, 1.8)
        x = -sharp * ranks + gen.standard_normal(vocab) * 0.3
        out[i] = x[gen.permutation(vocab)] + 12.0
    return out


def _rows(
    params: SamplingParams, top_logprobs: int, batch: int, vocab: int = VOCAB
) -> list[SamplingRow]:
    gen = np.random.default_rng(7)
    rows = []
    for i in range(batch):
        history = gen.integers(0, vocab, HISTORY).tolist()
        rows.append(
            SamplingRow(
                params=params,
                rng=np.random.default_rng(100 + i),
                prompt_token_ids=history[: HISTORY // 2],
                output_token_ids=history[HISTORY // 2 :],
                top_logprobs=top_logprobs,
                want_logprobs=top_logprobs > 0,
            )
        )
    return rows


def _step(fn: Sampler, rows: list[SamplingRow], logits: np.ndarray) -> tuple[float, list[int]]:
    start = time.perf_counter()
    out = fn(logits, sampler.prepare(rows))
    return time.perf_counter() - start, out.token_ids.tolist()


GOLDEN = Path(__file__).with_name("sampler_golden.json")


def golden_key(label: str, batch: int) -> str:
    return f"{label} | B={batch}"


def measure(
    repeats: int = 200, batches: Sequence[int] = BATCHES, vocab: int = VOCAB
) -> dict[str, Any]:
    """Median per-step and per-row milliseconds for every configuration and
    batch size, and whether the first steps' draws equal the golden ones
    (recorded at V = 49,152 only: at another ``vocab`` there is none)."""
    golden = json.loads(GOLDEN.read_text())
    if vocab != VOCAB:
        golden["draws"] = {}
    gen = np.random.default_rng(0)
    cases = []
    for b in batches:
        steps = [lm_logits(gen, b, vocab) for _ in range(N_LOGITS)]
        for label, params, n_top in CONFIGS:
            rows = _rows(params, n_top, b, vocab)
            times: list[float] = []
            tokens: list[list[int]] = []
            for rep in range(max(repeats + 2, golden["steps"])):  # the first two warm up
                dt_s, picked = _step(sampler.sample, rows, steps[rep % N_LOGITS])
                if 2 <= rep < repeats + 2:
                    times.append(dt_s * 1e3)
                tokens.append(picked)
            ms = statistics.median(times)
            expected = golden["draws"].get(golden_key(label, b))
            cases.append(
                {
                    "config": label,
                    "batch": b,
                    "ms": ms,
                    "per_row_ms": ms / b,
                    "same_tokens": None
                    if expected is None
                    else tokens[: golden["steps"]] == expected,
                }
            )
    top, nucleus = [], []
    for row in np.concatenate(steps):
        probs = np.exp((row.astype(np.float64) - row.max()) / 0.7)
        probs = np.sort(probs / probs.sum())[::-1]
        top.append(probs[0])
        nucleus.append(int(np.searchsorted(np.cumsum(probs), 0.9)) + 1)
    return {
        "meta": {
            "vocab": vocab,
            "repeats": repeats,
            "history_tokens": HISTORY,
            "golden_steps": golden["steps"] if vocab == VOCAB else None,
            "median_top_token_prob_at_t0.7": float(np.median(top)),
            "median_nucleus_0.9_tokens_at_t0.7": float(np.median(nucleus)),
            "load_avg": [round(x, 2) for x in os.getloadavg()],
            "numpy": np.__version__,
        },
        "cases": cases,
    }


# Gemma 3's vocabulary: the sampler's O(V) stages at 5.3x the default model's
# (issue 27: target 0.3 ms per row at batch 8).
LARGE_VOCAB = 262144
LARGE_TARGET_MS_PER_ROW = 0.3


def measure_all(repeats: int = 200) -> dict[str, Any]:
    """``measure()`` at the default model's vocabulary, with the batch-8 rows
    at Gemma 3's under ``"large_vocab"`` (what ``make bench`` records)."""
    result = measure(repeats)
    result["large_vocab"] = measure(max(repeats // 4, 10), batches=(8,), vocab=LARGE_VOCAB)
    return result


def markdown(result: dict[str, Any]) -> list[str]:
    """The table: one line per configuration, both batch sizes (and the
    large-vocabulary table after it, when measured)."""
    lines = _table(result)
    large = result.get("large_vocab")
    if large:
        lines += ["", *_table(large)]
        over = [
            c["config"]
            for c in large["cases"]
            if c["batch"] == 8 and c["per_row_ms"] > LARGE_TARGET_MS_PER_ROW
        ]
        lines += [
            "",
            f"Target at V = {LARGE_VOCAB:,}: at most {LARGE_TARGET_MS_PER_ROW} ms per row at "
            f"B=8; over it: {', '.join(over) if over else 'none'}.",
        ]
    return lines


def _table(result: dict[str, Any]) -> list[str]:
    meta = result["meta"]
    by = {(c["config"], c["batch"]): c for c in result["cases"]}
    batches = sorted({c["batch"] for c in result["cases"]})
    head = ["config"]
    for b in batches:
        head += [f"B={b} ms", f"B={b} ms/row"]
    steps = meta.get("golden_steps")
    same = (
        f"same tokens: the first {steps} steps' draws equal bench/sampler_golden.json's."
        if steps
        else "same tokens: – (the golden draws are at V = 49,152 only)."
    )
    lines = [
        f"Sampler, one step (prepare + sample), V = {meta['vocab']:,}, median of "
        f"{meta['repeats']} repeats; {same}",
        "",
        "| " + " | ".join(head) + " | same tokens |",
        "|" + "---|" * (len(head) + 1),
    ]
    for label, _, _ in CONFIGS:
        cells = [label]
        same = True
        for b in batches:
            c = by.get((label, b))
            if c is None:
                cells += ["–"] * 2
                continue
            cells += [f"{c['ms']:.3f}", f"{c['per_row_ms']:.3f}"]
            same = None if c["same_tokens"] is None or same is None else same and c["same_tokens"]
        verdict = "–" if same is None else "yes" if same else "NO"
        lines.append("| " + " | ".join(cells) + f" | {verdict} |")
    return lines


def record(vocab: int = VOCAB) -> None:
    """Rewrite ``sampler_golden.json`` with the current sampler's draws (its
    first ``steps`` steps of every configuration and batch size)."""
    golden = json.loads(GOLDEN.read_text())
    gen = np.random.default_rng(0)
    draws = {}
    for b in BATCHES:
        steps = [lm_logits(gen, b, vocab) for _ in range(N_LOGITS)]
        for label, params, n_top in CONFIGS:
            rows = _rows(params, n_top, b, vocab)
            draws[golden_key(label, b)] = [
                _step(sampler.sample, rows, steps[rep % N_LOGITS])[1]
                for rep in range(golden["steps"])
            ]
    GOLDEN.write_text(json.dumps({"steps": golden["steps"], "draws": draws}, separators=(",", ":")))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary size (golden: 49152)")
    ap.add_argument(
        "--record",
        action="store_true",
        help="rewrite sampler_golden.json with the current sampler's draws (only when the "
        "draw itself changes)",
    )
    args = ap.parse_args(argv)
    if args.record:
        record()
        return 0
    result = measure(args.repeats, vocab=args.vocab)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or Path(__file__).parent / "results" / f"sampler-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(markdown(result)))
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
