"""``python -m bench.sampler_bench``: the sampler's cost per decode step.

    python -m bench.sampler_bench                  # table on stdout, JSON under bench/results/
    python -m bench.sampler_bench --repeats 50 --out /tmp/sampler.json

One step is ``prepare(rows)`` + ``sample(logits, args)`` as the engine calls
them, at V = 49,152 (the default model's vocabulary) for a batch of 1 and 8, on
peaked, language-model-like logits: Zipf-shaped probabilities over a random
token order with a per-step sharpness, plus noise. Each configuration runs the
current sampler and, interleaved in the same process, ``_before_issue14_sample``
(the sampler as it was before issue 14, kept here only as the baseline), on
the same logits with generators of the same seed; the table shows the median
of the repeats and whether both picked the same tokens (they must).

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


def _rows(params: SamplingParams, top_logprobs: int, batch: int) -> list[SamplingRow]:
    gen = np.random.default_rng(7)
    rows = []
    for i in range(batch):
        history = gen.integers(0, VOCAB, HISTORY).tolist()
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


def measure(repeats: int = 200, batches: Sequence[int] = BATCHES) -> dict[str, Any]:
    """Median per-step and per-row milliseconds, current sampler vs the
    baseline, for every configuration and batch size."""
    gen = np.random.default_rng(0)
    impls: dict[str, Sampler] = {"new": sampler.sample, "old": _before_issue14_sample}
    cases = []
    for b in batches:
        steps = [lm_logits(gen, b) for _ in range(N_LOGITS)]
        for label, params, n_top in CONFIGS:
            rows = {name: _rows(params, n_top, b) for name in impls}
            times: dict[str, list[float]] = {name: [] for name in impls}
            tokens: dict[str, list[list[int]]] = {name: [] for name in impls}
            for rep in range(repeats + 2):  # the first two warm up
                logits = steps[rep % N_LOGITS]
                order = list(impls) if rep % 2 else list(impls)[::-1]  # interleaved
                for name in order:
                    dt_s, picked = _step(impls[name], rows[name], logits)
                    if rep >= 2:
                        times[name].append(dt_s * 1e3)
                    tokens[name].append(picked)
            new_ms, old_ms = (statistics.median(times[n]) for n in ("new", "old"))
            cases.append(
                {
                    "config": label,
                    "batch": b,
                    "new_ms": new_ms,
                    "old_ms": old_ms,
                    "new_per_row_ms": new_ms / b,
                    "old_per_row_ms": old_ms / b,
                    "speedup": old_ms / new_ms if new_ms else float("nan"),
                    "same_tokens": tokens["new"] == tokens["old"],
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
            "vocab": VOCAB,
            "repeats": repeats,
            "history_tokens": HISTORY,
            "median_top_token_prob_at_t0.7": float(np.median(top)),
            "median_nucleus_0.9_tokens_at_t0.7": float(np.median(nucleus)),
            "load_avg": [round(x, 2) for x in os.getloadavg()],
            "numpy": np.__version__,
        },
        "cases": cases,
    }


def markdown(result: dict[str, Any]) -> list[str]:
    """The table: one line per configuration, both batch sizes."""
    meta = result["meta"]
    by = {(c["config"], c["batch"]): c for c in result["cases"]}
    batches = sorted({c["batch"] for c in result["cases"]})
    head = ["config"]
    for b in batches:
        head += [f"B={b} old ms", f"B={b} new ms", f"B={b} new ms/row"]
    lines = [
        f"Sampler, one step (prepare + sample), V = {meta['vocab']:,}, median of "
        f"{meta['repeats']} interleaved repeats; old = before issue 14.",
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
                cells += ["–"] * 3
                continue
            cells += [f"{c['old_ms']:.3f}", f"{c['new_ms']:.3f}", f"{c['new_per_row_ms']:.3f}"]
            same = same and c["same_tokens"]
        lines.append("| " + " | ".join(cells) + f" | {'yes' if same else 'NO'} |")
    return lines


# --- the sampler before issue 14 (baseline only) ------------------------------------


def _before_issue14_sample(logits: np.ndarray, args: SamplingArgs) -> SampleOutput:
    raw = np.asarray(logits, dtype=np.float32)
    b, v = raw.shape
    x = sampler.penalize(raw, args)
    tokens = np.empty(b, dtype=np.int64)
    greedy = args.temperature == 0
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        g = np.flatnonzero(greedy)
        if g.size:
            xg = x if g.size == b else x[g]
            tg = xg.argmax(axis=1)
            dead = ~np.isfinite(xg[np.arange(g.size), tg])
            if dead.any():
                tg[dead] = raw[g[dead]].argmax(axis=1)
            tokens[g] = tg
        s = np.flatnonzero(~greedy)
        if s.size:
            tokens[s] = _old_sample_rows(raw, x, s, args)
        logprobs, top_ids, top_lps = _old_logprobs(raw, tokens, args)
    return SampleOutput(tokens, logprobs, top_ids, top_lps)


_OLD_BLOCK = 256


def _old_sample_rows(raw: np.ndarray, x: np.ndarray, s: np.ndarray, args: SamplingArgs) -> Any:
    n, v = s.size, x.shape[1]
    xs = x[s]
    xs /= args.temperature[s, None]
    m = xs.max(axis=1)
    dead = ~np.isfinite(m)
    m[dead] = 0.0
    floor = np.full(n, -np.inf, dtype=np.float32)
    min_p = args.min_p[s]
    mp = min_p > 0
    if mp.any():
        floor[mp] = m[mp] + np.log(min_p[mp])
    k = args.top_k[s]
    kr = np.flatnonzero((k > 0) & (k < v))
    if kr.size:
        kmax = int(k[kr].max())
        top = np.partition(xs[kr], v - kmax, axis=1)[:, v - kmax :]
        top.sort(axis=1)
        floor[kr] = np.maximum(floor[kr], top[np.arange(kr.size), kmax - k[kr]])
    keep = xs >= floor[:, None] if np.isfinite(floor).any() else None
    e = xs
    e -= m[:, None]
    np.exp(e, out=e)
    if keep is not None:
        e *= keep
    starts = np.arange(0, v, _OLD_BLOCK)
    blocks = np.add.reduceat(e, starts, axis=1)
    cum = np.cumsum(blocks, axis=1, dtype=np.float64)
    pr = np.flatnonzero((args.top_p[s] < 1.0) & ~dead)
    if pr.size:
        ep = e if pr.size == n else e[pr]
        ep *= ep >= _old_nucleus_floor(ep, args.top_p[s[pr]] * cum[pr, -1])[:, None]
        if pr.size < n:
            e[pr] = ep
        blocks[pr] = np.add.reduceat(ep, starts, axis=1)
        cum[pr] = np.cumsum(blocks[pr], axis=1, dtype=np.float64)
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        u = args.rngs[s[i]].random()
        j = -1 if dead[i] else _old_draw(e[i], blocks[i], cum[i], u)
        out[i] = j if j >= 0 else raw[s[i]].argmax()
    return out


def _old_draw(row: np.ndarray, blocks: np.ndarray, cum: np.ndarray, u: float) -> int:
    if not cum[-1] > 0:
        return -1
    target = u * cum[-1]
    b = min(int(np.searchsorted(cum, target, side="right")), cum.size - 1)
    while blocks[b] <= 0:
        b -= 1
    lo = b * _OLD_BLOCK
    part = row[lo : lo + _OLD_BLOCK]
    inner = np.cumsum(part, dtype=np.float64)
    j = int(np.searchsorted(inner, target - (cum[b - 1] if b else 0.0), side="right"))
    if j >= part.size:
        j = int(np.flatnonzero(part)[-1])
    return lo + j


def _old_nucleus_floor(e: np.ndarray, target: np.ndarray) -> Any:
    p, v = e.shape
    c = min(v, 1024)
    head = np.partition(e, v - c, axis=1)[:, v - c :] if c < v else e.copy()
    head.sort(axis=1)
    head = head[:, ::-1]
    reached = np.cumsum(head, axis=1, dtype=np.float64) >= target[:, None]
    found = reached.any(axis=1)
    out = np.where(found, head[np.arange(p), reached.argmax(axis=1)], 0.0).astype(np.float32)
    if c < v:
        for i in np.flatnonzero(~found):
            full = np.sort(e[i])[::-1]
            hit = np.cumsum(full, dtype=np.float64) >= target[i]
            out[i] = full[hit.argmax()] if hit.any() else 0.0
    return out


def _old_logprobs(
    raw: np.ndarray, tokens: np.ndarray, args: SamplingArgs
) -> tuple[np.ndarray | None, list[np.ndarray], list[np.ndarray]]:
    b, v = raw.shape
    no_ids = np.zeros(0, dtype=np.int64)
    no_lps = np.zeros(0, dtype=np.float32)
    top_ids = [no_ids] * b
    top_lps = [no_lps] * b
    n_top = np.minimum(args.top_logprobs, v)
    lr = np.flatnonzero(args.want_logprobs | (n_top > 0))
    if not lr.size:
        return None, top_ids, top_lps
    r = raw if lr.size == b else raw[lr]  # [L, V]; read only
    m = r.max(axis=1)
    lse = m + np.log(np.exp(r - m[:, None]).sum(axis=1))  # [L]
    logprobs = np.zeros(b, dtype=np.float32)
    logprobs[lr] = r[np.arange(lr.size), tokens[lr]] - lse

    t = np.flatnonzero(n_top[lr] > 0)  # positions in lr
    if t.size:
        n = int(n_top[lr[t]].max())
        rt = r[t]  # [T, V]
        ids = np.argpartition(rt, v - n, axis=1)[:, v - n :] if n < v else np.argsort(rt, axis=1)
        vals = np.take_along_axis(rt, ids, axis=1)  # [T, n]
        # Where a tie straddles the cut, argpartition's pick is arbitrary:
        # take the lowest ids among the tied tokens instead.
        cut = vals.min(axis=1)
        for j in np.flatnonzero(np.count_nonzero(rt >= cut[:, None], axis=1) > n):
            cand = np.flatnonzero(rt[j] >= cut[j])  # ascending ids
            ids[j] = cand[np.lexsort((cand, -rt[j, cand]))[:n]]
            vals[j] = rt[j, ids[j]]
        order = np.lexsort((ids, -vals), axis=1)  # most likely first, ties by lowest id
        ids = np.take_along_axis(ids, order, axis=1)
        lps = (np.take_along_axis(vals, order, axis=1) - lse[t, None]).astype(np.float32)
        for k, pos in enumerate(t):
            row, want = int(lr[pos]), int(n_top[lr[pos]])
            top_ids[row] = ids[k, :want].astype(np.int64)
            top_lps[row] = lps[k, :want].copy()
    return logprobs, top_ids, top_lps


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    result = measure(args.repeats)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or Path(__file__).parent / "results" / f"sampler-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(markdown(result)))
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
