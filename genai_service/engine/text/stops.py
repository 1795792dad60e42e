"""Stop strings matched on streamed, detokenized text.

Text arrives in arbitrary chunks (one detokenizer delta per step), and a stop
string may straddle chunks. Streamed text must never show part of a stop
string, so the matcher holds back the longest tail of the text that could
still grow into one, and releases it once it cannot (or at ``flush``).

Which stop wins: the one completed first in the text stream (the smallest end
position), and of those ending there, the longest (it starts earliest). This
depends only on the text, never on how it was split into chunks, and the
engine can stop the moment a stop string is complete instead of generating
more to see whether a longer one would have matched.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Finds the first stop string in streamed text; holds back possible partial matches."""

    def __init__(self, stop_sequences: Sequence[str], include_stop_sequence: bool = False) -> None:
        if any(not stop for stop in stop_sequences):
            raise ValueError("stop_sequences must not contain an empty string")
        # Longest first, so that among stops ending at the same position the
        # longest is found first by the strict ``<`` comparison in ``feed``.
        self._stops = sorted(set(stop_sequences), key=len, reverse=True)
        self._include = include_stop_sequence
        # Every proper prefix of a stop: the tails worth holding back.
        self._prefixes = {stop[:i] for stop in self._stops for i in range(1, len(stop))}
        self._first_chars = {stop[0] for stop in self._stops}
        self._max_hold = max((len(stop) - 1 for stop in self._stops), default=0)
        # Held-back text: a proper prefix of some stop, at most _max_hold chars.
        self._pending = ""
        self._matched: str | None = None

    @property
    def matched(self) -> str | None:
        """The stop string that matched, or None."""
        return self._matched

    def feed(self, text: str) -> tuple[str, str | None]:
        """Take new text; return (text safe to stream now, the matched stop or None).

        After a match the text following the stop is dropped and further
        feeds raise ``RuntimeError``.
        """
        if self._matched is not None:
            raise RuntimeError("StopStringMatcher.feed() after a stop sequence matched")
        if not self._stops:
            return text, None
        # No stop can start in text already streamed: everything before
        # ``_pending`` was released because it could not begin a stop.
        buf = self._pending + text
        best_end = len(buf) + 1
        best: str | None = None
        for stop in self._stops:
            # The first occurrence of a stop is also its earliest end.
            i = buf.find(stop)
            if i >= 0 and i + len(stop) < best_end:
                best_end, best = i + len(stop), stop
        if best is not None:
            self._matched = best
            self._pending = ""
            return buf[: best_end if self._include else best_end - len(best)], best
        hold = self._hold_start(buf)
        self._pending = buf[hold:]
        return buf[:hold], None

    def flush(self) -> str:
        """At finish without a match: release the held-back tail (after a match: "")."""
        tail, self._pending = self._pending, ""
        return tail

    def _hold_start(self, buf: str) -> int:
        """Start of the longest suffix of ``buf`` that is a proper prefix of a stop."""
        for start in range(max(0, len(buf) - self._max_hold), len(buf)):
            if buf[start] in self._first_chars and buf[start:] in self._prefixes:
                return start
        return len(buf)
