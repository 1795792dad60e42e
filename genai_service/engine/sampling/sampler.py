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
4. greedy rows: argmax (ties -> lowest id); other rows: temperature,
   top-k, top-p (on the distribution renormalised after top-k), min-p (of
   what top-p kept; with no top-p it joins top-k's floor: the same result),
   the stages after them (docs/design.md, "Sampling"), then one draw from
   the renormalised distribution (a race between blocks of 256 tokens, then
   between the winning block's tokens: ``_race``); a row left with nothing
   to pick from takes ``fallback_tokens`` (the raw argmax, or a masked row's
   lowest allowed id).

Reproducibility: every non-greedy row draws the same numbers from its own
generator per step, whatever happens (``_draws``: one exponential variate per
block of 256 tokens and one per place in a block, in one call); greedy rows
draw nothing. Cut-offs are decided by value (a tie at a cut-off keeps every
tied token) and a race's tie goes to the lowest block or id, so a row's token
depends only on its own logits, parameters and generator, never on the other
rows of the batch.

Logprobs are always those of the raw model distribution (log-softmax of the
unprocessed logits), whatever penalties or temperature were used to sample.

Cost: a row with a cut-off (top-k, min-p) is reduced to its few kept tokens by
a couple of compares over the vocabulary and handled as a list from then on;
only rows that nothing truncates exponentiate the whole vocabulary, and at a
large vocabulary a temperature-only row races only the blocks that can win
(``_sample_bounded_row``: bounds from each block's largest logit). The
per-token arithmetic is the dense one (same float32 operations, block masses
summed over the same blocks), so both forms draw the same tokens;
``tests/unit/test_sampler_golden.py`` holds the draws fixed. At batch 1-2,
where a batched step is mostly numpy call overhead, sampled rows take
``_sample_one_row``, the same arithmetic one row at a time; so do rows that
nothing cuts at any batch, and every sampled row at a large vocabulary
(``ROW_PATH_MIN_VOCAB``), whose passes over a row then find it in cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from genai_service.contract.request import (
    DRY_DEFAULT_ALLOWED_LENGTH,
    DRY_DEFAULT_BASE,
    MIROSTAT_DEFAULT_ETA,
    MIROSTAT_DEFAULT_TAU,
    XTC_DEFAULT_THRESHOLD,
    SamplingParams,
)

from . import sampler_kernels as kernels
from .sampler_kernels import DRAW_BLOCK, NO_IDS, NO_VALS

# Up to this many sampled rows a step takes them one by one
# (``_sample_one_row``); more go through the batched path, but for the rows
# that ``ROW_PATH_MIN_VOCAB``'s rule sends one by one.
# Measured (temperature + top-p + top-k + repetition, V = 49,152, ms per step,
# one by one / batched): B=1 0.35 / 0.55, B=2 0.61 / 0.65, B=3 0.88 / 0.77.
ROW_PATH_MAX_ROWS = 2
# Rows that nothing cuts (temperature only, or top-p alone) take the row path
# at any batch size, and from this vocabulary up every sampled row does: a
# row's O(V) passes then run back to back while it is in cache, and its
# dozens of numpy calls are a small part of its cost. Measured (ms per row at
# B=8, batched / one by one, same draws; 2-core Xeon, 2026-12-06): V =
# 49,152 temperature 0.085 / 0.067, top-p 0.176 / 0.142, but top-k 0.077 /
# 0.087; V = 262,144 temperature 0.384 / 0.317, top-p 0.657 / 0.470, top-k
# 0.278 / 0.259.
ROW_PATH_MIN_VOCAB = 1 << 17
# From this vocabulary up, a row that nothing cuts (temperature only) races
# only the blocks that can win (``_sample_bounded_row``) instead of
# exponentiating every token: same tokens. Measured (ms per row at B=8,
# whole row / bounded, bench logits; 2-core Xeon, 2026-12-07): V = 262,144
# 0.343 / 0.217, V = 49,152 0.078 / 0.085 (the row is in cache there, and the
# blocks' maxima cost what the exponentials save).
BOUNDED_RACE_MIN_VOCAB = 1 << 17


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
    dry_breakers: np.ndarray | None = None  # [V] bool: DRY's sequence-breaker tokens
    bad_words: Sequence[tuple[int, ...]] = ()  # tokenized ``params.bad_words``
    mirostat: MirostatState | None = None  # the sequence's Mirostat state (updated in place)


@dataclass
class MirostatState:
    """Mirostat v2's per-sequence ``mu`` (starts at 2 tau; kept across steps and
    session turns): the largest surprise, in bits, a token may have."""

    mu: float


@dataclass(frozen=True)
class Extended:
    """A sampled row's stages after top-p (``SamplingParams.extended``)."""

    typical_p: float  # 1.0: off
    top_a: float  # 0.0: off
    xtc_threshold: float
    xtc_probability: float  # 0.0: off
    mirostat: MirostatState | None
    mirostat_tau: float
    mirostat_eta: float


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
        """From ``(row, unique token ids, values)`` triples (no triples: one
        shared empty edit; edits are never modified)."""
        if not parts:
            return NO_EDIT
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


NO_EDIT = SparseEdit()


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
    only: SparseEdit = field(default_factory=SparseEdit)  # allowed_token_ids; values unused
    bias: SparseEdit = field(default_factory=SparseEdit)  # values: logit_bias, added
    extended: list[Extended | None] = field(default_factory=list)  # [B] or empty: none

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
    only: list[tuple[int, np.ndarray, np.ndarray]] = []
    bias: list[tuple[int, np.ndarray, np.ndarray]] = []
    masked: list[int] = []
    extended: list[Extended | None] = []
    for i, row in enumerate(rows):
        p = row.params
        if p.changes_logits or p.extended or row.bad_words:
            _prepare_controls(i, row, banned, additive, only, bias)
            if not extended and p.extended and not p.greedy:
                extended = [None] * b
            if extended and p.extended and not p.greedy:
                extended[i] = _extended(row)
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
            if p.repetition_penalty_last_n:
                seen = seen[-p.repetition_penalty_last_n :]
            repetition.append((i, seen, np.full(seen.size, rep, dtype=np.float32)))
        if row.allowed is not None:
            masked.append(i)
        freq = p.frequency_penalty or 0.0
        pres = p.presence_penalty or 0.0
        if (freq or pres) and len(row.output_token_ids):
            ids, counts = _unique_counts(_ids(row.output_token_ids))
            if additive and additive[-1][0] == i:  # DRY's, from _prepare_controls
                additive[-1] = _summed(additive[-1], (i, ids, freq * counts + pres))
            else:
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
        only=SparseEdit.build(only),
        bias=SparseEdit.build(bias),
        extended=extended,
    )


def _prepare_controls(
    i: int,
    row: SamplingRow,
    banned: list[tuple[int, np.ndarray, np.ndarray]],
    additive: list[tuple[int, np.ndarray, np.ndarray]],
    only: list[tuple[int, np.ndarray, np.ndarray]],
    bias: list[tuple[int, np.ndarray, np.ndarray]],
) -> None:
    """Row ``i``'s DRY penalties, logit_bias, banned and allowed ids and bad-word
    bans, into the step's sparse edits (``prepare`` adds the classic ones)."""
    p = row.params
    context: np.ndarray | None = None
    if p.dry_multiplier and row.dry_breakers is not None:
        context = np.concatenate([_ids(row.prompt_token_ids), _ids(row.output_token_ids)])
        ids, pen = kernels.dry_penalties(
            context,
            row.dry_breakers,
            multiplier=p.dry_multiplier,
            base=DRY_DEFAULT_BASE if p.dry_base is None else p.dry_base,
            allowed_length=(
                DRY_DEFAULT_ALLOWED_LENGTH if p.dry_allowed_length is None else p.dry_allowed_length
            ),
            last_n=p.dry_penalty_last_n or 0,
        )
        if ids.size:
            additive.append((i, ids, pen))
    ban = list(p.banned_token_ids)
    if row.bad_words:
        if context is None:
            context = np.concatenate([_ids(row.prompt_token_ids), _ids(row.output_token_ids)])
        ban += kernels.bad_word_bans(context, row.bad_words)
    if ban:  # (min_new_tokens' bans of the row may repeat some: assignments, harmless)
        ids = np.unique(_ids(ban))
        banned.append((i, ids, np.zeros(ids.size, dtype=np.float32)))
    if p.allowed_token_ids:
        ids = np.unique(_ids(p.allowed_token_ids))
        only.append((i, ids, np.zeros(ids.size, dtype=np.float32)))
    if p.logit_bias:
        ids = _ids([t for t, _ in p.logit_bias])
        bias.append((i, ids, np.asarray([v for _, v in p.logit_bias], dtype=np.float32)))


def _summed(
    a: tuple[int, np.ndarray, np.ndarray], b: tuple[int, np.ndarray, np.ndarray]
) -> tuple[int, np.ndarray, np.ndarray]:
    """One row's two additive edits as one with unique ids (values summed)."""
    ids = np.concatenate([a[1], b[1]])
    uniq, inv = np.unique(ids, return_inverse=True)
    return a[0], uniq, np.bincount(inv, weights=np.concatenate([a[2], b[2]]))


def _extended(row: SamplingRow) -> Extended:
    p = row.params
    state = None
    if p.mirostat:
        state = row.mirostat or MirostatState(2.0 * (p.mirostat_tau or MIROSTAT_DEFAULT_TAU))
    return Extended(
        typical_p=1.0 if p.typical_p is None else p.typical_p,
        top_a=p.top_a or 0.0,
        xtc_threshold=XTC_DEFAULT_THRESHOLD if p.xtc_threshold is None else p.xtc_threshold,
        xtc_probability=p.xtc_probability or 0.0,
        mirostat=state,
        mirostat_tau=MIROSTAT_DEFAULT_TAU if p.mirostat_tau is None else p.mirostat_tau,
        mirostat_eta=MIROSTAT_DEFAULT_ETA if p.mirostat_eta is None else p.mirostat_eta,
    )


def penalize(logits: np.ndarray, args: SamplingArgs) -> np.ndarray:
    """Banned ids, repetition, frequency and presence penalties.

    Returns ``logits`` itself (unchanged) when no row needs any of them,
    otherwise a new [B, V] float32 array.
    """
    if not (
        len(args.banned)
        or len(args.repetition)
        or len(args.additive)
        or len(args.only)
        or len(args.bias)
    ) and (args.allowed is None):
        return logits
    x = np.array(logits, dtype=np.float32)  # [B, V] copy: the caller's array stays intact
    v = x.shape[1]
    masked = args.allowed_rows
    if len(args.only):
        # allowed_token_ids: every other token -> -inf (with a constraint's mask: both)
        r, c, _ = args.only.within(v)
        rows = np.unique(args.only.rows)
        keep = np.zeros((rows.size, v), dtype=bool)
        keep[np.searchsorted(rows, r), c] = True
        x[rows] = np.where(keep, x[rows], -np.inf)
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
    if len(args.bias):
        r, c, add = args.bias.within(v)
        x[r, c] += add
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
                tg[dead] = fallback_tokens(raw, g[dead], args)
            tokens[g] = tg
        s = np.flatnonzero(~greedy)
        if args.extended and s.size:
            ext = np.asarray([args.extended[i] is not None for i in s], dtype=bool)
            for i in s[ext]:
                tokens[i] = _sample_extended_row(raw, x, int(i), args)
            s = s[~ext]
        if s.size:
            one, rest = s, NO_IDS
            if s.size > ROW_PATH_MAX_ROWS and v < ROW_PATH_MIN_VOCAB:
                k = args.top_k[s]
                cut = ((k > 0) & (k < v)) | ((args.min_p[s] > 0) & (args.top_p[s] >= 1.0))
                one, rest = s[~cut], s[cut]  # rows that nothing cuts: one by one at any batch
            if one.size:
                picked = [_sample_one_row(raw, x, int(i), args) for i in one]
                for i, token in zip(one, picked, strict=True):
                    if token is not None:
                        tokens[i] = token
                declined = one[[token is None for token in picked]]
                if declined.size:
                    rest = np.sort(np.concatenate([rest, declined]))
            if rest.size:
                tokens[rest] = _sample_rows(raw, x, rest, args)
        logprobs, top_ids, top_lps = _logprobs(raw, tokens, args)
    return SampleOutput(tokens, logprobs, top_ids, top_lps)


def constant_args(row: SamplingRow) -> SamplingArgs | None:
    """``prepare([row])`` when it is the same at every step of the row's
    sequence, so it can be built once and drawn from with ``sample_constant``;
    None otherwise. Decided from what the row asks for, not from what this
    step's ``prepare`` built: a frequency, presence or DRY penalty, or a bad
    word's ban, is empty until the tokens so far give it something to act on."""
    p = row.params
    if (
        p.greedy
        or p.penalizes
        or p.changes_logits  # DRY, logit_bias, bans, allowed ids, bad words
        or p.extended
        or row.bad_words
        or row.banned_token_ids
        or row.allowed is not None
        or row.want_logprobs
        or row.top_logprobs
    ):
        return None
    return prepare([row])


def sample_constant(logits: np.ndarray, args: SamplingArgs) -> int:
    """``sample(logits[None], args).token_ids[0]`` for one row [V] and the args
    of ``constant_args``: the same row path and draw, without the per-step
    set-up (at batch 1 that set-up cost a third of the pick)."""
    raw = np.asarray(logits, dtype=np.float32)[None]
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        token = _sample_one_row(raw, raw, 0, args)
        if token is None:
            token = int(_sample_rows(raw, raw, _ROW_ZERO, args)[0])
    return token


_ROW_ZERO = np.zeros(1, dtype=np.int64)


def _sample_rows(raw: np.ndarray, x: np.ndarray, s: np.ndarray, args: SamplingArgs) -> np.ndarray:
    """Temperature, min-p, top-k, top-p and one draw for the non-greedy rows ``s``.

    A row with a cut-off (top-k or min-p) is reduced to its kept tokens with a
    couple of O(V) passes (a max, a compare); everything after that works on
    that short candidate list. Only rows that nothing truncates before top-p
    exponentiate the whole vocabulary (top-p needs their total mass). The
    arithmetic is per token exactly that of a dense [S, V] pass: the same
    float32 operations on each kept token and the per-block masses summed over
    the same 256-token blocks, with zeros for the dropped tokens, so the draws
    are the same bit for bit whichever form a row takes.
    """
    n, v = s.size, x.shape[1]
    xs = kernels.take_rows(x, s)  # [S, V]; a view when every row samples, so read only
    t = args.temperature[s]  # [S] float32, > 0
    k = args.top_k[s]
    heads = None  # every row top-k: its group maxima give the row maxima, one pass fewer
    if n and ((k > 0) & (k < v)).all():
        heads = kernels.group_heads(xs, k)
    m = (xs if heads is None else heads).max(axis=1) / t  # == max(xs / t): t > 0 keeps the order
    live = np.isfinite(m)  # else everything masked (or NaN/inf): raw argmax
    m[~live] = 0.0

    # Lowest (temperature-scaled) logit each row keeps. Min-p and top-k both
    # keep "the highest values", so where no top-p follows min-p (its place is
    # after top-p) they commute and combine into one floor.
    floor = np.full(n, -np.inf, dtype=np.float32)
    min_p = args.min_p[s]
    top_p = args.top_p[s]
    mp = min_p > 0
    early = mp & (top_p >= 1.0)
    late = mp & (top_p < 1.0) & live  # min-p after top-p, on the nucleus
    if early.any():
        # p_i < min_p * p_max  <=>  x_i < x_max + log(min_p)
        floor[early] = m[early] + np.log(min_p[early])
    kr = np.flatnonzero((k > 0) & (k < v) & live)
    survivors = None
    if kr.size:
        kth, rr, cc, vals = kernels.kth_largest(
            kernels.take_rows(xs, kr), k[kr], heads if kr.size == n else None
        )
        floor[kr] = np.maximum(floor[kr], kth / t[kr])  # the k-th largest of xs / t
        survivors = (kr[rr], cc, vals)

    # Candidate lists (row, token, e) in row-then-token order for the rows
    # with a finite floor; top-k rows take them from the survivors of their
    # k-th-largest search, min-p-only rows from one compare.
    cut = np.isfinite(floor) & live
    rows_c = cols_c = NO_IDS
    e_c = NO_VALS
    if cut.any():
        rows_c, cols_c, e_c = kernels.candidates(xs, t, m, floor, cut, kr, survivors)

    # Mass per block of DRAW_BLOCK tokens and its running total, [S, nb]:
    # the top-p target and the first level of the draw. (Every reduction here
    # is confined to one row, so a row's result never depends on the batch.)
    nb = -(-v // DRAW_BLOCK)
    blocks = np.zeros((n, nb), dtype=np.float32)
    dn = np.flatnonzero(live & ~cut)  # rows with nothing cut: the whole vocabulary
    dense_of = np.full(n, -1, dtype=np.int64)  # row -> its row of ``ed``
    dense_of[dn] = np.arange(dn.size)
    padded = np.empty((dn.size, nb * DRAW_BLOCK), dtype=np.float32)  # [D, nb * 256]
    padded[:, v:] = 0.0  # the last block's padding
    ed = padded[:, :v]  # [D, V]
    if dn.size:
        blocks[dn] = _masses(kernels.take_rows(xs, dn), t[dn], m[dn], ed)
    kernels.set_block_sums(blocks, rows_c, cols_c, e_c, v)
    cum = np.zeros((n, nb + 1))  # cum[:, j + 1]: mass of blocks 0..j, float64
    np.cumsum(blocks, axis=1, dtype=np.float64, out=cum[:, 1:])

    # Top-p on the distribution renormalised after top-k.
    pr = (top_p < 1.0) & live
    if pr.any():
        target = top_p * cum[:, -1]
        on = pr[rows_c]
        pfloor, _ = kernels.nucleus(rows_c[on], e_c[on], target, n)  # 0 where not cut
        on = e_c >= pfloor[rows_c]
        parts = [(rows_c[on], cols_c[on], e_c[on])]
        dp = np.flatnonzero(pr[dn])  # dense top-p rows, positions in ``dn``
        if dp.size:
            parts.append(
                kernels.dense_nucleus(
                    kernels.take_rows(ed, dp), dn[dp], cum[dn[dp], -1], top_p[dn[dp]]
                )
            )
            dense_of[parts[-1][0]] = -1  # now candidate lists
        if dp.size or not on.all():
            rows_c, cols_c, e_c = kernels.concat_rows(parts)
            changed = np.flatnonzero(pr & (dense_of < 0))
            blocks[changed] = 0.0
            kernels.set_block_sums(blocks, rows_c, cols_c, e_c, v)
            cum[changed, 1:] = np.cumsum(blocks[changed], axis=1, dtype=np.float64)

    # Min-p after top-p: of the nucleus (every such row is a list by now), the
    # tokens with p >= min_p * p_max, i.e. e >= min_p (the maximum, e = 1, is in it).
    if late.any():
        on = ~late[rows_c] | (e_c >= min_p[rows_c])
        if not on.all():
            rows_c, cols_c, e_c = rows_c[on], cols_c[on], e_c[on]
            changed = np.flatnonzero(late)
            blocks[changed] = 0.0
            kernels.set_block_sums(blocks, rows_c, cols_c, e_c, v)
            cum[changed, 1:] = np.cumsum(blocks[changed], axis=1, dtype=np.float64)

    # The draw (``_draws``): a race between the blocks, then one between the
    # winning block's tokens.
    d = np.array([_draws(args.rngs[i], v) for i in s]).reshape(n, nb + DRAW_BLOCK)
    ok = live & (cum[:, -1] > 0)  # else nothing left to draw from (all banned, min_p > 1, ...)
    b = _race(blocks, d[:, :nb])
    # Each row's chosen block [S, 256], then the token within it.
    part = np.zeros((n, DRAW_BLOCK), dtype=np.float32)
    dense = dn[dense_of[dn] >= 0]  # (top-p turned the others into lists)
    if dense.size:
        part[dense] = padded.reshape(dn.size, nb, DRAW_BLOCK)[dense_of[dense], b[dense]]
    if rows_c.size:
        on = cols_c // DRAW_BLOCK == b[rows_c]  # (no listed row is dense)
        part[rows_c[on], cols_c[on] % DRAW_BLOCK] = e_c[on]
    j = _race(part, d[:, nb:])
    out = b * DRAW_BLOCK + j
    if not ok.all():
        out[~ok] = fallback_tokens(raw, s[~ok], args)
    return out


def _draws(rng: np.random.Generator, v: int) -> np.ndarray:
    """A sampled row's draws for one step over a row of ``v`` tokens, whatever
    its stages keep: standard exponential variates in one call, one for each
    of the row's blocks of ``DRAW_BLOCK`` tokens, then one for each place in a
    block (``_race`` picks the block, then the token within it)."""
    return rng.standard_exponential(-(-v // DRAW_BLOCK) + DRAW_BLOCK)


def _race(mass: np.ndarray, exps: np.ndarray) -> np.ndarray:
    """The winner of each row of ``mass`` [..., k] (unnormalised probabilities,
    zeros where nothing is kept): the entry whose mass over its own
    exponential variate is largest. That is the Gumbel-max trick on the log
    masses, so an entry wins with probability mass / total; run on the blocks'
    masses, then on the winning block's tokens, it draws a token with its
    probability. Because every block and every place has its own variate, two
    distributions that differ a little pick the same token nearly as often as
    they can (their overlap), where one inverse CDF in token-id order moves
    every token's interval by all the mass that moved below it. A draft
    model's sampled guess draws with a copy of the row's generator
    (docs/design.md, "Speculative decoding"): this is what makes it land where
    the target's draw does. An entry without mass never wins (its key is 0;
    ``_TINY`` keeps a variate of exactly 0 from making it NaN); ties go to the
    first. Only a division per entry: every path gets the same keys bit for
    bit."""
    return np.argmax(mass / (exps + _TINY), axis=-1)


_TINY = 1e-300  # far below every nonzero variate's rounding: it changes only an exact 0


def _sample_one_row(raw: np.ndarray, x: np.ndarray, i: int, args: SamplingArgs) -> int | None:
    """``_sample_rows`` for the one row ``i`` when a cut-off (top-k, min-p) or
    top-p leaves it a short candidate list: the same float32 and float64
    operations on the same values in the same order, so the same token, with a
    fraction of the numpy calls (at batch 1 the batched form is mostly call
    overhead); a row that nothing cuts (temperature only) draws on the whole
    row (``_sample_dense_row``; from ``BOUNDED_RACE_MIN_VOCAB`` up on the
    blocks that can win, ``_sample_bounded_row``: the same token). None,
    before drawing anything, for a top-k row with fewer than k finite logits
    (nothing is cut; ``_sample_rows`` then takes it) and for a temperature
    that is not finite (a direct caller's: requests are validated)."""
    v = x.shape[1]
    k = int(args.top_k[i])
    min_p = args.min_p[i]
    top_p = args.top_p[i]
    top_k = 0 < k < v
    late = min_p > 0 and top_p < 1.0  # min-p after top-p: it cuts nothing before it
    cut = top_k or (min_p > 0 and not late)
    row = x[i]
    t = args.temperature[i]
    if not np.isfinite(t):
        return None
    bounded = not cut and top_p >= 1.0 and v >= BOUNDED_RACE_MIN_VOCAB
    if cut:
        heads = kernels.group_heads(row[None], args.top_k[i : i + 1])[0] if top_k else row
        m = heads.max() / t
    elif bounded:  # temperature only: bound the blocks' masses by their largest logits
        tops = np.maximum.reduceat(row, np.arange(0, v, DRAW_BLOCK))
        m = tops.max() / t  # == max(row / t): a finite t > 0 keeps the order, rounded too
    else:  # every token's mass is needed: divide first, and take the maximum from that
        scaled = np.divide(row, t)
        m = scaled.max()
    if not np.isfinite(m):  # everything masked (or NaN/inf): the raw argmax, after the draw
        _draws(args.rngs[i], v)
        return int(fallback_tokens(raw, np.array([i]), args)[0])
    if bounded:
        return _sample_bounded_row(raw, row, tops, m, i, args)
    if not cut and top_p >= 1.0:  # temperature only: the whole vocabulary
        return _sample_dense_row(raw, scaled, m, i, args)
    if not cut:  # top-p with nothing cut before it
        cols, e = _dense_nucleus_row(scaled, m, top_p)
        touched, mass, total, starts = _touched_run(cols, e, v)
    else:
        floor = m + np.log(min_p) if min_p > 0 and not late else np.float32(-np.inf)
        if top_k:
            h = heads.shape[0]
            bound = np.partition(heads, h - k)[h - k :].min()
            # (at least k: the k heads at or above the bound are entries of the row)
            cols = np.flatnonzero(row >= kernels.float32_below(np.asarray(bound, dtype=np.float64)))
            vals = row[cols]
            kth = -np.partition(-vals, k - 1)[k - 1]  # the k-th largest, as sorted_desc ranks
            floor = max(floor, kth / t)
            if not np.isfinite(floor):
                return None  # fewer than k finite logits: nothing is cut
        else:
            cols = np.flatnonzero(
                row >= kernels.float32_below(np.asarray(floor, dtype=np.float64) * np.float64(t))
            )
            vals = row[cols]
        xt = vals / t
        on = xt >= floor
        e = np.exp(xt[on] - m)
        cols = cols[on]
        on = e > 0
        cols, e = cols[on], e[on]

        # The two-level draw over the blocks the candidates touch: untouched
        # blocks hold no mass, and adding their zeros changes no running total,
        # so this is the dense form's draw on the dense form's block sums.
        touched, mass, total, starts = _touched_run(cols, e, v)
        if top_p < 1.0 and e.size:
            # kernels.nucleus on one row: most likely first, the first prefix
            # whose float64 running mass reaches the target sets the floor.
            desc = -np.sort(-e)
            reached = np.cumsum(desc, dtype=np.float64) >= top_p * total
            if reached.any():
                keep = e >= desc[reached.argmax()]
                if not keep.all():
                    cols, e = cols[keep], e[keep]
                    touched, mass, total, starts = _touched_run(cols, e, v)
    if late:  # min-p on the nucleus, as _sample_rows does
        keep = e >= min_p
        if not keep.all():
            cols, e = cols[keep], e[keep]
            touched, mass, total, starts = _touched_run(cols, e, v)

    d = _draws(args.rngs[i], v)
    if not total > 0:
        return int(fallback_tokens(raw, np.array([i]), args)[0])
    return int(cols[_race_listed(cols, e, touched, mass, starts, d)])


def _race_listed(
    cols: np.ndarray,
    e: np.ndarray,
    touched: np.ndarray,
    mass: np.ndarray,
    starts: np.ndarray,
    d: np.ndarray,
) -> int:
    """The index in ``cols`` (ascending token ids, masses ``e``) that a row's
    draws ``d`` (``_draws``) pick: the race between the blocks the tokens touch
    (``touched``, their masses, each one's first index in ``starts``; the
    untouched hold no mass and cannot win), then between the winner's tokens:
    the dense form's races without its zeros."""
    nb = d.size - DRAW_BLOCK
    q = int(_race(mass, d[:nb][touched]))
    lo = int(starts[q])
    hi = int(starts[q + 1]) if q + 1 < starts.size else cols.size
    return lo + int(_race(e[lo:hi], d[nb:][cols[lo:hi] % DRAW_BLOCK]))


def _masses(x: np.ndarray, t: np.ndarray, m: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Whole rows' unnormalised probabilities ``out = exp(x / t - m)`` ([D, V];
    ``t``, ``m`` [D]: temperature and the scaled maximum) and their
    ``DRAW_BLOCK`` sums [D, nb]: the one arithmetic of every dense row, batched
    or one at a time, so both forms draw alike. Rows larger together than
    ``kernels.CACHE_ELEMENTS`` go a row at a time, so each row's four passes
    find it in cache (the same float32 operations on each element; ``reduceat``
    sums a row's blocks alike either way)."""
    starts = np.arange(0, x.shape[1], DRAW_BLOCK)
    if x.size <= kernels.CACHE_ELEMENTS:
        np.divide(x, t[:, None], out=out)
        out -= m[:, None]
        np.exp(out, out=out)
        return np.add.reduceat(out, starts, axis=1)
    blocks = np.empty((x.shape[0], starts.size), dtype=np.float32)
    for i, row in enumerate(out):
        np.divide(x[i], t[i], out=row)
        blocks[i] = _row_masses(row, m[i], starts)[1]
    return blocks


def _row_masses(
    scaled: np.ndarray, m: np.float32, starts: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``_masses`` of one row from ``scaled`` [V] = row / t, overwritten with
    its masses: the masses [V] and their block sums [nb] (``starts``: the
    blocks' first tokens, if the caller has them)."""
    scaled -= m
    np.exp(scaled, out=scaled)
    if starts is None:
        starts = np.arange(0, scaled.shape[0], DRAW_BLOCK)
    return scaled, np.add.reduceat(scaled, starts)


def _sample_dense_row(
    raw: np.ndarray, scaled: np.ndarray, m: np.float32, i: int, args: SamplingArgs
) -> int:
    """The draw of ``_sample_rows`` for a row that nothing cuts (temperature
    only), on the whole row: its masses and block sums as the batched form
    computes them, the race between the blocks, then the token within the
    winner."""
    e, blocks = _row_masses(scaled, m)
    d = _draws(args.rngs[i], e.size)
    # (With a finite maximum, whose token has mass 1, there is always mass: a
    # guard; NaN masses fail it too.)
    if not blocks.max() > 0:
        return int(fallback_tokens(raw, np.array([i]), args)[0])
    b = int(_race(blocks, d[: blocks.size]))
    part = e[b * DRAW_BLOCK : (b + 1) * DRAW_BLOCK]
    return b * DRAW_BLOCK + int(_race(part, d[blocks.size : blocks.size + part.size]))


def _sample_bounded_row(
    raw: np.ndarray, row: np.ndarray, tops: np.ndarray, m: np.float32, i: int, args: SamplingArgs
) -> int:
    """``_sample_dense_row`` without exponentiating the whole row
    (``BOUNDED_RACE_MIN_VOCAB``): the same race between the blocks' masses,
    run only among the blocks that can win it.

    A block's mass lies between its largest token's mass and that times its
    size (``tops``: each block's largest logit; ``m``: the scaled maximum), so
    its key (mass over its variate) lies between two bounds known from
    ``tops`` alone. A block whose upper bound is below the best lower bound
    cannot win; the others (of 1,024 at V = 262,144, on the benchmark's logits
    a median of 15 at temperature 0.7, 40 at 1.0, 100-150 at 1.5-3) get their
    exact masses (``_blocks_masses``: the dense form's, bit for bit), so the
    winner and then the token within it are the dense form's. The margins
    are far wider than float32 rounding, which is all that bounds by value
    could miss (``np.exp`` need not be monotonic in the last place)."""
    v, nb = row.size, tops.size
    t = args.temperature[i]
    d = _draws(args.rngs[i], v)
    w = d[:nb] + _TINY
    top = np.exp(np.divide(tops, t) - m).astype(np.float64)  # each block's largest mass
    size = np.minimum(DRAW_BLOCK, v - np.arange(0, v, DRAW_BLOCK))
    best = (top * (1.0 - _BOUND_MARGIN) / w).max()
    cand = np.flatnonzero(top * size * (1.0 + _BOUND_MARGIN) / w >= best)
    ids, e, starts, mass = _blocks_masses(row, cand, t, m)
    # (With a finite maximum, whose token has mass 1, there is always mass: a
    # guard; NaN masses fail it too.)
    if not mass.max() > 0:
        return int(fallback_tokens(raw, np.array([i]), args)[0])
    return int(ids[_race_listed(ids, e, cand, mass, starts, d)])


def _blocks_masses(
    row: np.ndarray, blocks: np.ndarray, t: np.float32, m: np.float32
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The tokens of some of a row's draw blocks (``blocks``, ascending, at
    least one) and their masses, each block's first index among them, and
    each block's mass: ``_row_masses``'s values for those tokens and blocks,
    bit for bit (the same float32 operations on each token; ``reduceat`` over
    the same whole blocks)."""
    ids = (blocks[:, None] * DRAW_BLOCK + _PLACES).reshape(-1)
    if ids[-1] >= row.size:  # the last block is short
        ids = ids[ids < row.size]
    e = np.divide(row[ids], t)
    e -= m
    np.exp(e, out=e)
    starts = np.arange(0, ids.size, DRAW_BLOCK)
    return ids, e, starts, np.add.reduceat(e, starts)


# Relative margin on the bounds of a block's mass (``_sample_bounded_row``).
_BOUND_MARGIN = 1e-3
_PLACES = np.arange(DRAW_BLOCK)


def _dense_nucleus_row(
    scaled: np.ndarray, m: np.float32, top_p: np.float64
) -> tuple[np.ndarray, np.ndarray]:
    """The nucleus (token ids ascending, masses) of a row that nothing cuts
    before top-p, as ``_sample_rows`` finds it for a dense row: the whole
    vocabulary's masses and their total summed as its block sums and running
    total are, then the nucleus ``kernels.dense_nucleus`` keeps on that one
    row (``tests/unit/test_sampler.py`` compares them at every level)."""
    e, blocks = _row_masses(scaled, m)
    total = np.cumsum(blocks, dtype=np.float64)[-1:]
    # dense_nucleus's first two levels in a third of its numpy calls (they
    # find nearly every nucleus): one pass at the second, the first's tokens
    # among its. The levels after them are its own (it tries the two again).
    bound = ((1.0 - top_p) * total / e.size).astype(np.float32)
    first_two = kernels.NUCLEUS_LEVELS[:2]
    cols = np.flatnonzero(e >= np.maximum(bound, np.float32(first_two[-1])))
    vals = e[cols]
    for level in first_two:
        on = vals >= np.maximum(bound, np.float32(level))
        desc = -np.sort(-vals[on])
        reached = np.cumsum(desc, dtype=np.float64) >= top_p * total
        if reached.any():
            keep = vals >= desc[reached.argmax()]
            return cols[keep], vals[keep]
    _, cols, vals = kernels.dense_nucleus(e[None], _ROW_ZERO, total, np.array([top_p]))
    return cols, vals


def _touched_run(
    cols: np.ndarray, e: np.ndarray, v: int
) -> tuple[np.ndarray, np.ndarray, float, np.ndarray]:
    """One row's candidates (``cols`` ascending, masses ``e``): the draw blocks
    they touch, each one's mass (``kernels.block_masses``), the float64
    running total of those masses (the dense form's, which adds zeros for the
    others) and each such block's first candidate."""
    nb = -(-v // DRAW_BLOCK)
    touched, mass, starts = kernels.block_masses(cols // DRAW_BLOCK, cols, e, v, nb)
    total = float(np.cumsum(mass, dtype=np.float64)[-1]) if mass.size else 0.0
    return touched, mass, total, starts


def _sample_extended_row(raw: np.ndarray, x: np.ndarray, i: int, args: SamplingArgs) -> int:
    """A sampled row with a stage after top-p (top-a, typical, Mirostat, XTC).

    Temperature, top-k and min-p (one floor, as on the other paths), top-p on
    what they keep, then on the renormalised distribution in turn: top-a (drop
    p < top_a * p_max^2), locally typical sampling (keep the tokens whose
    surprise is nearest the entropy, until their mass reaches typical_p),
    Mirostat v2 (drop tokens whose surprise in bits exceeds mu) and XTC (with
    probability xtc_probability: of the tokens with p > xtc_threshold, when
    there are two or more, drop all but the least likely). Each stage keeps at
    least the most likely token left. Then the draw of every path (``_race``
    between the blocks, then between the winner's tokens); Mirostat's mu then
    moves by eta times the chosen token's surprise (in the final distribution)
    minus tau.

    Draws from the row's generator: an XTC row first its coin, then every row
    its ``_draws``, whatever the stages do."""
    ext = args.extended[i]
    assert ext is not None
    rng = args.rngs[i]
    v = x.shape[1]
    coin = rng.random() if ext.xtc_probability > 0 else 1.0
    d = _draws(rng, v)
    xt = x[i] / args.temperature[i]  # float32 [V]
    m = xt.max()
    if not np.isfinite(m):  # everything masked (or NaN/inf): the raw argmax
        return int(fallback_tokens(raw, np.array([i]), args)[0])
    keep = np.isfinite(xt)
    k = int(args.top_k[i])
    top_p = float(args.top_p[i])
    min_p = float(args.min_p[i])
    if 0 < k < v:
        keep &= xt >= np.partition(xt, v - k)[v - k]  # ties at the k-th are all kept
    if min_p > 0 and top_p >= 1.0:  # (with top-p, min-p comes after it)
        keep &= xt >= m + np.log(min_p)
    cols = np.flatnonzero(keep)
    e = np.exp((xt[cols] - m).astype(np.float64))
    if top_p < 1.0:
        # Only tokens above (1 - top_p) * mass / V can be in the nucleus: those
        # below hold less than 1 - top_p of the mass together.
        total = e.sum()
        desc = -np.sort(-e[e >= (1.0 - top_p) * total / max(e.size, 1)])
        reached = np.cumsum(desc) >= top_p * total
        if reached.any():
            on = e >= desc[reached.argmax()]
            cols, e = cols[on], e[on]
        if min_p > 0:  # min-p on the nucleus (e = p / p_max)
            on = e >= min_p
            cols, e = cols[on], e[on]
    p = e / e.sum()
    if ext.top_a > 0:
        on = p >= ext.top_a * p.max() ** 2
        cols, p = cols[on], p[on] / p[on].sum()
    if ext.typical_p < 1.0 and p.size > 1:
        cols, p = _typical(cols, p, ext.typical_p)
    if ext.mirostat is not None:
        on = -np.log2(p) <= ext.mirostat.mu
        if not on.any():
            on = p == p.max()
        cols, p = cols[on], p[on] / p[on].sum()
    if coin < ext.xtc_probability:
        above = p > ext.xtc_threshold
        if np.count_nonzero(above) >= 2:
            on = ~above | (p == p[above].min())
            cols, p = cols[on], p[on] / p[on].sum()
    # The draw as on the other paths, on the blocks the tokens left fall in
    # (their masses in float64, as this path's p).
    blk = cols // DRAW_BLOCK
    starts = np.flatnonzero(np.concatenate(([True], blk[1:] != blk[:-1])))
    j = _race_listed(cols, p, blk[starts], np.add.reduceat(p, starts), starts, d)
    if ext.mirostat is not None:
        surprise = -np.log2(p[j])
        ext.mirostat.mu -= ext.mirostat_eta * (surprise - ext.mirostat_tau)
    return int(cols[j])


# Tokens below this probability are never in a typical set whose mass is at
# most 1 - V * TYPICAL_TINY: their surprise is farther from the entropy (at
# most log V) than any larger token's (see ``_typical``).
TYPICAL_TINY = 1e-12


def _typical(cols: np.ndarray, p: np.ndarray, typical_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Locally typical sampling (Meister et al.): the tokens ranked by how far
    their surprise -log p is from the entropy, the fewest whose mass reaches
    ``typical_p`` (at least one), renormalised. Tokens below TYPICAL_TINY
    rank after every other one (their distance exceeds -log TYPICAL_TINY -
    H >= any other's, H <= log V), so only the rest are sorted, unless the
    rest hold too little mass."""
    with np.errstate(divide="ignore"):
        surprise = -np.log(p)
    entropy = float(np.sum(p * np.where(p > 0, surprise, 0.0)))
    big = np.flatnonzero(p >= TYPICAL_TINY)
    if p[big].sum() < typical_p:
        big = np.arange(p.size)
    order = big[np.argsort(np.abs(surprise[big] - entropy), kind="stable")]
    reached = np.cumsum(p[order]) >= typical_p
    last = int(reached.argmax()) if reached.any() else order.size - 1
    kept = np.sort(order[: last + 1])
    return cols[kept], p[kept] / p[kept].sum()


def first_allowed(row: np.ndarray, allowed: np.ndarray) -> int:
    """The lowest id ``allowed`` [V] bool lets through (a constrained row never
    leaves its mask); the raw argmax of ``row`` when it allows nothing."""
    ids = np.flatnonzero(allowed[: row.shape[0]])
    return int(ids[0]) if ids.size else int(np.argmax(row))


def fallback_tokens(raw: np.ndarray, rows: np.ndarray, args: SamplingArgs) -> np.ndarray:
    """The tokens of ``rows`` that have nothing left to pick from (every
    candidate banned, -inf or NaN): the raw argmax, or for a row under a
    constraint's mask its lowest allowed id."""
    out = raw[rows].argmax(axis=1)
    if args.allowed is not None:
        position = {int(r): j for j, r in enumerate(args.allowed_rows)}
        for k, r in enumerate(rows):
            j = position.get(int(r))
            if j is not None:
                out[k] = first_allowed(raw[r], args.allowed[j])
    return out


def _logprobs(
    raw: np.ndarray, tokens: np.ndarray, args: SamplingArgs
) -> tuple[np.ndarray | None, list[np.ndarray], list[np.ndarray]]:
    """Chosen-token logprobs and top alternatives under log_softmax(raw)."""
    return _logprobs_of(raw, tokens, args.want_logprobs, args.top_logprobs)


def token_logprobs(
    raw: np.ndarray, tokens: np.ndarray, top: int
) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """For each row of ``raw`` [N, V]: the logprob of ``tokens[i]`` and the
    ``top`` most likely alternatives under log_softmax(raw), computed as a
    sampled token's are (prompt logprobs)."""
    n = raw.shape[0]
    lps, ids, tops = _logprobs_of(
        raw, np.asarray(tokens, dtype=np.int64), np.ones(n, dtype=bool), np.full(n, top)
    )
    assert lps is not None
    return lps, ids, tops


def _logprobs_of(
    raw: np.ndarray, tokens: np.ndarray, want_logprobs: np.ndarray, top_logprobs: np.ndarray
) -> tuple[np.ndarray | None, list[np.ndarray], list[np.ndarray]]:
    b, v = raw.shape
    top_ids = [NO_IDS] * b
    top_lps = [NO_VALS] * b
    n_top = np.minimum(top_logprobs, v)
    lr = np.flatnonzero(want_logprobs | (n_top > 0))
    if not lr.size:
        return None, top_ids, top_lps
    r = raw if lr.size == b else raw[lr]  # [L, V]; read only
    m, lse = kernels.row_logsumexp(r)  # [L] each
    logprobs = np.zeros(b, dtype=np.float32)
    logprobs[lr] = r[np.arange(lr.size), tokens[lr]] - lse

    t = np.flatnonzero(n_top[lr] > 0)  # positions in lr
    if t.size:
        want = n_top[lr[t]]
        rr, cc, vals = kernels.top_survivors(
            kernels.take_rows(r, t), want
        )  # every top-n token, ties included
        order = np.lexsort((cc, -vals, rr))  # per row most likely first, ties by lowest id
        rr, cc, vals = rr[order], cc[order], vals[order]
        counts = np.bincount(rr, minlength=t.size)
        rank = np.arange(rr.size) - (np.cumsum(counts) - counts)[rr]
        on = rank < want[rr]
        rr, cc = rr[on], cc[on]
        lps = (vals[on] - lse[t[rr]]).astype(np.float32)
        ends = np.cumsum(want)
        for k, pos in enumerate(t):
            row = int(lr[pos])
            top_ids[row] = cc[ends[k] - want[k] : ends[k]]
            top_lps[row] = lps[ends[k] - want[k] : ends[k]]
    return logprobs, top_ids, top_lps
