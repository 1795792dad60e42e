"""The context window's slide (docs/design.md, "Context window").

Under ``CONTEXT_OVERFLOW_SLIDE`` a sequence that reaches the window drops its
oldest tokens after the first ``sinks`` (attention sinks, never dropped), a
block at a time, and goes on. The kept tokens keep contiguous positions from
0: the model sees a context like the ones it was trained on. How the kept KV
gets there is the runner's ``shift`` (keys rotated by the shift) or, where the
graph's rotary tables are unknown, a recompute of the kept tokens.

Plain Python; the engine applies a ``SlidePolicy``'s answer to the sequence,
the runner and the prefix bookkeeping.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from genai_common.errors import InvalidArgument


@dataclass(frozen=True)
class SlidePolicy:
    """``window`` positions; the first ``sinks`` kept; a slide drops at least
    ``block`` tokens, and more so that what stays ends on a multiple of
    ``chunk`` (the KV chunk size) where one fits: a session's complete chunks
    then hold only KV computed before the slide, its tail only KV computed after."""

    window: int
    sinks: int
    block: int
    chunk: int

    @classmethod
    def make(cls, window: int, sinks: int, block: int | None, chunk: int) -> SlidePolicy:
        """The policy for a window; ``block`` None: a quarter of it. ValueError
        when no slide could leave room (the flags do not fit the window)."""
        block = max(1, window // 4) if block is None else block
        if sinks + block >= window - 1:
            raise ValueError(
                f"context slide: {sinks} sink tokens + {block} tokens per slide leave no "
                f"room in a {window}-token window (--sink-tokens, --context-slide-tokens)"
            )
        return cls(window, sinks, block, chunk)

    @property
    def kept(self) -> int:
        """Tokens left after a slide of a full window."""
        target = self.window - self.block
        aligned = target // self.chunk * self.chunk
        return aligned if aligned > self.sinks else target

    def drop_for(self, n: int, keep_from: int) -> int:
        """Tokens to drop after the sinks of an ``n``-token context that must
        keep its tokens from ``keep_from`` on (a turn's new input, or the token
        about to be computed), so that it fits the window again."""
        drop = n - self.kept
        sinks = self.sinks_for(keep_from)
        if sinks + drop > keep_from:
            drop = keep_from - sinks
        if n - drop >= self.window:
            raise InvalidArgument(
                f"input: {n - keep_from} new tokens do not fit the {self.window}-token "
                f"context window with the {sinks} sink tokens kept"
            )
        return drop

    def sinks_for(self, keep_from: int) -> int:
        return min(self.sinks, keep_from)


def next_lineage(lineage: bytes, tokens: list[int], start: int, drop: int) -> bytes:
    """The lineage after keys were shifted: a digest of the one before, the
    whole context before the slide and what it dropped. Chunk keys chain from
    it (``KvReuse.namespace_of``): a slid sequence's KV is never taken for a
    fresh prompt's with the same tokens, yet a session restored elsewhere,
    or forked, finds its own."""
    h = hashlib.blake2b(digest_size=16, person=b"genai-slide")
    h.update(lineage)
    h.update(np.asarray([start, drop, len(tokens)], np.uint64).tobytes())
    h.update(np.asarray(tokens, np.uint32).tobytes())
    return h.digest()
