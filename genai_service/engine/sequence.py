"""A request's mutable state inside the engine.

``token_ids`` is the whole context: session history (if any), the prompt and
the tokens generated so far. ``num_computed`` of them have KV in the model
runner; the rest are computed by the next step(s). Outside decode there is
always at least one token left to compute, because the last sampled token
has not been fed back yet.
"""

from __future__ import annotations

import enum
import itertools
import secrets
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import tokenizers

from ..contract.request import (
    MIROSTAT_DEFAULT_TAU,
    FinishReason,
    GenerationRequest,
    RequestOutput,
    TokenLogprob,
    Usage,
)
from .sampling.sampler import MirostatState, SamplingArgs
from .text.text_output import TextOutput

if TYPE_CHECKING:
    from .kv.prefix_cache import KvLayers
    from .sessions.sessions import Session

DETOKENIZER_CONTEXT = 8  # prompt tokens given to the detokenizer as left context


class SeqStatus(enum.Enum):
    WAITING = "WAITING"
    RUNNING = "RUNNING"  # prefilling (chunk by chunk) or decoding
    COMMITTING = "COMMITTING"  # finished; computing the last token's KV for its session
    FINISHED = "FINISHED"


_seq_counter = itertools.count()


@dataclass(eq=False)
class Sequence:
    request: GenerationRequest
    token_ids: list[int]
    prompt_len: int  # context length before generation (history + new prompt)
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    stop_token_ids: frozenset[int]
    rng: np.random.Generator
    seed: int
    text: TextOutput  # detokenizer and stop strings; its stop_sequence ends the output
    deadline: float | None  # monotonic time at which TIME_LIMIT fires
    session: Session | None = None
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    arrival: float = field(default_factory=time.monotonic)
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0
    num_cached: int = 0  # prompt tokens whose KV was reused (prefix index or session)
    dropped_tokens: int = 0  # cut by truncate_prompt_tokens, then dropped by slides
    # CONTEXT_OVERFLOW_SLIDE: at the window, drop old tokens and go on (kv/window.py).
    slide: bool = False
    # Each slide of this request: (first dropped position, tokens dropped).
    slides: list[tuple[int, int]] = field(default_factory=list)
    # Non-empty once the KV holds keys moved by a slide (no longer what a
    # fresh compute of ``token_ids`` gives): its chunk keys chain from it.
    lineage: bytes = b""
    # Whether its chunks may go to the prefix index and the kvstore.
    shareable: bool = True
    prompt_tokens: int = 0  # Usage.prompt_tokens: the prompt as it began to run
    # Compute no further than this before sliding (a restored history's tail
    # is computed where it was, before the slide its turn needs); None: no hold.
    hold_at: int | None = None
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stored_chunks: int = 0  # leading chunks already in the prefix index
    # kvstore prefetch of the prompt's chunk chain, started when the request arrives
    prefix_keys: list[bytes] = field(default_factory=list)
    prefetch: Future[list[KvLayers]] | None = None
    prefetch_from: int = 0  # index in prefix_keys of the first prefetched key
    # llguidance.LLMatcher of the request's constraint (guidance/constraints.py): it
    # has consumed exactly the generated tokens; None without a constraint.
    matcher: Any = None
    # SamplingParams.bad_words as token sequences (each as written and with a
    # leading space, where that tokenizes differently), for the sampler's bans.
    bad_words: tuple[tuple[int, ...], ...] = ()
    # Mirostat v2's state (sampler.MirostatState) of a Mirostat request; a
    # session turn continues the session's mu.
    mirostat: MirostatState | None = None
    # GenerationRequest.prompt_logprobs: those of the prompt computed so far,
    # until its first output takes them (None: none asked, or sent).
    prompt_logprobs: list[TokenLogprob] | None = None
    # The sampler's args of a sampled row that asks for nothing that changes
    # between steps, with the generator they were built for (TokenPicker.pick
    # builds them once; args None: the row's do change; None: not built yet).
    plain_args: tuple[np.random.Generator, SamplingArgs | None] | None = None
    # A completion's member other than 0 (engine/groups/completions.py): the member
    # whose prompt KV it copies once computed; None after (or for others).
    leader: Sequence | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_pending(self) -> int:
        """Tokens whose KV is not computed yet."""
        return len(self.token_ids) - self.num_computed

    def next_chunk(self, budget: int) -> int:
        """How many pending tokens a prefill step computes within ``budget``."""
        n = min(self.num_pending, budget)
        if self.hold_at is not None:
            n = min(n, self.hold_at - self.num_computed)
        return n

    def append(
        self,
        token: int,
        context_length: int,
        token_text: Callable[[int], str],
        consume: Callable[[Sequence, int], bool],
    ) -> tuple[str, FinishReason | None]:
        """Append a picked token and apply the stop rules: the text it makes safe
        to stream and why the sequence finishes with it, if it does (the text
        then includes what the detokenizer and stop matcher held back).
        ``consume(seq, token)`` feeds the token to the request's constraint and
        says whether it is complete (``Guidance.consume``)."""
        self.token_ids.append(token)
        self.output_ids.append(token)
        constraint_done = consume(self, token)
        text_out = self.text
        finish: FinishReason | None
        if token in self.eos_token_ids:
            finish, text = FinishReason.EOS_TOKEN, ""
        elif token in self.stop_token_ids:
            return text_out.finish_at_stop_token(token_text(token)), FinishReason.STOP_SEQUENCE
        else:
            text = text_out.add(token)
            if text_out.stopped:
                return text, FinishReason.STOP_SEQUENCE
            # A complete constraint ends the text as EOS would.
            finish = (
                FinishReason.EOS_TOKEN if constraint_done else self.limit_reached(context_length)
            )
            if finish is None:
                return text, None
        text += text_out.finish()  # a stop string may still complete in the held-back text
        return text, FinishReason.STOP_SEQUENCE if text_out.stopped else finish

    def limit_reached(self, context_length: int) -> FinishReason | None:
        """The limit the sequence has reached, if any: ``max_new_tokens``, the
        context, or its time limit."""
        if len(self.output_ids) >= self.max_new_tokens:
            return FinishReason.MAX_TOKENS
        if len(self.token_ids) >= context_length and not self.slide:
            return FinishReason.CONTEXT_LENGTH
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return FinishReason.TIME_LIMIT
        return None

    def final_output(self) -> RequestOutput:
        """The last output of a finished request: why it finished, usage, seed
        and its session's state."""
        session = self.session
        return RequestOutput(
            self.request_id,
            finished=True,
            finish_reason=self.finish_reason,
            stop_sequence=self.text.stop_sequence,
            usage=Usage(
                self.prompt_tokens, len(self.output_ids), self.num_cached, self.dropped_tokens
            ),
            seed=self.seed,
            session_id=session.session_id if session else None,
            session_tokens=len(session.history) if session else 0,
        )

    def drop(self, start: int, n: int) -> None:
        """Drop context positions ``start .. start+n-1`` (a slide; the runner's
        KV is the caller's): later tokens move ``n`` down."""
        del self.token_ids[start : start + n]
        # The prompt's part of what was dropped: before generation the drop
        # is the prompt's (and Usage counts the prompt as it then runs).
        in_prompt = max(0, min(self.prompt_len, start + n) - start)
        self.prompt_len -= in_prompt
        if not self.output_ids:
            self.prompt_tokens -= in_prompt
        self.dropped_tokens += n
        self.slides.append((start, n))

    @property
    def priority_key(self) -> tuple[int, float, int]:
        # Higher priority first, then first come first served.
        return (-int(self.request.priority), self.arrival, self.seq_id)


