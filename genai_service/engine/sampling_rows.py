"""From a running sequence to the sampler and back: the engine's sampling glue.

``plain_greedy`` spots the rows that need no sampler at all (a row-wise
argmax); ``sampling_row`` builds the ``sampler.SamplingRow`` of a sequence,
with the model author's defaults applied; ``token_logprob`` turns the
sampler's logprob arrays into the ``TokenLogprob`` sent to the client.
``TokenPicker`` puts them together: the tokens a step picks from its logits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

import numpy as np

from ..contract.request import DRY_DEFAULT_BREAKERS, SamplingParams, TokenLogprob, TopLogprob
from ..guidance.constraints import Guidance
from .sampling import sampler as sampling
from .sequence import Sequence
from .text.token_texts import TokenTexts, breaker_strings

_SAMPLING_DEFAULT_FIELDS = ("top_k", "top_p", "min_p", "repetition_penalty")


def plain_greedy(seq: Sequence, pending: int = 0, masked: bool = False) -> bool:
    """Greedy with nothing that changes the logits and no logprobs wanted;
    ``masked``: a constraint's mask may change them (it is then a masked
    argmax, ``greedy_pick``). ``pending``: tokens chosen for ``seq`` but not
    appended yet (a draft being checked)."""
    p = seq.request.sampling
    return (
        (masked or seq.matcher is None)
        and p.greedy
        and seq.request.top_logprobs == 0
        and len(seq.output_ids) + pending >= seq.request.stopping.min_new_tokens
        and not p.penalizes
        and not p.changes_logits
    )


def sampling_row(
    seq: Sequence,
    defaults: Mapping[str, float | int],
    pending: list[int] | None = None,
    allowed: np.ndarray | None = None,
    texts: TokenTexts | None = None,
) -> sampling.SamplingRow:
    """The sampler's view of ``seq``; ``defaults`` are the model's ``sampling_defaults``;
    ``pending`` as in ``plain_greedy``, but the tokens themselves (penalties see them);
    ``allowed`` the mask of its constraint, if it has one; ``texts``: the
    vocabulary's texts (DRY's sequence breakers)."""
    outputs = seq.output_ids + pending if pending else seq.output_ids
    banned: tuple[int, ...] = ()
    if len(outputs) < seq.request.stopping.min_new_tokens:
        banned = tuple(seq.eos_token_ids | seq.stop_token_ids)
    params = effective_sampling(seq.request.sampling, defaults)
    breakers = None
    if params.dry_multiplier and texts is not None:
        breakers = texts.breakers(
            breaker_strings(params.dry_sequence_breakers, DRY_DEFAULT_BREAKERS)
        )
    return sampling.SamplingRow(
        params=params,
        rng=seq.rng,
        prompt_token_ids=seq.token_ids[: seq.prompt_len],
        output_token_ids=outputs,
        top_logprobs=seq.request.top_logprobs,
        banned_token_ids=banned,
        want_logprobs=seq.request.top_logprobs > 0,
        allowed=allowed,
        dry_breakers=breakers,
        bad_words=seq.bad_words,
        mirostat=seq.mirostat,
    )


def effective_sampling(
    params: SamplingParams, defaults: Mapping[str, float | int]
) -> SamplingParams:
    """Model defaults (genai_config ``search``) fill unset fields of sampling requests."""
    if params.greedy or not defaults.get("do_sample"):
        return params
    filled = {
        name: defaults[name]
        for name in _SAMPLING_DEFAULT_FIELDS
        if getattr(params, name) is None and name in defaults
    }
    if not filled:
        return params
    return replace(params, **filled)  # type: ignore[arg-type]


def token_logprob(
    token: int,
    logprob: float,
    top_ids: np.ndarray,
    top_lps: np.ndarray,
    token_text: Callable[[int], str],
) -> TokenLogprob:
    """The sampled token's logprob and its top alternatives, with their text."""
    return TokenLogprob(
        token_id=token,
        text=token_text(token),
        logprob=logprob,
        top=tuple(
            TopLogprob(int(t), token_text(int(t)), float(p))
            for t, p in zip(top_ids, top_lps, strict=True)
        ),
    )


def prompt_logprobs(
    rows: np.ndarray, targets: list[int], top: int, token_text: Callable[[int], str]
) -> list[TokenLogprob]:
    """The logprob of each of ``targets`` under the row before it (``rows``
    [len(targets), vocab]: the logits of the positions that precede them),
    with ``top`` alternatives: GenerationRequest.prompt_logprobs."""
    if not targets:
        return []
    lps, ids, tops = sampling.token_logprobs(rows, np.asarray(targets), top)
    return [
        token_logprob(t, float(lp), i, tl, token_text)
        for t, lp, i, tl in zip(targets, lps, ids, tops, strict=True)
    ]


def greedy_pick(row: np.ndarray, allowed: np.ndarray | None) -> int:
    """The sampler's greedy choice on ``row`` [vocab] under a mask (None: none):
    the highest allowed logit, ties to the lowest id; a mask that allows nothing
    falls back to the raw argmax, as the sampler's all-masked rows do."""
    if allowed is None:
        return int(np.argmax(row))
    masked = np.where(allowed[: row.shape[0]], row, -np.inf)
    token = int(np.argmax(masked))
    return token if np.isfinite(masked[token]) else sampling.first_allowed(row, allowed)


Picked = tuple[int, TokenLogprob | None]  # a token, and its logprobs if the request wants them


