"""Every token's text, searched at once: DRY's sequence breakers as token masks.

A DRY sequence breaker is a string; every token whose text contains one breaks
a repetition match (text-generation-webui and llama.cpp treat a breaker the
same way). The texts of the whole vocabulary are decoded once, on first use
(``tokenizers``' batch decode), and joined into one string, so a breaker set
costs one C-speed substring scan per breaker, not a Python loop over the
vocabulary; masks are cached per breaker set.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import tokenizers

SEPARATOR = "\x00"  # in no token's text (stripped from those few that have it)
CACHED_SETS = 32


class TokenTexts:
    def __init__(self, tokenizer: tokenizers.Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's (logits width)
        self._joined: str | None = None
        self._starts: np.ndarray | None = None
        self.breakers = functools.lru_cache(maxsize=CACHED_SETS)(self._breakers)

    def _index(self) -> tuple[str, np.ndarray]:
        if self._joined is None:
            n = min(self.tokenizer.get_vocab_size(with_added_tokens=True), self.vocab_size)
            texts = self.tokenizer.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
            texts = [t.replace(SEPARATOR, "") for t in texts]
            lengths = np.fromiter((len(t) + 1 for t in texts), dtype=np.int64, count=n)
            self._starts = np.cumsum(lengths) - lengths  # token i's text starts here
            self._joined = SEPARATOR.join(texts) + SEPARATOR
        assert self._starts is not None
        return self._joined, self._starts

    def _breakers(self, strings: tuple[str, ...]) -> np.ndarray:
        """[vocab_size] bool: the tokens whose text contains one of ``strings``."""
        joined, starts = self._index()
        mask = np.zeros(self.vocab_size, dtype=bool)
        for s in strings:
            if not s or SEPARATOR in s:
                continue
            hits = []
            at = joined.find(s)
            while at >= 0:
                hits.append(at)
                at = joined.find(s, at + 1)
            if hits:
                mask[np.searchsorted(starts, np.asarray(hits), side="right") - 1] = True
        mask.flags.writeable = False
        return mask


def breaker_strings(given: Sequence[str], default: Sequence[str]) -> tuple[str, ...]:
    return tuple(given) if given else tuple(default)
