"""Prompt-lookup guesses: a sequence's next tokens from its own context.

Find the latest earlier place where its last ``n`` tokens occurred (``n``
from ``ngram_max`` down to ``ngram_min``) and propose the tokens that followed
there. Text that quotes or edits its prompt (summaries, code changes,
extraction, multi-turn chat that repeats names) is full of such runs. The
index is built once per sequence and extended by the tokens appended since,
so a step costs a few dict operations, not a scan of the context.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...config import SpeculationConfig
from ..sequence import Sequence as Seq
from .proposer import Backoff, DraftWant, Proposer


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


class PromptLookup(Proposer):
    """Per-sequence n-gram indexes; ``propose`` guesses, ``feedback`` says how
    a guess fared (back-off after failures, ``Backoff``), ``forget`` drops a
    sequence. ``num_tokens``: the longest guess (the engine's ``--speculate``,
    twice that beside a draft model: see ``Speculation``)."""

    name = "prompt_lookup"

    def __init__(self, config: SpeculationConfig, num_tokens: int | None = None) -> None:
        self.num_tokens = num_tokens or config.num_tokens
        self._sizes = range(config.ngram_min, config.ngram_max + 1)
        self._index: dict[int, _NgramIndex] = {}
        self.backoff = Backoff()

    def propose(self, wants: Sequence[DraftWant]) -> dict[int, list[int]]:
        guesses = {}
        for want in wants:
            guess = self.guess(want.seq.seq_id, want.seq.token_ids, want.limit)
            if guess:
                guesses[want.seq.seq_id] = guess
        return guesses

    def guess(self, seq_id: int, tokens: Sequence[int], limit: int) -> list[int]:
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
        if self.backoff.pausing(seq_id):
            return []
        return index.lookup(tokens, limit)

    def accepted(self, seq: Seq, n: int) -> None:
        self.feedback(seq.seq_id, n)

    def feedback(self, seq_id: int, accepted: int) -> None:
        """``accepted`` tokens of the sequence's last guess were kept."""
        self.backoff.record(seq_id, accepted)

    def forget(self, seq_id: int) -> None:
        self._index.pop(seq_id, None)
        self.backoff.forget(seq_id)
