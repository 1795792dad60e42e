"""Draft-model guesses: a second, cheaper model proposes the next tokens.

The draft (``--draft-model DIR``: any model directory the server loads) has
its own runner, slots and KV, keyed by the target's ``seq_id``s. It learns
a sequence's tokens lazily: when the sequence may speculate, the draft is
fed what it has not seen yet (the whole prompt the first time, in chunks of
at most ``catchup_tokens`` per step; after a check usually one or two
tokens), then decodes its guess one token at a time (each picked as the
target would pick, ``DraftModel``), all speculating sequences batched in
each call, up to N tokens or until the draft is unsure of one (its
probability under ``min_confidence``, greedy guesses only: that token is the
guess's last; in a call of several sequences, once every one is unsure). After
the target's check, ``accepted`` cuts
the draft's KV back to the tokens the sequence really has, as the target's
is cut. A session turn's draft KV is parked here in host memory, by session
id (never in the kvstore, never under the target's chunk keys), and written
back for the next turn as far as the new context begins with it; an LRU
bounded by bytes (a second ``--max-parked-kv-bytes``, beside the target's)
drops what does not fit (its next turn re-feeds the draft), and a session's
reset, close or expiry drops its entry (``forget_session``).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import structlog

from ..kv.prefix_cache import KvLayers
from ..runner.step_item import StepItem
from ..sequence import Sequence as Seq
from .proposer import Backoff, DraftWant, Proposer

if TYPE_CHECKING:
    from ..runner.model_runner import ModelRunner

log = structlog.get_logger(__name__)


def _kv_nbytes(layers: KvLayers) -> int:
    return sum(k.nbytes + v.nbytes for k, v in layers)


# (seq, the draft's logits [vocab; for a sampled request the target's width], the
# guesses so far, a copy of the sequence's generator) -> the guess:
# ``TokenPicker.guess_after``.
_UNUSED_RNG = np.random.default_rng(0)  # what greedy rows get (they draw nothing)
# A failed guess costs up to N draft steps and a check (~0.9 of a target step for a
# 4-layer draft at N = 5, more for a larger one), not a free lookup: back off
# up to 64 steps, so a draft that never agrees costs ~1.5 % (16 steps: ~5 %,
# measured 0.93x of no speculation through the server).
DRAFT_MAX_BACKOFF_STEPS = 64
GuessPicker = Callable[[Seq, np.ndarray, list[int], np.random.Generator], int]


def guess_probability(row: np.ndarray, token: int) -> float:
    """The draft's probability of ``token`` from ``row`` (its logits): what
    the confidence stop of a greedy guess reads. The request's penalties and
    constraint are left out: it only decides how long a guess is, never which
    tokens come out."""
    with np.errstate(invalid="ignore", over="ignore"):  # inf or NaN logits: NaN, unsure
        m = row.max()
        return float(np.exp(row[token] - m) / np.exp(row - m).sum())


class DraftModel(Proposer):
    """Guesses of ``runner`` (the draft model's), up to ``num_tokens`` long, each
    picked from the draft's logits as the target would pick from its own
    (``pick``: argmax for greedy requests; for sampled ones the request's sampler
    drawing from a copy of its generator, so a guess lands where the target's
    draw will land whenever the two models' distributions agree there). A
    greedy guess ends after a token to which the draft gives less than
    ``min_confidence`` (``guess_probability``): past a token the draft doubts,
    the target rarely keeps the rest, and each further guessed token costs a
    draft step (in a call of several sequences it goes on while another one is
    sure). After a
    guess rejected whole, the bound on the sequence's guesses halves, back to
    ``num_tokens`` once one is kept whole (``_span``): a draft that is
    confidently wrong there wastes few steps, while a good one keeps its long
    guesses."""

    name = "draft"

    def __init__(
        self,
        runner: ModelRunner,
        *,
        model_id: str,
        num_tokens: int,
        target_vocab: int,
        draft_vocab: int,
        max_len: int,
        catchup_tokens: int,
        parked_bytes: int,
        pick: GuessPicker | None = None,
        min_confidence: float = 0.0,
    ) -> None:
        self.runner = runner
        self.pick = pick
        self.min_confidence = min_confidence
        self.model_id = model_id
        self.num_tokens = num_tokens
        self.target_vocab = target_vocab  # guesses stop before an id the target lacks
        self.draft_vocab = draft_vocab  # a sequence holding an id the draft lacks never guesses
        self.max_len = max_len  # the draft's context (its KV buffers' length)
        self.catchup_tokens = catchup_tokens  # draft prefill tokens per step, all sequences
        self.parked_bytes = parked_bytes
        self.backoff = Backoff(DRAFT_MAX_BACKOFF_STEPS)
        # seq_id -> its guess being checked: (len(token_ids) at the guess, its length).
        self._checking: dict[int, tuple[int, int]] = {}
        # seq_id -> the most its next guess may be, when less than num_tokens
        # (halved by a guess of which nothing was kept, N again once one is kept whole).
        self._span: dict[int, int] = {}
        self._outside: set[int] = set()  # sequences holding an id the draft cannot embed
        # session id -> (the tokens the KV is of, their KV); LRU by bytes.
        self._parked: OrderedDict[str, tuple[tuple[int, ...], KvLayers]] = OrderedDict()
        self._parked_total = 0
        self.steps = 0  # draft model calls (for tests and the bench's cost model)
        self.catchup_fed = 0  # tokens fed to catch up (prompts, session turns)

    def propose(self, wants: Sequence[DraftWant]) -> dict[int, list[int]]:
        """Guesses for ``wants``; if the draft's runner fails, none this step (the
        request goes on without them): the sequences it was computing lose their
        draft KV and back off (``failed``), the others keep theirs."""
        touched: list[int] = []  # sequences whose draft KV this call writes
        try:
            return self._propose(wants, touched)
        except Exception:
            log.exception("draft_model_failed", seqs=[w.seq.request_id for w in wants])
            for sid in touched:
                self.failed(sid)
            return {}

    def _propose(self, wants: Sequence[DraftWant], touched: list[int]) -> dict[int, list[int]]:
        budget = self.catchup_tokens
        feeds: list[tuple[Seq, list[int], int]] = []  # (seq, tokens to feed, limit)
        for want in wants:
            seq = want.seq
            limit = min(self._span.get(seq.seq_id, self.num_tokens), want.limit)
            tokens = seq.token_ids
            if limit <= 0 or len(tokens) + limit > self.max_len:
                continue
            if seq.seq_id in self._outside or self.backoff.pausing(seq.seq_id):
                continue
            touched.append(seq.seq_id)
            held = self._held(seq)
            todo = list(tokens[held:])  # at least the last token (its KV is never held)
            if max(todo) >= self.draft_vocab:
                # A target whose logits are wider than the draft's embedding picked
                # an id the draft cannot read: no guesses for this sequence again.
                self._outside.add(seq.seq_id)
                self.runner.release(seq.seq_id)
                continue
            if len(todo) > 1:
                if len(todo) - 1 > budget:
                    # Too far behind for this step: feed a chunk of the rest, no guess yet.
                    if budget > 0:
                        self._feed_chunk(seq, todo[:budget], held)
                        budget = 0
                    continue
                budget -= len(todo) - 1
            feeds.append((seq, todo, limit))
        if not feeds:
            return {}
        rows = self._catch_up(
            [(seq.seq_id, todo, len(seq.token_ids) - len(todo)) for seq, todo, _ in feeds]
        )
        # Each sampled sequence's generator, copied: the target's check draws
        # from the real one, one pick's draws per picked token (as many at
        # every pick of a row of the target's width: ``_target_width``), from
        # this same state (greedy rows draw nothing).
        rngs = {
            seq.seq_id: copy.deepcopy(seq.rng)
            for seq, _, _ in feeds
            if self.pick and not seq.request.sampling.greedy
        }
        guesses: dict[int, list[int]] = {}
        unsure: set[int] = set()  # sequences the draft doubted a token of
        for (seq, _, _), row in zip(feeds, rows, strict=True):
            guesses[seq.seq_id] = [self._guess(seq, row, [], rngs, unsure)]
        for j in range(1, max(limit for _, _, limit in feeds)):
            going = [
                seq
                for seq, _, limit in feeds
                if j < limit and guesses[seq.seq_id][-1] < self.target_vocab
            ]
            # A doubted token ends its sequence's guess, but while another
            # sequence of the call still guesses, the draft call runs anyway
            # and the doubting ones ride along (their check is padded to the
            # longest guess too): the call stops once every one doubts.
            if all(seq.seq_id in unsure for seq in going):
                break
            items = [self._step(seq, guesses[seq.seq_id][-1]) for seq in going]
            logits = self.runner.run(items)
            self.steps += 1
            for seq, row in zip(going, logits, strict=True):
                token = self._guess(seq, row, guesses[seq.seq_id], rngs, unsure)
                guesses[seq.seq_id].append(token)
        out: dict[int, list[int]] = {}
        for seq, _, _ in feeds:
            sid, guess = seq.seq_id, guesses[seq.seq_id]
            cut = next((i for i, t in enumerate(guess) if t >= self.target_vocab), len(guess))
            self._checking[sid] = (len(seq.token_ids), cut)
            if cut:
                out[sid] = guess[:cut]
        return out

    def _guess(
        self,
        seq: Seq,
        row: np.ndarray,
        pending: list[int],
        rngs: dict[int, np.random.Generator],
        unsure: set[int],
    ) -> int:
        """The next guessed token from ``row``; for a greedy request ``seq`` joins
        ``unsure`` when the draft gives that token less than ``min_confidence``."""
        greedy = seq.request.sampling.greedy
        if self.pick is None:
            token = int(np.argmax(row))
        elif greedy:
            token = self.pick(seq, row, pending, _UNUSED_RNG)
        else:
            token = self.pick(seq, self._target_width(row), pending, rngs[seq.seq_id])
        # Greedy guesses only: a sampled guess lands on the target's token about
        # as often whatever the draft gave it (the coupled race, docs/design.md,
        # "Speculative decoding"), so stopping at a doubted one only shortens it.
        # (A rider stays doubted; ``not >=``: a NaN probability, logits the
        # draft got wrong, ends it too.)
        if (
            self.min_confidence
            and greedy
            and seq.seq_id not in unsure
            and not guess_probability(row, token) >= self.min_confidence
        ):
            unsure.add(seq.seq_id)
        return token

    def _target_width(self, row: np.ndarray) -> np.ndarray:
        """``row`` cut or padded (-inf: no mass) to the target's logits width: the
        sampler's draws per pick depend on the row's width, so a sampled guess
        from a row of another width would fall out of step with the target's
        draws after its first token (tokens unchanged, far fewer kept). Ids
        past the target's vocabulary could not be checked anyway."""
        v = self.target_vocab
        if row.shape[0] == v:
            return row
        if row.shape[0] > v:
            return row[:v]
        out = np.full(v, -np.inf, dtype=row.dtype)
        out[: row.shape[0]] = row
        return out

    def _step(self, seq: Seq, token: int) -> StepItem:
        return StepItem(seq.seq_id, (token,), self.runner.kv_len(seq.seq_id))

    def _held(self, seq: Seq) -> int:
        """Tokens of ``seq`` whose draft KV is held (a session's parked KV
        written back on its first guess), never its last token."""
        runner, sid = self.runner, seq.seq_id
        held = runner.kv_len(sid)
        if not held and seq.session is not None:
            held = self._restore(seq)
        last = len(seq.token_ids) - 1
        if held > last:
            runner.truncate(sid, last)
            held = last
        return held

    def _catch_up(self, feeds: list[tuple[int, list[int], int]]) -> list[np.ndarray]:
        """Feed each ``(seq_id, tokens, start)``; the logits after each one's last token."""
        items = [StepItem(sid, tokens, start) for sid, tokens, start in feeds]
        self.catchup_fed += sum(len(t) - 1 for _, t, _ in feeds)
        self.steps += 1
        longest = max(len(t) for _, t, _ in feeds)
        if longest == 1 or len(items) == 1 or not self.runner.can_verify:
            return list(self.runner.run(items))
        if longest <= self.num_tokens + 2:
            # One padded call for all rows (a prefill path would be one call each).
            return [rows[-1] for rows in self.runner.verify_batch(items)]
        return list(self.runner.run(items))

    def _feed_chunk(self, seq: Seq, tokens: list[int], start: int) -> None:
        self.runner.run([StepItem(seq.seq_id, tokens, start)])
        self.steps += 1
        self.catchup_fed += len(tokens)

    def accepted(self, seq: Seq, n: int) -> None:
        """Keep the draft KV of the tokens ``seq`` really has: its context at the
        guess and the ``n`` guessed tokens kept (the token after them was not fed)."""
        sid = seq.seq_id
        self.backoff.record(sid, n)
        at, length = self._checking.pop(sid, (None, 0))
        if length and not n:  # nothing kept: the bound halves
            self._span[sid] = max(1, self._span.get(sid, self.num_tokens) // 2)
        elif length and n >= length:  # kept whole: the draft is right here again
            self._span.pop(sid, None)
        held = self.runner.kv_len(sid)
        if at is not None and held > at + n:
            self.runner.truncate(sid, at + n)

    def forget(self, seq_id: int) -> None:
        self.runner.release(seq_id)
        self.backoff.forget(seq_id)
        self._checking.pop(seq_id, None)
        self._span.pop(seq_id, None)
        self._outside.discard(seq_id)

    def failed(self, seq_id: int) -> None:
        """The draft's runner failed while computing ``seq_id``: its draft KV may
        be half-written, so it is dropped, and the sequence backs off as after a
        guess of which nothing was kept (a draft that keeps failing is seldom asked)."""
        self.runner.release(seq_id)
        self._checking.pop(seq_id, None)
        self.backoff.record(seq_id, 0)

    def forget_session(self, session_id: str) -> None:
        """The session was reset, closed or dropped: its parked draft KV goes too."""
        self._drop_parked(session_id)

    # -- sessions ---------------------------------------------------------------------

    def park(self, seq: Seq) -> None:
        """Keep ``seq``'s draft KV for its session's next turn, as far as the
        session's history (a reset or rewind may have cut it meanwhile) begins
        with ``seq``'s tokens, then free its slot."""
        session, sid = seq.session, seq.seq_id
        if session is None:
            self.forget(sid)
            return
        h = len(session.history)
        held = min(self.runner.kv_len(sid), h)
        if list(seq.token_ids[:h]) != list(session.history):
            held = 0
        if held and self.parked_bytes:
            layers = self.runner.read_kv(sid, 0, held)
            self._drop_parked(session.session_id)
            self._parked[session.session_id] = (tuple(seq.token_ids[:held]), layers)
            self._parked_total += _kv_nbytes(layers)
            while self._parked_total > self.parked_bytes and self._parked:
                self._drop_parked(next(iter(self._parked)))
        self.forget(sid)

    def _restore(self, seq: Seq) -> int:
        """Write back the parked draft KV of ``seq``'s session as far as its tokens
        begin with the parked ones; returns the tokens held."""
        assert seq.session is not None
        entry = self._parked.get(seq.session.session_id)
        if entry is None:
            return 0
        self._drop_parked(seq.session.session_id)
        tokens, layers = entry
        n = min(len(tokens), len(seq.token_ids) - 1)
        common = next((i for i in range(n) if tokens[i] != seq.token_ids[i]), n)
        if common:
            self.runner.write_kv(seq.seq_id, [(k[:, :common], v[:, :common]) for k, v in layers])
        return common

    def _drop_parked(self, session_id: str) -> None:
        entry = self._parked.pop(session_id, None)
        if entry is not None:
            self._parked_total -= _kv_nbytes(entry[1])

    @property
    def parked_sessions(self) -> int:
        return len(self._parked)
