"""Incremental detokenization: generated token ids in, stable text deltas out.

Decoding one token at a time does not work: byte-level BPE splits multi-byte
UTF-8 characters (emoji, CJK) across tokens, and Metaspace/WordLevel decoders
decide spacing from a token's neighbours. Decoding the whole history each
step is correct but O(sequence length) per token.

So we decode a small window ``ids[prefix_offset:]`` (the tokens of the last
emitted delta plus the new ones). ``ids[prefix_offset:read_offset]`` is text
already emitted and serves as left context; the text it decodes to is a prefix
of the window's text, and whatever follows it is new. Offsets only move
forward when the window's text is stable (does not end in U+FFFD, i.e. no
character is waiting for more bytes), so the window stays a few tokens long;
while it ends in U+FFFD the text before that tail is still emitted, and a
window held for many tokens is re-anchored, so the cost per token is bounded
by constants, never by the sequence length.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import tokenizers

_REPLACEMENT = "\ufffd"
# Prompt tokens kept as left context for the first generated token.
_PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 character is at most 4 bytes, so it spans at most 4 tokens.
_MAX_CHAR_TOKENS = 4
# A window held on an unfinished character for more tokens than this is
# re-anchored (see ``_reanchor``), so the decode cost per token stays bounded.
_MAX_HELD_TOKENS = 8


class IncrementalDetokenizer:
    """Turns generated token ids into text, one delta per ``add`` call.

    The concatenation of everything ``add`` and ``flush`` return equals what
    ``tokenizer.decode`` gives for the generated ids decoded after the prompt
    (the prompt's last tokens are used as left context, so leading spaces come
    out as in a full decode). A delta never ends in a partial character; an
    incomplete character at the very end is only emitted (as U+FFFD) by
    ``flush``.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._decode_nonempty = functools.partial(
            tokenizer.decode, skip_special_tokens=skip_special_tokens
        )
        # Special tokens decode to nothing when skipped; dropping them up front
        # keeps them out of the window, so they never displace real context.
        self._skipped: frozenset[int] = (
            frozenset(
                token_id
                for token_id, added in tokenizer.get_added_tokens_decoder().items()
                if added.special
            )
            if skip_special_tokens
            else frozenset()
        )
        context = self._prompt_context(self._kept(prompt_token_ids))
        # The window: ids[0] is at prefix_offset; ids[:read] is already emitted.
        self._ids: list[int] = context
        self._read = len(context)
        self._prefix_len = len(self._decode(context))
        # Characters past ``_prefix_len`` already emitted while the window is
        # held on a trailing U+FFFD run (the text before the run is final).
        self._held_emitted = 0
        self._chunks: list[str] = []
        self._finished = False

    @property
    def text(self) -> str:
        """All text emitted so far (``add`` and ``flush`` deltas joined)."""
        return "".join(self._chunks)

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed newly generated ids; return only the new, stable text (maybe "")."""
        if self._finished:
            raise RuntimeError("IncrementalDetokenizer.add() after flush()")
        if len(token_ids) == 1:  # the common call: one decode step's token
            token_id = token_ids[0]
            return "" if token_id in self._skipped else self._emit(self._step(token_id))
        new_ids = self._kept(token_ids)
        if len(new_ids) > 1:
            # Fast path for a group: one decode when it ends on a whole character.
            window = self._decode(self._ids + new_ids)
            start = self._prefix_len + self._held_emitted
            if len(window) > start and not window.endswith(_REPLACEMENT):
                self._ids.extend(new_ids)
                self._advance()
                return self._emit(window[start:])
        # Token by token, so the window can advance at every token boundary
        # where the text is whole, not only at the group's end.
        return self._emit("".join([self._step(token_id) for token_id in new_ids]))

    def _step(self, token_id: int) -> str:
        self._ids.append(token_id)
        window = self._decode_nonempty(self._ids)
        start = self._prefix_len + self._held_emitted
        held_tokens = len(self._ids) - self._read
        if window.endswith(_REPLACEMENT):
            # A character may still be completed by the next tokens: emit the
            # final text before the trailing U+FFFD run, hold the run.
            delta = window[start : len(window.rstrip(_REPLACEMENT))]
            self._held_emitted += len(delta)
            if held_tokens > _MAX_HELD_TOKENS:
                delta += self._reanchor(window)
            return delta
        if len(window) <= start and held_tokens <= _MAX_HELD_TOKENS:
            # Nothing new yet (the token decodes to nothing on its own): keep
            # the window, so the next token is decoded with its context.
            return ""
        self._advance()
        return window[start:]

    def _reanchor(self, window: str) -> str:
        """Shrink a window that has ended inside a character for many tokens.

        Byte-level BPE tokens can straddle characters (CJK runs), so possibly
        no token boundary in a long run ends a whole character. Restart the
        window at a recent token ``q`` instead: its text may begin with junk
        U+FFFD (bytes of a character that started before ``q``), but once a
        real character decodes the same in both, the rest decodes the same,
        so the held tail lines up at the end of both texts.
        """
        held = window[self._prefix_len + self._held_emitted :]  # the trailing U+FFFD run
        anchor = window[-len(held) - 1 : -len(held)]  # the real character before it
        if anchor and anchor != _REPLACEMENT:
            for q in range(len(self._ids) - _MAX_CHAR_TOKENS, self._read, -1):
                text = self._decode(self._ids[q:])
                if text.endswith(held) and text[-len(held) - 1 : -len(held)] == anchor:
                    self._ids = self._ids[q:]
                    self._read = 0
                    self._prefix_len = 0
                    self._held_emitted = len(text) - len(held)
                    return ""
        # The run is all U+FFFD for this long: invalid bytes or U+FFFD itself
        # as text, not one unfinished character. Take it as final.
        self._advance()
        return held

    def flush(self) -> str:
        """At finish: emit whatever is still held back (an incomplete character as U+FFFD).

        Further ``add`` calls raise ``RuntimeError``; a second ``flush`` returns "".
        """
        if self._finished:
            return ""
        self._finished = True
        if len(self._ids) == self._read:
            return ""
        window = self._decode(self._ids)
        delta = window[self._prefix_len + self._held_emitted :]
        self._advance()
        return self._emit(delta)

    def _advance(self) -> None:
        # The tokens read so far become the next window's left context.
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        self._prefix_len = len(self._decode(self._ids))
        self._held_emitted = 0

    def _emit(self, delta: str) -> str:
        if delta:
            self._chunks.append(delta)
        return delta

    def _prompt_context(self, prompt: list[int]) -> list[int]:
        """The prompt's last few tokens, starting at a token that begins a character.

        A window starting inside a character decodes to U+FFFD there, and
        byte-fallback decoders then garble the whole run of byte tokens.
        """
        start = max(0, len(prompt) - _PROMPT_CONTEXT_TOKENS)
        for q in range(start, max(-1, start - _MAX_CHAR_TOKENS), -1):
            if not self._decode(prompt[q:]).startswith(_REPLACEMENT):
                return prompt[q:]
        return prompt[start:]

    def _kept(self, token_ids: Sequence[int]) -> list[int]:
        if not self._skipped:
            return list(token_ids)
        return [t for t in token_ids if t not in self._skipped]

    def _decode(self, ids: list[int]) -> str:
        return self._decode_nonempty(ids) if ids else ""
