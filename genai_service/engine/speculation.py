"""Prompt-lookup drafts for speculative decoding.

A sequence's next tokens are guessed from its own context: find the latest
earlier place where its last ``n`` tokens occurred (``n`` from ``ngram_max``
down to ``ngram_min``) and propose the tokens that followed there. Text that
quotes or edits its prompt (summaries, code changes, extraction, multi-turn
chat that repeats names) is full of such runs. The engine feeds the last token
plus the draft in one step and keeps every draft token the model itself would
have chosen (``Speculation.accept`` with ``follow_draft`` below): the same
tokens as without speculation, up to the rounding of a several-token step
(docs/design.md, "Speculative decoding").

The index is built once per sequence and extended by the tokens appended
since, so a step costs a few dict operations, not a scan of the context.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from ..config import SpeculationConfig
from ..contract.request import RequestOutput, TokenLogprob, merge_outputs
from .sampling_rows import TokenPicker
from .sequence import SeqStatus
from .sequence import Sequence as Seq

if TYPE_CHECKING:
    from .runner.model_runner import ModelRunner

T = TypeVar("T")


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
        self.max_batch = config.max_batch
        self._sizes = range(config.ngram_min, config.ngram_max + 1)
        self._index: dict[int, _NgramIndex] = {}
        self._backoff: dict[int, tuple[int, int]] = {}  # seq_id -> (steps left, last span)

    def drafts(self, items: Sequence[tuple[Seq, int]], context_length: int) -> dict[int, list[int]]:
        """seq_id -> draft, for the sequences of a step that may speculate: only
        steps that decode alone (no prefill, no session commit), at most
        ``max_batch`` sequences."""
        if len(items) > self.max_batch:
            return {}
        if any(n != 1 or not s.output_ids or s.status is not SeqStatus.RUNNING for s, n in items):
            return {}
        drafts = {}
        for seq, _ in items:
            # Every kept draft token and the token after them must fit the
            # request's max_new_tokens and the context.
            limit = min(
                seq.max_new_tokens - len(seq.output_ids) - 1,
                context_length - len(seq.token_ids) - 1,
            )
            draft = self.propose(seq.seq_id, seq.token_ids, limit)
            if draft:
                drafts[seq.seq_id] = draft
        return drafts

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


class Speculation:
    """Speculative decoding in the engine (``config.speculation``): a step's
    drafts and, once the runner has verified them, the tokens kept of each."""

    def __init__(
        self, config: SpeculationConfig, runner: ModelRunner, counters: Counter[str]
    ) -> None:
        if not runner.can_verify:
            raise ValueError(
                "speculation: the graph returns only the last position's logits and has "
                "no num_logits_to_keep input (convert it again, or use --speculate 0)"
            )
        self.drafter = PromptLookup(config)
        self.runner = runner
        self.counters = counters

    def drafts(self, items: Sequence[tuple[Seq, int]], context_length: int) -> dict[int, list[int]]:
        """seq_id -> draft for the sequences of a step (``PromptLookup.drafts``;
        none for a Mirostat sequence); a constrained sequence's draft is cut to
        the longest prefix its constraint accepts (``accept`` then masks each
        position as it picks)."""
        drafts = self.drafter.drafts(items, context_length)
        for seq, _ in items:
            draft = drafts.get(seq.seq_id)
            if draft and seq.mirostat is not None:
                # Mirostat's mu moves with every pick, and a check picks past
                # the tokens it keeps when one of them ends the request.
                del drafts[seq.seq_id]
            elif draft and seq.matcher is not None:
                keep = seq.matcher.validate_tokens(draft)
                if keep:
                    drafts[seq.seq_id] = draft[:keep]
                else:
                    del drafts[seq.seq_id]
        return drafts

    def accept(
        self,
        seq: Seq,
        draft: list[int],
        rows: np.ndarray,
        picker: TokenPicker,
        append: Callable[[Seq, int, TokenLogprob | None], RequestOutput],
    ) -> RequestOutput:
        """Pick tokens from ``rows`` as a plain decode would (``picker``, in
        ``follow_draft``), ``append`` them one by one, and keep the KV of the
        agreed draft tokens only. Returns the step's tokens as one output."""
        chosen = follow_draft(draft, rows, lambda row, picked: picker.pick_after(seq, row, picked))
        self.counters["spec_draft_tokens"] += len(draft)
        self.counters["spec_accepted_tokens"] += len(chosen) - 1
        self.drafter.feedback(seq.seq_id, len(chosen) - 1)
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
        self.drafter.forget(seq_id)
