"""The sampler's row-wise numpy kernels (``sampler.py`` is the pipeline that
uses them): a lower bound on each row's k-th largest value from strided group
maxima, the kept candidates of cut-off rows as flat lists, their block sums for
the two-level draw, and the top-p nucleus search. Every reduction stays within
one row, so a row's result never depends on the rest of the batch."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# A top-k row's k-th largest logit is bounded from below by the maxima of this
# many strided groups of its tokens (at least 4 k groups).
KTH_GROUPS = 1024
# Tokens per block of the two-level draw (a race between blocks, then one within the winner).
DRAW_BLOCK = 256
NO_IDS = np.zeros(0, dtype=np.int64)
NO_VALS = np.zeros(0, dtype=np.float32)


def candidates(
    xs: np.ndarray,
    t: np.ndarray,
    m: np.ndarray,
    floor: np.ndarray,
    cut: np.ndarray,
    kr: np.ndarray,
    survivors: tuple[np.ndarray, np.ndarray, np.ndarray] | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kept tokens of the rows ``cut`` (those with a finite ``floor``) as
    (row, token, exp(xs / t - m)) lists in row-then-token order: the same
    float32 operations per token as on a dense row."""
    parts = []
    if survivors is not None:
        on = cut[survivors[0]]
        parts.append((survivors[0][on], survivors[1][on], survivors[2][on]))
    plain = cut.copy()
    plain[kr] = False
    mo = np.flatnonzero(plain)  # min-p without top-k
    if mo.size:
        xm = take_rows(xs, mo)
        rr, cc = true_pairs(xm >= float32_below(floor[mo].astype(np.float64) * t[mo])[:, None])
        parts.append((mo[rr], cc, xm[rr, cc]))
    rows, cols, x = concat_rows(parts)
    xt = x / t[rows]
    on = xt >= floor[rows]
    rows, cols = rows[on], cols[on]
    e = np.exp(xt[on] - m[rows])  # [N] unnormalised probabilities exp(x - max)
    on = e > 0  # (an underflow adds nothing anywhere)
    return rows[on], cols[on], e[on]


# Float32 elements that several O(V) passes in a row still find in cache
# (1 MiB): larger work goes through its passes a row, or a block of rows, at a
# time. Measured at [8, 262144], ms per row, all rows at once / a row at a
# time: dense masses 0.31 / 0.24, log-sum-exp 0.29 / 0.23 (2-core Xeon, 2 MiB
# of L2 per core, 2026-12-06).
CACHE_ELEMENTS = 1 << 18
# Rows of exp(x - max) the log-sum-exp holds at once (a reused buffer: a fresh
# [8, 262144] one costs ~2,000 page faults per step).
LSE_BLOCK_ELEMENTS = CACHE_ELEMENTS
_lse_buffer = np.empty(0, dtype=np.float32)


