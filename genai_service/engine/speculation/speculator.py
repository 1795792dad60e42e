"""Speculative decoding in the engine: which sequences of a step guess, whose
guess each takes, and the tokens kept of each guess once the target model
has checked it (docs/design.md, "Speculative decoding").

The engine feeds a sequence's last token plus its guess in one step and
keeps every guessed token the target itself would have chosen
(``follow_draft``): the same tokens as without speculation, up to the
rounding of a several-token step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import structlog

from ...config import SpeculationConfig
from ...contract.request import RequestOutput, TokenLogprob, merge_outputs
from ..sampling_rows import TokenPicker
from ..sequence import SeqStatus
from ..sequence import Sequence as Seq
from .batch_rule import BatchRule
from .draft_model import DraftModel
from .prompt_lookup import PromptLookup
from .proposer import DraftWant, Proposer

if TYPE_CHECKING:
    from ..runner.model_runner import ModelRunner

T = TypeVar("T")
log = structlog.get_logger(__name__)


def follow_draft(
    draft: Sequence[int], rows: np.ndarray, choose: Callable[[np.ndarray, list[int]], tuple[int, T]]
) -> list[tuple[int, T]]:
    """Pick a token from each row of ``rows`` (the logits after the last token and
    after each draft token) in turn, ``choose(row, tokens picked so far)``, while
    the picks agree with ``draft``: the first pick that differs, or the one after
    the whole draft, is the last. Returns 1 to ``len(draft) + 1`` picks."""
    picks: list[tuple[int, T]] = []
    for j, row in enumerate(rows):
        picks.append(choose(row, [t for t, _ in picks]))
        if j == len(draft) or picks[-1][0] != draft[j]:
            break
    return picks


@dataclass(frozen=True)
class Draft:
    """A sequence's guess for this step and the proposer that made it."""

    tokens: list[int]
    proposer: Proposer


