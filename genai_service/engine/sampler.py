"""Token selection for one decode step, vectorised over the batch.

``prepare(rows)`` turns each running sequence's parameters and history into
batched arrays; ``sample(logits, args)`` then applies, in order:

0. a structured-output mask (``SamplingRow.allowed``; every token it does
   not allow -> -inf),
1. banned ids (logit -> -inf; dropped for a masked row whose mask allows
   only banned tokens: the constraint wins, e.g. EOS before min_new_tokens),
2. repetition penalty over prompt + output tokens (HF/CTRL rule: a positive
   logit is divided by the penalty, a non-positive one multiplied),
3. frequency penalty (``f * count`` in the output) and presence penalty
   (``p`` once per token present in the output), both subtracted,
4. greedy rows: argmax (ties -> lowest id); other rows: temperature, min-p,
   top-k, top-p (on the distribution renormalised after min-p and top-k),
   then one draw from the renormalised distribution.

Reproducibility: every non-greedy row draws exactly one float from its own
generator per step, whatever happens; greedy rows draw nothing. Cut-offs are
decided by value (a tie at a cut-off keeps every tied token) and the kept
candidates are walked in token-id order, so a row's token depends only on its
own logits, parameters and generator, never on the other rows of the batch.

Logprobs are always those of the raw model distribution (log-softmax of the
unprocessed logits), whatever penalties or temperature were used to sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from genai_service.engine.request import SamplingParams

# Top-p first looks for the nucleus among this many most likely tokens (an
# O(V) partition); only rows whose nucleus is larger pay for a full sort.
NUCLEUS_CANDIDATES = 1024
# Tokens per block of the two-level inverse-CDF draw (about sqrt(vocab)).
_DRAW_BLOCK = 256


@dataclass
class SamplingRow:
    """One running sequence's inputs for this step."""

    params: SamplingParams  # None fields = disabled
    rng: np.random.Generator  # the request's own generator
    prompt_token_ids: Sequence[int]  # repetition penalty (with the output)
    output_token_ids: Sequence[int]  # frequency/presence (and repetition) penalties
    top_logprobs: int = 0  # how many raw-distribution alternatives to return
    banned_token_ids: Sequence[int] = ()  # forced to -inf (e.g. EOS before min_new_tokens)
    want_logprobs: bool = False  # return the chosen token's raw logprob
    allowed: np.ndarray | None = None  # [V] bool: the only tokens a constraint allows