def row_logsumexp(r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's maximum and log-sum-exp of ``r`` [N, V] float32 (the
    log-softmax's normaliser), a block of rows at a time in one reused buffer;
    every row's sums are the same whatever N. Not re-entrant (the buffer is
    the module's): the sampler runs on the engine thread only."""
    global _lse_buffer
    n, v = r.shape
    m = r.max(axis=1)
    sums = np.empty(n, dtype=np.float32)
    per = max(1, LSE_BLOCK_ELEMENTS // max(v, 1))
    if _lse_buffer.size < min(n, per) * v:
        _lse_buffer = np.empty(min(n, per) * v, dtype=np.float32)
    for lo in range(0, n, per):
        hi = min(n, lo + per)
        e = _lse_buffer[: (hi - lo) * v].reshape(hi - lo, v)
        np.subtract(r[lo:hi], m[lo:hi, None], out=e)
        np.exp(e, out=e)
        e.sum(axis=1, out=sums[lo:hi])
    return m, m + np.log(sums)


def take_rows(a: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``a[idx]``, or ``a`` itself (no copy) when ``idx`` is every row in order."""
    return a if idx.size == a.shape[0] else a[idx]


def true_pairs(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.nonzero`` of a [R, V] mask (row-then-column order), several times
    faster: one flat scan instead of a multi-index walk."""
    flat = np.flatnonzero(mask)
    return np.divmod(flat, mask.shape[1])


def float32_below(bound: np.ndarray) -> np.ndarray:
    """A float32 lower bound on every x whose ``x / t`` rounds to at least
    ``bound / t`` (given ``bound`` in x units): a relative margin far wider
    than float32 rounding, so a pre-filter at it never drops a token."""
    lo = (bound - (np.abs(bound) * 1e-5 + 1e-30)).astype(np.float32)
    return np.nextafter(lo, np.float32(-np.inf))


def concat_rows(
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Join (row, token, value) lists of disjoint rows, each in row-then-token
    order, into one list in that order."""
    if not parts:
        return NO_IDS, NO_IDS, NO_VALS
    if len(parts) == 1:
        return parts[0]
    r, c, val = (np.concatenate(p) for p in zip(*parts, strict=True))
    order = np.argsort(r, kind="stable")
    return r[order], c[order], val[order]


def kth_largest(
    x: np.ndarray, k: np.ndarray, heads: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per row of ``x`` [K, V] its ``k``-th largest value [K], and the
    ``top_survivors`` it was ranked among (a superset of the tokens a cut at
    it keeps, ties and rounding included); ``heads``: ``group_heads(x, k)``
    if the caller has it."""
    rr, cc, vals = top_survivors(x, k, heads)
    counts = np.bincount(rr, minlength=x.shape[0])
    kth = sorted_desc(rr, vals)[1][np.cumsum(counts) - counts + k - 1]
    return kth, rr, cc, vals


def group_heads(x: np.ndarray, k: np.ndarray) -> np.ndarray:
    """The maxima of ``x`` [K, V]'s strided groups that ``top_survivors``
    bounds the ``k``-th largest with (``x`` itself when V is too short to
    group); a row's maximum is exactly the maximum of its heads."""
    kk, v = x.shape
    cols = max(KTH_GROUPS, 4 * int(k.max()))
    per = v // cols
    if per < 2:
        return x
    heads = x[:, : per * cols].reshape(kk, per, cols).max(axis=1)  # [K, cols]
    if per * cols < v:
        heads = np.concatenate([heads, x[:, per * cols :]], axis=1)
    return heads


def top_survivors(
    x: np.ndarray, k: np.ndarray, heads: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every entry (row, token, value; row-then-token order) of ``x`` [K, V]
    at or above a lower bound of its row's ``k``-th largest value, less a
    margin wider than the rounding of a division by the temperature.

    Any k entries of a row bound its k-th largest from below; the maxima of
    ``KTH_GROUPS`` strided groups are a cheap such set that is nearly the
    top one, so one compare leaves few survivors to rank. ``heads``:
    ``group_heads(x, k)`` if the caller has it."""
    kk = x.shape[0]
    kmax = int(k.max())
    if heads is None:
        heads = group_heads(x, k)
    h = heads.shape[1]
    top = np.partition(heads, h - kmax, axis=1)[:, h - kmax :]  # [K, kmax] largest, unsorted
    top.sort(axis=1)
    bound = top[np.arange(kk), kmax - k]
    mask = x >= float32_below(bound.astype(np.float64))[:, None]  # [K, V]
    rr, cc = true_pairs(mask)
    # Counted from the pairs: ``np.count_nonzero(mask, axis=1)`` sums the
    # [K, V] mask as integers, ~3x the cost of the scan itself.
    short = np.bincount(rr, minlength=kk) < k  # NaN or inf in the row (raw logits only)
    if short.any():
        mask[short] = True
        rr, cc = true_pairs(mask)
    return rr, cc, x[rr, cc]


def sorted_desc(rows: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, vals)`` (float32, no NaN) sorted by row, then value largest
    first. Long lists sort int64 keys (row, order-preserving bits of the
    value) once: ``np.lexsort`` is fine on a few hundred entries but an order
    of magnitude slower on tens of thousands."""
    if rows.size <= 1024:
        order = np.lexsort((-vals, rows))
        return rows[order], vals[order]
    bits = vals.view(np.uint32).astype(np.int64)
    up = np.where(bits >= 2**31, 2**32 - 1 - bits, bits + 2**31)  # ascending with the value
    key = np.sort((rows.astype(np.int64) << 32) | (2**32 - 1 - up))
    up = 2**32 - 1 - (key & (2**32 - 1))
    bits = np.where(up >= 2**31, up - 2**31, 2**32 - 1 - up)
    return key >> 32, bits.astype(np.uint32).view(np.float32)


def set_block_sums(
    blocks: np.ndarray, rows: np.ndarray, cols: np.ndarray, e: np.ndarray, v: int
) -> None:
    """``blocks[r, j]`` = the mass of block j of row r's candidates (row-then-
    token order), summed exactly as ``np.add.reduceat`` sums the dense row."""
    if not rows.size:
        return
    nb = blocks.shape[1]
    first, mass, _ = block_masses(rows * nb + cols // DRAW_BLOCK, cols, e, v, nb)
    blocks.reshape(-1)[first] = mass


def block_masses(
    key: np.ndarray, cols: np.ndarray, e: np.ndarray, v: int, nb: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The blocks that candidates touch and their masses: ``key`` is each
    candidate's ``row * nb + cols // DRAW_BLOCK`` (non-decreasing: row-then-
    token order). Returns the distinct keys, each block's mass summed exactly
    as ``np.add.reduceat`` sums the dense row's block (its candidates laid out
    whole among zeros, a row's last block short), and the index of each
    block's first candidate."""
    new = np.empty(key.size, dtype=bool)
    new[:1] = True
    np.not_equal(key[1:], key[:-1], out=new[1:])
    starts = np.flatnonzero(new)
    if starts.size == key.size:  # one candidate per block: its mass is the block's
        return key, e, starts
    seg = np.cumsum(new) - 1  # segment of each candidate
    first = key[starts]
    size = np.minimum(DRAW_BLOCK, v - (first % nb) * DRAW_BLOCK)  # the last block is short
    start = np.cumsum(size) - size
    buf = np.zeros(int(size.sum()), dtype=np.float32)
    buf[start[seg] + cols % DRAW_BLOCK] = e
    return first, np.add.reduceat(buf, start), starts


def nucleus(
    rows: np.ndarray, e: np.ndarray, target: np.ndarray, n: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per row (of ``n``) of the lists ``rows``/``e`` (unnormalised
    probabilities), the value of the last token of the smallest most-likely-
    first set whose mass reaches ``target`` [n]; ties at that value are all
    kept by the caller. Also whether it was reached: 0 where not (rounding, or
    a row without entries), which keeps everything."""
    out = np.zeros(n, dtype=np.float32)
    found = np.zeros(n, dtype=bool)
    if not rows.size:
        return out, found
    r, val = sorted_desc(rows, e)
    counts = np.bincount(r, minlength=n)
    have = np.flatnonzero(counts)
    slot = np.cumsum(counts > 0) - 1  # row -> its line of ``head``
    starts = np.cumsum(counts) - counts
    head = np.zeros((have.size, int(counts.max())), dtype=np.float32)  # zero padded
    head[slot[r], np.arange(r.size) - starts[r]] = val
    reached = np.cumsum(head, axis=1, dtype=np.float64) >= target[have, None]
    hit = reached.any(axis=1)
    found[have] = hit
    out[have[hit]] = head[hit, reached[hit].argmax(axis=1)]
    return out, found


# The thresholds (fractions of the top probability) that ``dense_nucleus``
# looks for a nucleus above, in turn, before its bound alone; the sampler's
# one-row form takes the first two from one compare.
NUCLEUS_LEVELS = (2.0**-7, 2.0**-14, 2.0**-17)


def dense_nucleus(
    e: np.ndarray, rows: np.ndarray, mass: np.ndarray, top_p: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Top-p of whole-vocabulary rows ``e`` [P, V] (unnormalised probabilities,
    at most 1, of total ``mass`` [P], sampler rows ``rows``): their kept tokens
    as (row, token, value) lists.

    The nucleus is ranked among the tokens above a threshold, lowered until it
    holds the nucleus: first fractions of the top probability, never below
    (1 - top_p) * mass / V (the tokens below that hold less than 1 - top_p of
    the mass together), then that bound itself, then, where rounding still
    defeats it, the whole row. A lower threshold only adds tokens below the
    nucleus, so the level that finds it does not change what is kept; the
    2^-17 step spares flat rows (nuclei of 10^4 tokens at V = 262,144) a sort
    of every token above the bound (0.37 -> 0.28 ms per row, bench logits)."""
    p, v = e.shape
    target = top_p * mass
    floor = np.zeros(p, dtype=np.float32)
    left = np.arange(p)  # rows whose nucleus is not found yet
    parts = []
    for level in (*NUCLEUS_LEVELS, None):
        thr = ((1.0 - top_p[left]) * mass[left] / v).astype(np.float32)
        if level is not None:
            np.maximum(thr, np.float32(level), out=thr)
        sub = take_rows(e, left)
        rr, cc = true_pairs(sub >= thr[:, None])
        vals = sub[rr, cc]
        f, found = nucleus(rr, vals, target[left], left.size)
        on = found[rr] & (vals >= f[rr])
        parts.append((rows[left[rr[on]]], cc[on], vals[on]))
        floor[left] = f
        left = left[~found]
        if not left.size:
            break
    for i in left:  # the bound fell short: a full sort decides
        full = np.sort(e[i])[::-1]
        hit = np.cumsum(full, dtype=np.float64) >= target[i]
        last = full[hit.argmax()] if hit.any() else np.float32(0.0)
        ids = np.flatnonzero((e[i] >= last) & (e[i] > 0))
        parts.append((np.full(ids.size, rows[i]), ids, e[i, ids]))
    return concat_rows(parts)


# DRY penalties past this are the same ban in practice (logits are tens at most),
# so a match is only followed that far: the cost per step stays bounded however
# long the repetition.
DRY_MAX_PENALTY = 1e6


def dry_penalties(
    context: np.ndarray,
    breakers: np.ndarray,
    *,
    multiplier: float,
    base: float,
    allowed_length: int,
    last_n: int,
) -> tuple[np.ndarray, np.ndarray]:
    """DRY ("don't repeat yourself", as in text-generation-webui and llama.cpp):
    the tokens whose choice now would continue a sequence that already occurred
    in ``context`` (its last ``last_n`` tokens; 0: all), with their penalties.

    For each earlier occurrence of the last token, the match length n is how
    many tokens before it (the last token included) equal the tokens before
    the end of the context, stopping at a sequence breaker (``breakers`` [V]
    bool); the token that followed that occurrence gets ``multiplier *
    base ** (n - allowed_length)`` when n >= allowed_length (its longest
    match counts), capped at ``DRY_MAX_PENALTY``. Vectorised over the
    occurrences; one pass per matched length."""
    ctx = context[-last_n:] if last_n else context
    n = ctx.size
    v = breakers.shape[0]
    if n < 2 or not 0 <= ctx[-1] < v or breakers[ctx[-1]]:
        return NO_IDS, NO_VALS
    ctx = np.clip(ctx, 0, v - 1)  # (ids past the vocabulary: never breakers, never matched)
    idx = np.flatnonzero(ctx[:-1] == ctx[-1])
    if not idx.size:
        return NO_IDS, NO_VALS
    follow = ctx[idx + 1]
    ok = ~breakers[follow]
    idx, follow = idx[ok], follow[ok]
    if not idx.size:
        return NO_IDS, NO_VALS
    # Longest length worth measuring: past it the penalty is capped anyway.
    extra = 0
    if base > 1.0:
        extra = max(int(np.ceil(np.log(DRY_MAX_PENALTY / multiplier) / np.log(base))), 0)
    longest = allowed_length + extra
    length = np.ones(idx.size, dtype=np.int64)
    live = np.arange(idx.size)
    k = 1
    while live.size and k < longest and k < n - 1:
        j = idx[live] - k
        on = j >= 0
        live, j = live[on], j[on]
        tok = ctx[j]
        on = (tok == ctx[n - 1 - k]) & ~breakers[tok]
        live = live[on]
        length[live] += 1
        k += 1
    hit = length >= allowed_length
    if not hit.any():
        return NO_IDS, NO_VALS
    follow, length = follow[hit], length[hit]
    order = np.lexsort((-length, follow))  # by token, longest match first
    follow, length = follow[order], length[order]
    first = np.concatenate(([True], follow[1:] != follow[:-1]))
    ids, length = follow[first], length[first]
    pen = np.minimum(
        multiplier * np.power(float(base), (length - allowed_length).astype(np.float64)),
        DRY_MAX_PENALTY,
    )
    return ids.astype(np.int64), pen.astype(np.float32)


def bad_word_bans(context: np.ndarray, words: Sequence[tuple[int, ...]]) -> list[int]:
    """The last token of each bad word whose other tokens end ``context`` (a
    one-token word: always), as vLLM's ``bad_words`` does."""
    out = []
    n = context.size
    for word in words:
        head = len(word) - 1
        if head == 0 or (
            head <= n and np.array_equal(context[n - head :], np.asarray(word[:-1], dtype=np.int64))
        ):
            out.append(int(word[-1]))
    return out