class TokenPicker:
    """The next token of sequences from their logits, as the request asks:
    a row-wise argmax when every row is plain greedy, the sampler otherwise.
    A constrained sequence's row is masked by its matcher (``guidance``)."""

    def __init__(
        self,
        defaults: Mapping[str, float | int],
        token_text: Callable[[int], str],
        guidance: Guidance | None = None,
        texts: TokenTexts | None = None,
    ):
        self.defaults = defaults  # the model's sampling_defaults
        self.token_text = token_text
        self.guidance = guidance
        self.texts = texts  # the vocabulary's texts, for DRY's sequence breakers

    def pick(
        self,
        seqs: list[Sequence],
        logits: np.ndarray,
        allowed: dict[int, np.ndarray] | None = None,
    ) -> list[Picked]:
        """One token per sequence; ``logits``: [len(seqs), vocab]; ``allowed``:
        the masks of the constrained sequences, by seq_id (computed now when
        missing)."""
        if all(plain_greedy(seq) for seq in seqs):
            # The common case needs no sampler set-up.
            return [(int(t), None) for t in np.argmax(logits, axis=1)]
        masks = dict(allowed or {})
        missing = [s for s in seqs if s.matcher is not None and s.seq_id not in masks]
        if missing:
            assert self.guidance is not None  # only it makes matchers
            found = self.guidance.masks([s.matcher for s in missing])
            masks.update(zip([s.seq_id for s in missing], found, strict=True))
        if all(plain_greedy(seq, masked=True) for seq in seqs):
            # Greedy constrained rows: a masked argmax, as the sampler would pick.
            return [
                (greedy_pick(logits[j], masks.get(seq.seq_id)), None) for j, seq in enumerate(seqs)
            ]
        if len(seqs) <= sampling.ROW_PATH_MAX_ROWS:
            # Rows whose sampler args never change: built once per sequence.
            constant = [a for a in map(self._constant_args, seqs) if a is not None]
            if len(constant) == len(seqs):
                return [
                    (sampling.sample_constant(logits[j], a), None) for j, a in enumerate(constant)
                ]
        rows = [
            sampling_row(seq, self.defaults, allowed=masks.get(seq.seq_id), texts=self.texts)
            for seq in seqs
        ]
        sampled = sampling.sample(logits, sampling.prepare(rows))
        return [self._picked(seq, sampled, j) for j, seq in enumerate(seqs)]

    def _constant_args(self, seq: Sequence) -> sampling.SamplingArgs | None:
        """``seq``'s sampler args if they are the same at every step from now on
        (``sampling.constant_args``), built on its first such step; else None.
        Not while it is short of its ``min_new_tokens`` (EOS is banned until
        then) nor under a constraint (its mask is not in the row built here)."""
        if seq.matcher is not None or len(seq.output_ids) < seq.request.stopping.min_new_tokens:
            return None
        cached = seq.plain_args
        if cached is None or cached[0] is not seq.rng:
            row = sampling_row(seq, self.defaults, texts=self.texts)
            cached = seq.plain_args = (seq.rng, sampling.constant_args(row))
        return cached[1]

    def pick_after(self, seq: Sequence, row: np.ndarray, pending: list[int]) -> Picked:
        """The token a plain decode of ``seq`` would pick from ``row`` (logits,
        [vocab]) after ``pending`` (picked, not yet appended: a draft being checked)."""
        if plain_greedy(seq, len(pending)):
            return int(np.argmax(row)), None
        constant = self._constant_args(seq)  # (None for a constrained row)
        if constant is not None:
            return sampling.sample_constant(row, constant), None
        allowed = None
        if seq.matcher is not None:
            # The mask after the pending tokens: consume them, then roll back.
            assert self.guidance is not None
            matcher = seq.matcher
            if pending and not matcher.consume_tokens(pending):
                raise RuntimeError(f"constraint rejected picked tokens: {matcher.get_error()}")
            allowed = self.guidance.masks([matcher])[0]
            if pending:
                matcher.rollback(len(pending))
            if plain_greedy(seq, len(pending), masked=True):
                return greedy_pick(row, allowed), None
        args = sampling.prepare([sampling_row(seq, self.defaults, pending, allowed, self.texts)])
        return self._picked(seq, sampling.sample(row[None], args), 0)

    def guess_after(
        self, seq: Sequence, row: np.ndarray, pending: list[int], rng: np.random.Generator
    ) -> int:
        """A draft model's guess for ``seq`` from ``row`` (the draft's logits) after
        ``pending`` (its guesses so far): the pick a plain decode would make from
        these logits, drawing from ``rng``, a copy of the sequence's generator
        advanced one step per guess as the real one will be when the target
        checks them. So the draft's sampled guesses are coupled to the target's
        own draws, and agree with its picks as often as the two distributions
        allow (a greedy guess would agree only where the draw lands on the
        likeliest token). No constraint mask: a guess is cut to what the
        constraint accepts before the check."""
        if plain_greedy(seq, len(pending), masked=True):
            return int(np.argmax(row))
        constant = self._constant_args(seq)  # the same with the guesses pending
        if constant is not None:
            return sampling.sample_constant(row, replace(constant, rngs=[rng]))
        base = sampling_row(seq, self.defaults, pending, None, self.texts)
        guess_row = replace(base, rng=rng, top_logprobs=0, want_logprobs=False)
        return int(sampling.sample(row[None], sampling.prepare([guess_row])).token_ids[0])

    def _picked(self, seq: Sequence, sampled: sampling.SampleOutput, j: int) -> Picked:
        """Row ``j`` of the sampler's output."""
        token = int(sampled.token_ids[j])
        if seq.request.top_logprobs == 0:
            return token, None
        return token, token_logprob(
            token,
            float(sampled.logprobs[j]) if sampled.logprobs is not None else 0.0,
            sampled.top_token_ids[j],
            sampled.top_logprobs[j],
            self.token_text,
        )
