"""Prompt-lookup drafts for speculative decoding.

A sequence's next tokens are guessed from its own context: find the latest
earlier place where its last ``n`` tokens occurred (``n`` from ``ngram_max``
down to ``ngram_min``) and propose the tokens that followed there. Text that
quotes or edits its prompt (summaries, code changes, extraction, multi-turn
chat that repeats names) is full of such runs. The engine feeds the last token
plus the draft in one step and keeps every draft token the model itself would
have chosen (``LLMEngine._accept`` with ``follow_draft`` below): the same
tokens as without speculation, up to the rounding of a several-token step
(docs/design.md, "Speculative decoding").

The index is built once per sequence and extended by the tokens appended
since, so a step costs a few dict operations, not a scan of the context.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from ..config import SpeculationConfig
from .sequence import SeqStatus
from .sequence import Sequence as Seq

T = TypeVar("T")


class _NgramIndex:
    """For each n: n-gram -> the position right after its latest occurrence,
    over occurrences that end before the last token (so a lookup of the
    context's own suffix never finds itself)."""

    def __init__(self, sizes: range) -> None:
        self.sizes = sizes
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        self.indexed = 0  # n-grams ending before this position are in the maps

    def extend(self, tokens: Sequence[int]) -> None:
        end = len(tokens) - 1  # the last token has no continuation yet
        for e in range(max(self.indexed, 1), end + 1):
            for n in self.sizes:
                if e >= n:
                    self.maps[n][tuple(tokens[e - n : e])] = e
        self.indexed = max(self.indexed, end + 1)

    def lookup(self, tokens: Sequence[int], limit: int) -> list[int]:
        for n in reversed(self.sizes):  # longest match first
            if len(tokens) <= n:
                continue
            e = self.maps[n].get(tuple(tokens[-n:]))
            if e is not None:
                return list(tokens[e : e + limit])
        return []


MAX_BACKOFF_STEPS = 16


class PromptLookup:
    """Per-sequence n-gram indexes; ``propose`` drafts, ``feedback`` says how a
    draft fared, ``forget`` drops a sequence.

    A step that checks a draft costs more than a plain decode step (about
    1.4x for 5 tokens on the default model), so a sequence whose drafts keep
    failing (free-form text that does not quote its context) stops drafting
    for 1, 2, 4 ... up to ``MAX_BACKOFF_STEPS`` steps after each draft of
    which nothing was accepted.
    """

    def __init__(self, config: SpeculationConfig) -> None:
        self.num_tokens = config.num_tokens
        self.max_batch = config.max_batch
        self._sizes = range(config.ngram_min, config.ngram_max + 1)
        self._index: dict[int, _NgramIndex] = {}
        self._backoff: dict[int, tuple[int, int]] = {}  # seq_id -> (steps left, last span)

    def drafts(self, items: Sequence[tuple[Seq, int]], context_length: int) -> dict[int, list[int]]:
        """seq_id -> draft, for the sequences of a step that may speculate: only
        steps that decode alone (no prefill, no session commit), at most
        ``max_batch`` sequences."""
        if len(items) > self.max_batch:
            return {}
        if any(n != 1 or not s.output_ids or s.status is not SeqStatus.RUNNING for s, n in items):
            return {}
        drafts = {}
        for seq, _ in items:
            # Every kept draft token and the token after them must fit the
            # request's max_new_tokens and the context.
            limit = min(
                seq.max_new_tokens - len(seq.output_ids) - 1,
                context_length - len(seq.token_ids) - 1,
            )
            draft = self.propose(seq.seq_id, seq.token_ids, limit)
            if draft:
                drafts[seq.seq_id] = draft
        return drafts

    def propose(self, seq_id: int, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to ``min(num_tokens, limit)`` tokens guessed to follow ``tokens``
        (the sequence's whole context); empty when nothing matches or the
        sequence is backing off."""
        limit = min(self.num_tokens, limit)
        if limit <= 0:
            return []
        index = self._index.get(seq_id)
        if index is None:
            index = self._index[seq_id] = _NgramIndex(self._sizes)
        index.extend(tokens)
        left, span = self._backoff.get(seq_id, (0, 0))
        if left:
            self._backoff[seq_id] = (left - 1, span)
            return []
        return index.lookup(tokens, limit)

    def feedback(self, seq_id: int, accepted: int) -> None:
        """``accepted`` tokens of the sequence's last draft were kept."""
        if accepted:
            self._backoff.pop(seq_id, None)
            return
        _, span = self._backoff.get(seq_id, (0, 0))
        span = min(MAX_BACKOFF_STEPS, 2 * span or 1)
        self._backoff[seq_id] = (span, span)

    def forget(self, seq_id: int) -> None:
        self._index.pop(seq_id, None)
        self._backoff.pop(seq_id, None)


def follow_draft(
    draft: Sequence[int], rows: np.ndarray, choose: Callable[[np.ndarray, list[int]], tuple[int, T]]
) -> list[tuple[int, T]]:
    """Pick a token from each row of ``rows`` (the logits after the last token and
    after each draft token) in turn, ``choose(row, tokens picked so far)``, while
    the picks agree with ``draft``: the first pick that differs, or the one after
    the whole draft, is the last. Returns 1 to ``len(draft) + 1`` picks."""
    picks: list[tuple[int, T]] = []
    for j, row in enumerate(rows):
        picks.append(choose(row, [t for t, _ in picks]))
        if j == len(draft) or picks[-1][0] != draft[j]:
            break
    return picks
