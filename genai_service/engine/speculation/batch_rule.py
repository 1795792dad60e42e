"""Whether speculating pays at a batch size above one (docs/design.md,
"Speculative decoding", the batch rule), measured while serving.

A speculating step costs the proposers' guesses plus a check of every
speculating sequence's last token and guess; it pays when the tokens it
yields come faster than plain decode steps give them. At one sequence a
guess that keeps failing is caught per sequence (``proposer.Backoff``). With
several, what a step costs grows with its rows in ways the sequences cannot
see (a draft's int8-activation matmuls turn compute-bound, a check of B x
(N + 1) tokens costs far more than one of N + 1), and sampled guesses are
accepted less often than greedy ones: on the default model's fp32 + int4 pair
at four streams, greedy speculation at every step ran at 1.02-1.03x of plain
decoding but sampled at 0.78-0.82x (docs/benchmarks.md). So for each batch
size B from 2 up to ``--speculate-max-batch``, and each count of its
sequences that sample (greedy guesses are accepted far more often), the
engine times both kinds of decode-only step and speculates only while that
is the faster one, in generated tokens per second of step wall time.

Each kind is timed over bursts of ``BURST`` steps (a burst's tokens over its
seconds; a kind's rate is the mean of its last burst and its earlier rate).
The first speculating step after plain ones, or after the batch's sequences
changed, is not timed when the draft model catches up in it (on the tokens
of those plain steps, or a new sequence's prompt): a switch pays that once, steady
speculation never; any other catch-up (after a sequence backed off, or after
prompt lookup guessed for it) is speculation's own cost and is timed.
Speculation runs first; then a burst of plain steps; from then on the
faster kind runs, and the other is tried again (a burst of its steps) once
the chosen one has run for ``patience`` times what the other's last try took
(16 times after the choice changes, doubled each time a try confirms it, so
32 once speculation has won its first, up to 256 times), or at once when the
chosen kind's rate falls ``MARGIN`` below the other's; the other takes over
only when that much faster. A try that gets fewer than ``BURST`` timed steps
in ``MAX_TRY_STEPS`` ends undecided. What pays moves with the requests'
sampling, acceptance and context length. The tokens are those of a plain
decode whichever kind a step is: the rule decides only how fast they come.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog

from ...config import check_batch_rule

BURST = 8  # timed steps of one kind that one measurement of its rate spans
MAX_TRY_STEPS = 4 * BURST  # a try with fewer timed steps than BURST by then ends undecided
# Between tries of the kind not chosen, the chosen one runs for this many
# times what the last try of the other took (doubled each time the same kind
# wins again, up to MAX_PATIENCE): a try of losing speculation then costs a
# few per cent of the time at first and well under one later. (At 4 streams
# on the default fp32 model a try of speculation takes ~1.2 s, of plain
# steps ~0.25 s.)
FIRST_PATIENCE = 16
MAX_PATIENCE = 256
# The other kind takes over only when it is this much faster (and the chosen
# kind's rate prompts an early try only when this much slower): where the
# two are nearly equal (greedy at 4 streams), every switch costs a try and
# the draft's catch-up, and noise alone would switch back and forth.
MARGIN = 1.05

log = structlog.get_logger(__name__)


@dataclass
class _Burst:
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0


@dataclass
class _AtBatch:
    """What one batch size (and count of sampling sequences) measured and chose."""

    rate: dict[bool, float] = field(default_factory=dict)  # speculating? -> tokens/s
    bursts: dict[bool, _Burst] = field(default_factory=lambda: {True: _Burst(), False: _Burst()})
    cost: dict[bool, float] = field(default_factory=dict)  # kind -> seconds its last try took
    choice: bool = True  # speculate
    trying: bool = False  # the kind not chosen is being measured
    steps: int = 0  # steps of the try (or of the first measuring) so far
    spent: float = 0.0  # timed seconds of the try (or of the first measuring) so far
    since: float = 0.0  # seconds of steps of the chosen kind since the last try
    patience: int = FIRST_PATIENCE

    @property
    def first(self) -> bool:
        """Speculation is being measured for the first time (no try yet)."""
        return not self.cost


class BatchRule:
    """``speculate(batch, sampled)``: whether a decode-only step of ``batch``
    sequences (at most ``--speculate-max-batch``), ``sampled`` of which
    sample, should guess; ``observe`` then gets what the step did.
    ``always``: every such step guesses (the rule of
    ``--speculate-batch-rule always``, and of one sequence in any case)."""

    def __init__(self, rule: str = "measured") -> None:
        check_batch_rule(rule)
        self.always = rule == "always"
        self._at: dict[tuple[int, int], _AtBatch] = {}

    def speculate(self, batch: int, sampled: int = 0) -> bool:
        if self.always or batch < 2:
            return True
        at = self._at.get((batch, sampled))
        return True if at is None else at.choice != at.trying

    def observe(
        self,
        batch: int,
        sampled: int,
        speculated: bool,
        tokens: int,
        seconds: float,
        timed: bool = True,
    ) -> None:
        """A decode-only step of ``batch`` sequences (``sampled`` of them
        sampling) of the kind ``speculate`` asked for (``speculated``)
        generated ``tokens`` in ``seconds``; ``timed``: it counts toward its
        kind's rate (not a draft's catch-up)."""
        if self.always or batch < 2:
            return
        at = self._at.setdefault((batch, sampled), _AtBatch())
        if at.first or at.trying:
            at.steps += 1
            at.spent += seconds if timed else 0.0
        else:
            at.since += seconds
        if timed:
            burst = at.bursts[speculated]
            burst.steps += 1
            burst.tokens += tokens
            burst.seconds += seconds
            if burst.steps >= BURST:
                self._measured(batch, sampled, at, speculated)
                return
        if at.trying and at.steps >= MAX_TRY_STEPS:  # too few of its steps timed: give up
            at.trying = False
            at.since = 0.0
        elif not (at.first or at.trying) and at.since >= at.patience * at.cost.get(
            not at.choice, 0.0
        ):
            self._try(at)

    def _measured(self, batch: int, sampled: int, at: _AtBatch, kind: bool) -> None:
        """A burst of ``kind`` is complete: its rate, then what follows."""
        burst = at.bursts[kind]
        rate = burst.tokens / burst.seconds if burst.seconds > 0 else 0.0
        before = at.rate.get(kind)
        at.rate[kind] = rate if before is None else (before + rate) / 2
        at.bursts[kind] = _Burst()
        other = not at.choice
        if at.first:  # speculation measured: try plain steps next
            at.cost[kind] = at.spent
            self._try(at)
        elif at.trying and kind == other:
            self._decide(batch, sampled, at)
        elif at.rate[kind] * MARGIN < at.rate.get(other, 0.0):
            self._try(at)  # the chosen kind fell below the other's rate: try that again

    @staticmethod
    def _try(at: _AtBatch) -> None:
        """Run the kind not chosen for a burst, to measure it again."""
        at.trying = True
        at.steps = 0
        at.spent = 0.0
        at.bursts[not at.choice] = _Burst()

    @staticmethod
    def _decide(batch: int, sampled: int, at: _AtBatch) -> None:
        """A try of the kind not chosen measured it: keep the faster one."""
        other = not at.choice
        at.cost[other] = at.spent
        if at.rate[other] > MARGIN * at.rate.get(at.choice, 0.0):
            at.choice = other
            at.patience = FIRST_PATIENCE
            log.info(
                "speculation_batch_rule",
                batch=batch,
                sampled=sampled,
                speculate=at.choice,
                speculating_tok_s=round(at.rate.get(True, 0.0), 1),
                plain_tok_s=round(at.rate.get(False, 0.0), 1),
            )
        else:
            at.patience = min(MAX_PATIENCE, 2 * at.patience)
        at.trying = False
        at.spent = 0.0
        at.since = 0.0