class Speculation:
    """The proposers of ``config.mode`` (``SpeculationConfig.resolved_mode``):
    ``prompt-lookup``; ``draft`` (``DraftModel``); ``auto``, the draft model
    with prompt lookup taking over for a sequence whose lookup guess is longer
    than the draft's ``num_tokens`` (it may guess twice as many: text that
    quotes its context)."""

    def __init__(
        self,
        config: SpeculationConfig,
        runner: ModelRunner,
        counters: Counter[str],
        draft: DraftModel | None = None,
    ) -> None:
        if not runner.can_verify:
            raise ValueError(
                "speculation: the graph returns only the last position's logits and has "
                "no num_logits_to_keep input (convert it again, or use --speculate 0)"
            )
        self.mode = config.resolved_mode
        self.num_tokens = config.num_tokens
        self.max_batch = config.max_batch
        self.rule = BatchRule(config.batch_rule)
        # What the batch rule measures of this step, if it decodes only (else
        # None): its batch size, how many of it sample, whether it guesses,
        # and whether it is timed (no catch-up of the draft's).
        self._decoding: tuple[int, int, bool, bool] | None = None
        # The last decode-only step the rule measured: its (batch, sampled)
        # and whether it speculated.
        self._last: tuple[tuple[int, int], bool] | None = None
        self.draft = draft if self.mode in ("draft", "auto") else None
        if self.mode in ("draft", "auto") and draft is None:
            raise ValueError(f"--speculative-mode {self.mode} needs a draft model")
        self.lookup = (
            PromptLookup(config, config.num_tokens * (2 if self.mode == "auto" else 1))
            if self.mode in ("prompt-lookup", "auto")
            else None
        )
        self.proposers: list[Proposer] = [p for p in (self.lookup, self.draft) if p is not None]
        self.runner = runner
        self.counters = counters
        if config.checks_several:
            # Several sequences' checks (and the draft's catch-up) in one call each.
            runners = [("target", runner)]
            if self.draft is not None:
                runners.append(("draft", self.draft.runner))
            for name, each in runners:
                why = each.prepare_verify_batch()
                if why is not None:
                    log.info("speculation_checks_one_sequence_per_call", model=name, reason=why)

    def drafts(self, items: Sequence[tuple[Seq, int]], context_length: int) -> dict[int, Draft]:
        """seq_id -> draft for the sequences of a step: only steps that decode
        alone (no prefill, no session commit) of at most ``max_batch``
        sequences; none for a Mirostat sequence (its mu moves with every pick,
        and a check picks past the tokens it keeps when one of them ends the
        request). A constrained sequence's draft is cut to the longest prefix
        its constraint accepts (``accept`` then masks each position as it picks).
        From 2 sequences up, ``rule`` says whether guessing pays at that batch
        size; ``observe`` tells it what the step did."""
        self._decoding = None
        if len(items) > self.max_batch:
            return {}
        if any(n != 1 or not s.output_ids or s.status is not SeqStatus.RUNNING for s, n in items):
            return {}
        measured = len(items) > 1 and not self.rule.always
        sampled = sum(not s.request.sampling.greedy for s, _ in items) if measured else 0
        if measured and not self.rule.speculate(len(items), sampled):
            self._decoding = (len(items), sampled, False, True)
            self.counters["spec_rule_plain_steps"] += 1
            return {}
        wants = []
        for seq, _ in items:
            # Every kept draft token and the token after them must fit the
            # request's max_new_tokens and the context.
            limit = min(
                seq.max_new_tokens - len(seq.output_ids) - 1,
                context_length - len(seq.token_ids) - 1,
            )
            if limit > 0 and seq.mirostat is None:
                wants.append(DraftWant(seq, limit))
        drafts: dict[int, Draft] = {}
        if self.lookup is not None:
            for sid, tokens in self.lookup.propose(wants).items():
                if self.draft is None or len(tokens) > self.draft.num_tokens:
                    drafts[sid] = Draft(tokens, self.lookup)
        timed = True
        if self.draft is not None:
            # (A draft whose runner fails gives no guesses: DraftModel.propose.)
            fed = self.draft.catchup_fed
            guessed = self.draft.propose([w for w in wants if w.seq.seq_id not in drafts])
            for sid, tokens in guessed.items():
                drafts[sid] = Draft(tokens, self.draft)
            # More than the token a check leaves each sequence, right after
            # plain steps (or a change of the batch's sequences): the catch-up
            # a switch to speculation pays once, not timed. (Any other is
            # speculation's own cost: after a back-off, or a lookup guess.)
            switched = self._last != ((len(items), sampled), True)
            timed = not switched or self.draft.catchup_fed - fed <= len(wants)
        if measured:
            self._decoding = (len(items), sampled, True, timed)
        for seq, _ in items:
            draft = drafts.get(seq.seq_id)
            if draft and seq.matcher is not None:
                keep = seq.matcher.validate_tokens(draft.tokens)
                if keep:
                    drafts[seq.seq_id] = Draft(draft.tokens[:keep], draft.proposer)
                else:
                    del drafts[seq.seq_id]
                    draft.proposer.accepted(seq, 0)
        return drafts

    @property
    def measuring(self) -> bool:
        """Whether the batch rule measures the step ``drafts`` last saw."""
        return self._decoding is not None

    def observe(self, tokens: int, seconds: float) -> None:
        """The step ``drafts`` last saw ran, generating ``tokens`` in
        ``seconds`` of wall time: the batch rule's measurement, when the step
        decoded only."""
        if self._decoding is not None:
            batch, sampled, speculated, timed = self._decoding
            self.rule.observe(batch, sampled, speculated, tokens, seconds, timed)
            self._last = ((batch, sampled), speculated)
            self._decoding = None

    def accept(
        self,
        seq: Seq,
        draft: Draft,
        rows: np.ndarray,
        picker: TokenPicker,
        append: Callable[[Seq, int, TokenLogprob | None], RequestOutput],
    ) -> RequestOutput:
        """Pick tokens from ``rows`` as a plain decode would (``picker``, in
        ``follow_draft``), ``append`` them one by one, and keep the KV of the
        agreed draft tokens only. Returns the step's tokens as one output."""
        tokens = draft.tokens
        chosen = follow_draft(tokens, rows, lambda row, picked: picker.pick_after(seq, row, picked))
        kept = len(chosen) - 1
        name = draft.proposer.name
        self.counters["spec_guesses"] += 1
        self.counters["spec_draft_tokens"] += len(tokens)
        self.counters["spec_accepted_tokens"] += kept
        self.counters[f"spec_guesses.{name}"] += 1
        self.counters[f"spec_draft_tokens.{name}"] += len(tokens)
        self.counters[f"spec_accepted_tokens.{name}"] += kept
        draft.proposer.accepted(seq, kept)
        start = seq.num_computed
        out: RequestOutput | None = None
        for j, picked in enumerate(chosen):
            # Every token but the last one is computed, as in a plain decode
            # (the runner may hold more until the trim below; KvReuse reads
            # only up to num_computed).
            seq.num_computed = start + 1 + j
            step = append(seq, *picked)
            out = step if out is None else merge_outputs(out, step)
            if seq.finish_reason is not None or seq.status is SeqStatus.FINISHED:
                break  # finished, or failed (``LLMEngine._fail``)
        if self.runner.kv_len(seq.seq_id) > seq.num_computed:  # unless released
            self.runner.truncate(seq.seq_id, seq.num_computed)  # drop rejected drafts' KV
        assert out is not None  # rows always has at least one row
        return out

    def forget(self, seq_id: int) -> None:
        for proposer in self.proposers:
            proposer.forget(seq_id)

    def park(self, seq: Seq) -> None:
        """``seq``, a session turn, is done: what its next turn may reuse is kept."""
        for proposer in self.proposers:
            proposer.park(seq)
