"""A sequence's streamed text: the incremental detokenizer, then the stop matcher.

Every generated token goes through ``add``; the text it returns is what the
step streams. When the sequence finishes, whatever either stage still holds
back comes out in one ``finish`` (or ``finish_at_stop_token``) call: the
detokenizer's incomplete tail goes through the stop matcher (a stop string may
still complete in it), and the matcher's held-back text is real output after
all. ``stop_sequence`` is the stop that ended the text, if one did.
"""

from __future__ import annotations

from collections.abc import Sequence

import tokenizers

from .detokenizer import IncrementalDetokenizer
from .stops import StopStringMatcher


class TextOutput:
    """Token ids in, text deltas out, stop strings applied (one per sequence)."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        context_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        stop_sequences: Sequence[str] = (),
        include_stop_sequence: bool = False,
    ) -> None:
        """``context_ids``: the last tokens before the generated ones (left context)."""
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, context_ids, skip_special_tokens=skip_special_tokens
        )
        self._stops = StopStringMatcher(stop_sequences, include_stop_sequence)
        self._no_stops = not stop_sequences
        self._include = include_stop_sequence
        self.stop_sequence = ""  # the stop string or stop token's text that ended the text

    @property
    def stopped(self) -> bool:
        """A stop string has matched: the text is over (call ``finish`` no more)."""
        return self._stops.matched is not None

    def add(self, token_id: int) -> str:
        """The text that ``token_id`` makes safe to stream (maybe "")."""
        if self._no_stops:  # most requests: the matcher would pass the text through
            return self._detokenizer.add((token_id,))
        text, matched = self._stops.feed(self._detokenizer.add((token_id,)))
        if matched is not None:
            self.stop_sequence = matched
        return text

    def finish(self) -> str:
        """At a finish other than a stop: the text still held back. A stop
        string completed by the detokenizer's tail still ends the text there
        (``stopped`` then says so)."""
        tail, matched = self._stops.feed(self._detokenizer.flush())
        if matched is not None:
            self.stop_sequence = matched
            return tail
        return tail + self._stops.flush()

    def finish_at_stop_token(self, token_text: str) -> str:
        """At a stop token (never detokenized itself): the text held back, and
        the token's text too if stop sequences are included in the output."""
        self.stop_sequence = token_text
        text = self._stops.flush() + self._detokenizer.flush()
        return text + token_text if self._include else text
