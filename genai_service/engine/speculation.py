"""Prompt-lookup drafts for speculative decoding.

A sequence's next tokens are guessed from its own context: find the latest
earlier place where its last ``n`` tokens occurred (``n`` from ``ngram_max``
down to ``ngram_min``) and propose the tokens that followed there. Text that
quotes or edits its prompt (summaries, code changes, extraction, multi-turn
chat that repeats names) is full of such runs. The engine feeds the last token
plus the draft in one step and keeps every draft token the model itself would
have chosen (``LLMEngine._speculate``), so the output does not change.

The index is built once per sequence and extended by the tokens appended
since, so a step costs a few dict operations, not a scan of the context.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..config import SpeculationConfig


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
        self._sizes = range(config.ngram_min, config.ngram_max + 1)
        self._index: dict[int, _NgramIndex] = {}
        self._backoff: dict[int, tuple[int, int]] = {}  # seq_id -> (steps left, last span)

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