@dataclass
class SparseEdit:
    """A sparse edit of the [B, V] logits: one value per (row, token) pair.

    Pairs may repeat only in edits applied by assignment with the same value
    for every copy (bans, repetition); additive edits hold unique pairs.
    """

    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # [N]
    cols: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # [N]
    values: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))  # [N]

    def __len__(self) -> int:
        return int(self.cols.size)

    @classmethod
    def build(cls, parts: list[tuple[int, np.ndarray, np.ndarray]]) -> SparseEdit:
        """From ``(row, unique token ids, values)`` triples."""
        if not parts:
            return cls()
        return cls(
            rows=np.concatenate([np.full(ids.size, r, dtype=np.int64) for r, ids, _ in parts]),
            cols=np.concatenate([ids for _, ids, _ in parts]).astype(np.int64, copy=False),
            values=np.concatenate([vals for _, _, vals in parts]).astype(np.float32, copy=False),
        )

    def within(self, vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The pairs whose token id is a valid column (tokenizer and model
        vocabularies can differ in size; a stray id must not wrap around)."""
        c = self.cols
        if c.size and (c.min() < 0 or c.max() >= vocab_size):
            ok = (c >= 0) & (c < vocab_size)
            return self.rows[ok], c[ok], self.values[ok]
        return self.rows, c, self.values


@dataclass
class SamplingArgs:
    """What ``prepare`` precomputes for one step, as batched arrays."""

    temperature: np.ndarray  # [B] float32; 0 marks a greedy row
    top_k: np.ndarray  # [B] int64; 0 = disabled
    top_p: np.ndarray  # [B] float64; 1.0 = disabled
    min_p: np.ndarray  # [B] float32; 0 = disabled
    rngs: list[np.random.Generator]  # [B]
    want_logprobs: np.ndarray  # [B] bool
    top_logprobs: np.ndarray  # [B] int64
    banned: SparseEdit = field(default_factory=SparseEdit)  # values unused
    repetition: SparseEdit = field(default_factory=SparseEdit)  # values: the penalty
    additive: SparseEdit = field(default_factory=SparseEdit)  # values: f * count + p
    allowed_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # [A]
    allowed: np.ndarray | None = None  # [A, V] bool, the masks of allowed_rows

    @property
    def batch_size(self) -> int:
        return len(self.rngs)


@dataclass
class SampleOutput:
    token_ids: np.ndarray  # [B] int64
    # [B] float32 raw log-prob of the chosen token; None when no row asked for
    # logprobs or alternatives (0.0 in rows that did not ask).
    logprobs: np.ndarray | None
    top_token_ids: list[np.ndarray]  # per row [top_logprobs] int64, most likely first
    top_logprobs: list[np.ndarray]  # per row [top_logprobs] float32


def _ids(tokens: Sequence[int]) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int64).reshape(-1)


def _unique_counts(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(ids, return_counts=True)``, several times faster on short arrays."""
    ids = np.sort(ids)
    first = np.flatnonzero(np.concatenate(([True], ids[1:] != ids[:-1])))
    return ids[first], np.diff(np.append(first, ids.size))


def prepare(rows: Sequence[SamplingRow]) -> SamplingArgs:
    """Batch the rows' parameters; ``None`` and neutral values disable a stage."""
    b = len(rows)
    temperature = np.zeros(b, dtype=np.float32)
    top_k = np.zeros(b, dtype=np.int64)
    top_p = np.ones(b, dtype=np.float64)
    min_p = np.zeros(b, dtype=np.float32)
    want = np.zeros(b, dtype=bool)
    n_top = np.zeros(b, dtype=np.int64)
    banned: list[tuple[int, np.ndarray, np.ndarray]] = []
    repetition: list[tuple[int, np.ndarray, np.ndarray]] = []
    additive: list[tuple[int, np.ndarray, np.ndarray]] = []
    masked: list[int] = []
    for i, row in enumerate(rows):
        p = row.params
        if not p.greedy:
            temperature[i] = p.temperature
        if p.top_k:
            top_k[i] = p.top_k
        if p.top_p is not None and p.top_p < 1.0:
            top_p[i] = p.top_p
        if p.min_p:
            min_p[i] = p.min_p
        want[i] = row.want_logprobs
        n_top[i] = max(row.top_logprobs, 0)
        if len(row.banned_token_ids):
            ids = _ids(row.banned_token_ids)
            banned.append((i, ids, np.zeros(ids.size, dtype=np.float32)))
        rep = p.repetition_penalty
        if rep is not None and rep != 1.0:
            # Duplicates are harmless here: every copy writes the same value.
            seen = np.concatenate([_ids(row.prompt_token_ids), _ids(row.output_token_ids)])
            repetition.append((i, seen, np.full(seen.size, rep, dtype=np.float32)))
        if row.allowed is not None:
            masked.append(i)
        freq = p.frequency_penalty or 0.0
        pres = p.presence_penalty or 0.0
        if (freq or pres) and len(row.output_token_ids):
            ids, counts = _unique_counts(_ids(row.output_token_ids))
            additive.append((i, ids, freq * counts + pres))
    return SamplingArgs(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        rngs=[row.rng for row in rows],
        want_logprobs=want,
        top_logprobs=n_top,
        banned=SparseEdit.build(banned),
        repetition=SparseEdit.build(repetition),
        additive=SparseEdit.build(additive),
        allowed_rows=np.asarray(masked, dtype=np.int64),
        allowed=np.stack([rows[i].allowed for i in masked]) if masked else None,  # type: ignore[misc]
    )


def penalize(logits: np.ndarray, args: SamplingArgs) -> np.ndarray:
    """Banned ids, repetition, frequency and presence penalties.

    Returns ``logits`` itself (unchanged) when no row needs any of them,
    otherwise a new [B, V] float32 array.
    """
    if not (len(args.banned) or len(args.repetition) or len(args.additive)) and (
        args.allowed is None
    ):
        return logits
    x = np.array(logits, dtype=np.float32)  # [B, V] copy: the caller's array stays intact
    v = x.shape[1]
    masked = args.allowed_rows
    if args.allowed is not None:
        allowed = args.allowed[:, :v]
        x[masked] = np.where(allowed, x[masked], -np.inf)
    if len(args.banned):
        r, c, _ = args.banned.within(v)
        x[r, c] = -np.inf
        if args.allowed is not None:
            # A mask that allows only banned tokens wins over the ban.
            dead = ~np.isfinite(x[masked]).any(axis=1)
            for j in np.flatnonzero(dead):
                x[masked[j]] = np.where(allowed[j], logits[masked[j]], -np.inf)
    if len(args.repetition):
        r, c, pen = args.repetition.within(v)
        cur = x[r, c]
        x[r, c] = np.where(cur > 0, cur / pen, cur * pen)
    if len(args.additive):
        r, c, sub = args.additive.within(v)
        x[r, c] -= sub
    return x


def sample(logits: np.ndarray, args: SamplingArgs) -> SampleOutput:
    """Pick one token per row from ``logits`` [B, V] (never modified)."""
    raw = np.asarray(logits, dtype=np.float32)  # [B, V]
    b, v = raw.shape
    if b != args.batch_size:
        raise ValueError(f"logits have {b} rows but the sampling args have {args.batch_size}")
    x = penalize(raw, args)
    tokens = np.empty(b, dtype=np.int64)
    greedy = args.temperature == 0
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        g = np.flatnonzero(greedy)
        if g.size:
            xg = x if g.size == b else x[g]  # [G, V]
            tg = xg.argmax(axis=1)
            dead = ~np.isfinite(xg[np.arange(g.size), tg])  # everything banned (or NaN/inf)
            if dead.any():
                tg[dead] = raw[g[dead]].argmax(axis=1)
            tokens[g] = tg
        s = np.flatnonzero(~greedy)
        if s.size:
            tokens[s] = _sample_rows(raw, x, s, args)
        logprobs, top_ids, top_lps = _logprobs(raw, tokens, args)
    return SampleOutput(tokens, logprobs, top_ids, top_lps)


def _sample_rows(raw: np.ndarray, x: np.ndarray, s: np.ndarray, args: SamplingArgs) -> np.ndarray:
    """Temperature, min-p, top-k, top-p and one draw for the non-greedy rows ``s``."""
    n, v = s.size, x.shape[1]
    xs = x[s]  # [S, V] copy
    xs /= args.temperature[s, None]
    m = xs.max(axis=1)  # [S]
    dead = ~np.isfinite(m)  # everything masked: fall back to the raw argmax
    m[dead] = 0.0

    # Lowest logit each row keeps. Min-p and top-k both keep "the highest
    # values", so they commute and combine into one floor.
    floor = np.full(n, -np.inf, dtype=np.float32)
    min_p = args.min_p[s]
    mp = min_p > 0
    if mp.any():
        # p_i < min_p * p_max  <=>  x_i < x_max + log(min_p)
        floor[mp] = m[mp] + np.log(min_p[mp])
    k = args.top_k[s]
    kr = np.flatnonzero((k > 0) & (k < v))
    if kr.size:
        kmax = int(k[kr].max())
        top = np.partition(xs[kr], v - kmax, axis=1)[:, v - kmax :]  # [K, kmax] largest, unsorted
        top.sort(axis=1)
        kth = top[np.arange(kr.size), kmax - k[kr]]  # k-th largest value per row
        floor[kr] = np.maximum(floor[kr], kth)
    # (Masks are applied by multiplying: boolean assignment is several times
    # slower on a vocabulary-sized row.)
    keep = xs >= floor[:, None] if np.isfinite(floor).any() else None  # [S, V]

    e = xs  # reuse the buffer: unnormalised probabilities exp(x - max), [S, V]
    e -= m[:, None]
    np.exp(e, out=e)
    if keep is not None:
        e *= keep

    # Mass per block of _DRAW_BLOCK tokens and its running total, [S, nb]:
    # the top-p target and the first level of the draw. (Every reduction here
    # is confined to one row, so a row's result never depends on the batch.)
    starts = np.arange(0, v, _DRAW_BLOCK)
    blocks = np.add.reduceat(e, starts, axis=1)  # float32
    cum = np.cumsum(blocks, axis=1, dtype=np.float64)

    # Top-p on the distribution renormalised after min-p and top-k.
    pr = np.flatnonzero((args.top_p[s] < 1.0) & ~dead)
    if pr.size:
        ep = e if pr.size == n else e[pr]  # [P, V]
        ep *= ep >= _nucleus_floor(ep, args.top_p[s[pr]] * cum[pr, -1])[:, None]
        if pr.size < n:
            e[pr] = ep
        blocks[pr] = np.add.reduceat(ep, starts, axis=1)
        cum[pr] = np.cumsum(blocks[pr], axis=1, dtype=np.float64)

    # Inverse CDF in token-id order with one uniform per row, in two levels
    # (block, then token within it) to avoid a cumsum over the vocabulary.
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        u = args.rngs[s[i]].random()  # exactly one draw per non-greedy row per step
        j = -1 if dead[i] else _draw(e[i], blocks[i], cum[i], u)
        # j < 0: nothing left to draw from (all banned, min_p > 1, ...)
        out[i] = j if j >= 0 else raw[s[i]].argmax()
    return out


def _draw(row: np.ndarray, blocks: np.ndarray, cum: np.ndarray, u: float) -> int:
    """The token where the running mass of ``row`` [V] (unnormalised, token-id
    order) first exceeds ``u`` times its total; -1 if the row has no mass.
    ``blocks`` [nb] are its per-block masses and ``cum`` [nb] their running sum."""
    if not cum[-1] > 0:
        return -1
    target = u * cum[-1]
    b = min(int(np.searchsorted(cum, target, side="right")), cum.size - 1)
    while blocks[b] <= 0:  # rounding at the very top: step back to mass
        b -= 1
    lo = b * _DRAW_BLOCK
    part = row[lo : lo + _DRAW_BLOCK]
    inner = np.cumsum(part, dtype=np.float64)
    j = int(np.searchsorted(inner, target - (cum[b - 1] if b else 0.0), side="right"))
    if j >= part.size:  # rounding: the block's last token with mass
        j = int(np.flatnonzero(part)[-1])
    return lo + j


def _nucleus_floor(e: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Per row of ``e`` [P, V] (unnormalised probabilities), the probability of
    the last token of the smallest most-likely-first set whose mass reaches
    ``target`` [P] (top_p times the row's mass); ties at that value are all
    kept by the caller. 0 (keep everything) where rounding makes it unreachable."""
    p, v = e.shape
    c = min(v, NUCLEUS_CANDIDATES)
    head = np.partition(e, v - c, axis=1)[:, v - c :] if c < v else e.copy()  # [P, c]
    head.sort(axis=1)
    head = head[:, ::-1]  # descending
    reached = np.cumsum(head, axis=1, dtype=np.float64) >= target[:, None]
    found = reached.any(axis=1)
    out = np.where(found, head[np.arange(p), reached.argmax(axis=1)], 0.0).astype(np.float32)
    if c < v:
        for i in np.flatnonzero(~found):  # nucleus wider than the candidates: full sort
            full = np.sort(e[i])[::-1]
            hit = np.cumsum(full, dtype=np.float64) >= target[i]
            out[i] = full[hit.argmax()] if hit.any() else 0.0
    return out


def _logprobs(
    raw: np.ndarray, tokens: np.ndarray, args: SamplingArgs
) -> tuple[np.ndarray | None, list[np.ndarray], list[np.ndarray]]:
    """Chosen-token logprobs and top alternatives under log_softmax(raw)."""
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
