"""The proposer seam of speculative decoding (docs/design.md, "Speculative decoding").

A proposer guesses the next tokens of the sequences of a step; the engine
checks every guess with the target model (``Speculation.accept``) and keeps
the tokens a plain decode would have picked. So a proposer decides how many
tokens a step yields, never which. Two ship: ``PromptLookup`` (n-grams of
the sequence's own context) and ``DraftModel`` (a second, cheaper model).
An MTP or EAGLE head would be a third: it would read the target's hidden
states of the step (a runner output this interface does not carry yet),
keep its own per-sequence state keyed by ``seq_id`` as ``DraftModel`` keeps
its KV, and roll it back in ``accepted``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from ..sequence import Sequence as Seq

MAX_BACKOFF_STEPS = 16  # prompt lookup's: its guesses cost nothing to make


@dataclass(frozen=True)
class DraftWant:
    """A sequence that may speculate this step, and how many tokens it may take:
    every kept guess and the token after them must fit its ``max_new_tokens``
    and the context."""

    seq: Seq
    limit: int


class Proposer(ABC):
    """Contract: ``propose`` returns ``seq_id -> guess`` for some of ``wants``,
    each guess 1 to ``want.limit`` tokens meant to follow ``want.seq.token_ids``
    (a sequence with no guess, or backing off, is left out). After the target
    checked a guess, ``accepted(seq, n)`` says that its first ``n`` tokens were
    kept (``seq.token_ids`` then ends with them and one more token, or the
    sequence finished); state kept for the rejected rest must be dropped there.
    ``forget(seq_id)``: the sequence ended or its context changed other than by
    appending (a context slide); ``park(seq)``: its session turn ended with
    ``seq.token_ids`` as the history, which its next turn starts with.
    """

    name: str  # the ``proposer`` label of the spec_* counters

    @abstractmethod
    def propose(self, wants: Sequence[DraftWant]) -> dict[int, list[int]]: ...

    @abstractmethod
    def accepted(self, seq: Seq, n: int) -> None: ...

    @abstractmethod
    def forget(self, seq_id: int) -> None: ...

    def park(self, seq: Seq) -> None:
        """Keep what would help the session's next turn (default: nothing)."""
        self.forget(seq.seq_id)


class Backoff:
    """A check of a guess costs more than a plain decode step, so a sequence
    whose guesses keep failing stops guessing for 1, 2, 4 ... up to
    ``max_steps`` steps after each guess of which nothing was kept."""

    def __init__(self, max_steps: int = MAX_BACKOFF_STEPS) -> None:
        self.max_steps = max_steps
        self._state: dict[int, tuple[int, int]] = {}  # seq_id -> (steps left, last span)

    def pausing(self, seq_id: int) -> bool:
        """Whether ``seq_id`` skips this step (counts the step down)."""
        left, span = self._state.get(seq_id, (0, 0))
        if not left:
            return False
        self._state[seq_id] = (left - 1, span)
        return True

    def record(self, seq_id: int, accepted: int) -> None:
        if accepted:
            self._state.pop(seq_id, None)
            return
        _, span = self._state.get(seq_id, (0, 0))
        span = min(self.max_steps, 2 * span or 1)
        self._state[seq_id] = (span, span)

    def forget(self, seq_id: int) -> None:
        self._state.pop(seq_id, None)