def new_sequence(
    request: GenerationRequest,
    history: list[int],
    session: Session | None,
    *,
    tokenizer: tokenizers.Tokenizer,
    eos_token_ids: Iterable[int],
    max_new_tokens: int,
) -> Sequence:
    """A validated request's state as it is queued: its context (the session's
    ``history``, then the prompt), its seed (the request's, else a random one
    that the final output reports), stop rules, text output and deadline."""
    stopping = request.stopping
    seed = request.sampling.seed
    if seed is None:
        seed = secrets.randbits(63)
    token_ids = list(history) + list(request.prompt_token_ids)
    deadline = None
    if stopping.time_limit_ms is not None:
        deadline = time.monotonic() + stopping.time_limit_ms / 1000.0
    sampling = request.sampling
    mirostat = None
    if sampling.mirostat and not sampling.greedy:
        mu = session.mirostat_mu if session is not None else None
        tau = sampling.mirostat_tau if sampling.mirostat_tau is not None else MIROSTAT_DEFAULT_TAU
        mirostat = MirostatState(2.0 * tau if mu is None else mu)
    return Sequence(
        request=request,
        token_ids=token_ids,
        prompt_len=len(token_ids),
        prompt_tokens=len(token_ids),
        max_new_tokens=max_new_tokens,
        eos_token_ids=frozenset(() if stopping.ignore_eos else eos_token_ids),
        stop_token_ids=frozenset(stopping.stop_token_ids),
        rng=np.random.default_rng(seed),
        seed=seed,
        text=TextOutput(
            tokenizer,
            token_ids[-DETOKENIZER_CONTEXT:],
            skip_special_tokens=request.skip_special_tokens,
            stop_sequences=stopping.stop_sequences,
            include_stop_sequence=stopping.include_stop_sequence,
        ),
        deadline=deadline,
        session=session,
        bad_words=tokenize_bad_words(tokenizer, sampling.bad_words),
        mirostat=mirostat,
    )


def tokenize_bad_words(
    tokenizer: tokenizers.Tokenizer, words: Iterable[str]
) -> tuple[tuple[int, ...], ...]:
    """Each bad word's token ids as written and, where it differs, with a
    leading space (the form it takes after another word), as vLLM does."""
    out: list[tuple[int, ...]] = []
    for word in words:
        for form in (word, " " + word.lstrip(" ")):
            ids = tuple(tokenizer.encode(form, add_special_tokens=False).ids)
            if ids and ids not in out:
                out.append(ids)
    return tuple(out)
