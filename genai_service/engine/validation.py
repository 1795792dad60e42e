"""Request validation: one table of rules, one message shape.

Every message names the field, the value and the allowed range, so a client
can fix its request without reading our code. Raises ``InvalidArgument``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from genai_common.errors import InvalidArgument

from ..config import LimitsConfig
from ..contract.request import GenerationRequest, SamplingParams

UINT64_MAX = 2**64 - 1
UINT32_MAX = 2**32 - 1


@dataclass(frozen=True)
class _Range:
    field: str
    low: float
    high: float
    low_open: bool = False  # (low, ...] instead of [low, ...]

    def check(self, value: float | None) -> None:
        if value is None:
            return
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidArgument(f"{self.field}: {value} is not a finite number")
        too_low = value <= self.low if self.low_open else value < self.low
        if too_low or value > self.high:
            bracket = "(" if self.low_open else "["
            raise InvalidArgument(
                f"{self.field}: {value} is out of range; allowed {bracket}{_fmt(self.low)}, "
                f"{_fmt(self.high)}]"
            )


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


_SAMPLING_RULES: tuple[tuple[str, Callable[[int], _Range]], ...] = (
    ("temperature", lambda vocab: _Range("sampling.temperature", 0.0, 100.0)),
    ("top_k", lambda vocab: _Range("sampling.top_k", 0, vocab)),
    ("top_p", lambda vocab: _Range("sampling.top_p", 0.0, 1.0, low_open=True)),
    ("min_p", lambda vocab: _Range("sampling.min_p", 0.0, 1.0)),
    ("repetition_penalty", lambda vocab: _Range("sampling.repetition_penalty", 0.0, 10.0, True)),
    ("frequency_penalty", lambda vocab: _Range("sampling.frequency_penalty", -2.0, 2.0)),
    ("presence_penalty", lambda vocab: _Range("sampling.presence_penalty", -2.0, 2.0)),
    ("seed", lambda vocab: _Range("sampling.seed", 0, UINT64_MAX)),
    (
        "repetition_penalty_last_n",
        lambda vocab: _Range("sampling.repetition_penalty_last_n", 0, UINT32_MAX),
    ),
    ("typical_p", lambda vocab: _Range("sampling.typical_p", 0.0, 1.0, low_open=True)),
    ("top_a", lambda vocab: _Range("sampling.top_a", 0.0, 1.0)),
    ("xtc_threshold", lambda vocab: _Range("sampling.xtc_threshold", 0.0, 1.0)),
    ("xtc_probability", lambda vocab: _Range("sampling.xtc_probability", 0.0, 1.0)),
    ("dry_multiplier", lambda vocab: _Range("sampling.dry_multiplier", 0.0, 100.0)),
    ("dry_base", lambda vocab: _Range("sampling.dry_base", 1.0, 10.0)),
    ("dry_allowed_length", lambda vocab: _Range("sampling.dry_allowed_length", 1, 1024)),
    ("dry_penalty_last_n", lambda vocab: _Range("sampling.dry_penalty_last_n", 0, UINT32_MAX)),
    ("mirostat_tau", lambda vocab: _Range("sampling.mirostat_tau", 0.0, 100.0, low_open=True)),
    ("mirostat_eta", lambda vocab: _Range("sampling.mirostat_eta", 0.0, 1.0, low_open=True)),
)
MAX_DRY_BREAKERS = 16
MAX_DRY_BREAKER_CHARS = 64


def resolve_max_new_tokens(request: GenerationRequest, limits: LimitsConfig) -> int:
    value = request.stopping.max_new_tokens
    return limits.default_max_new_tokens if value is None else value


def truncate_prompt(
    request: GenerationRequest, sink_tokens: int, in_session: bool
) -> tuple[GenerationRequest, int]:
    """``request`` with its prompt cut to ``truncate_prompt_tokens`` (its first
    ``sink_tokens``, at most all but one of them, then its last tokens), and
    how many tokens were dropped (docs/design.md, "Context window")."""
    keep = request.truncate_prompt_tokens
    if keep is None:
        return request, 0
    if keep < 1:
        raise InvalidArgument(f"truncate_prompt_tokens: {keep} is out of range; allowed >= 1")
    if in_session:
        raise InvalidArgument(
            "truncate_prompt_tokens: not allowed on a session turn (its history is never "
            "cut; RewindSession or ResetSession the session instead)"
        )
    ids = request.prompt_token_ids
    if len(ids) <= keep:
        return request, 0
    sinks = min(sink_tokens, keep - 1)
    kept = ids[:sinks] + ids[len(ids) - (keep - sinks) :]
    return dataclasses.replace(request, prompt_token_ids=kept), len(ids) - keep


def validate_request(
    request: GenerationRequest,
    *,
    vocab_size: int,
    context_length: int,
    history_len: int,
    limits: LimitsConfig,
    slide_sinks: int | None = None,
) -> None:
    """Check everything about a request before any work is done."""
    if not request.request_id:
        raise InvalidArgument("request_id: must not be empty")
    n_prompt = len(request.prompt_token_ids)
    if n_prompt == 0:
        raise InvalidArgument("input: is empty; give text, token_ids or messages")
    for i, tok in enumerate(request.prompt_token_ids):
        if not 0 <= tok < vocab_size:
            raise InvalidArgument(
                f"token_ids[{i}]: {tok} is out of range; allowed [0, {vocab_size - 1}]"
            )
    total = history_len + n_prompt
    if slide_sinks is not None and history_len:
        # CONTEXT_OVERFLOW_SLIDE: the history slides; the new input must fit
        # beside the sink tokens the history keeps.
        kept = min(slide_sinks, history_len)
        if kept + n_prompt >= context_length:
            raise InvalidArgument(
                f"input: {n_prompt} new tokens; the context window is {context_length} "
                f"tokens and the session keeps {kept} sink tokens, so a turn may add at most "
                f"{context_length - 1 - kept}"
            )
    elif total >= context_length:
        where = f" ({history_len} in the session history + {n_prompt} new)" if history_len else ""
        raise InvalidArgument(
            f"input: the prompt has {total} tokens{where}; the context window is "
            f"{context_length} tokens, so a prompt may have at most {context_length - 1}"
        )

    sampling = request.sampling
    for name, rule in _SAMPLING_RULES:
        rule(vocab_size).check(getattr(sampling, name))
    _validate_logit_controls(sampling, vocab_size, limits)

    stopping = request.stopping
    max_new = resolve_max_new_tokens(request, limits)
    _Range("stopping.max_new_tokens", 1, limits.max_new_tokens_limit).check(max_new)
    _Range("stopping.min_new_tokens", 0, max_new).check(stopping.min_new_tokens)
    if len(stopping.stop_sequences) > limits.max_stop_sequences:
        raise InvalidArgument(
            f"stopping.stop_sequences: {len(stopping.stop_sequences)} given; "
            f"allowed at most {limits.max_stop_sequences}"
        )
    for i, stop in enumerate(stopping.stop_sequences):
        if not stop:
            raise InvalidArgument(f"stopping.stop_sequences[{i}]: must not be empty")
        if len(stop) > limits.max_stop_sequence_chars:
            raise InvalidArgument(
                f"stopping.stop_sequences[{i}]: {len(stop)} characters; allowed at most "
                f"{limits.max_stop_sequence_chars}"
            )
    if len(stopping.stop_token_ids) > limits.max_stop_token_ids:
        raise InvalidArgument(
            f"stopping.stop_token_ids: {len(stopping.stop_token_ids)} given; "
            f"allowed at most {limits.max_stop_token_ids}"
        )
    for i, tok in enumerate(stopping.stop_token_ids):
        _Range(f"stopping.stop_token_ids[{i}]", 0, vocab_size - 1).check(tok)
    _Range("stopping.time_limit_ms", 1, limits.max_time_limit_ms).check(stopping.time_limit_ms)
    _Range("top_logprobs", 0, limits.max_top_logprobs).check(request.top_logprobs)
    _Range("prompt_logprobs", 0, limits.max_top_logprobs).check(request.prompt_logprobs)
    if request.prompt_logprobs and history_len:
        raise InvalidArgument(
            "prompt_logprobs: not on a session turn that has history (its KV is reused, "
            "not computed); ask on a stateless request"
        )
    salt = request.cache_salt
    if salt is not None and not 1 <= len(salt) <= limits.max_cache_salt_chars:
        raise InvalidArgument(
            f"cache_salt: {len(salt)} characters; allowed 1 to {limits.max_cache_salt_chars}"
        )


def _validate_logit_controls(
    sampling: SamplingParams, vocab_size: int, limits: LimitsConfig
) -> None:
    """Mirostat's version, DRY's breakers, logit_bias, banned and allowed ids, bad words."""
    if sampling.mirostat not in (None, 0, 2):
        detail = (
            " (Mirostat v1 is not supported; use 2, Mirostat v2)" if sampling.mirostat == 1 else ""
        )
        raise InvalidArgument(
            f"sampling.mirostat: {sampling.mirostat} is not a known value{detail}; "
            "allowed 0 (off) or 2"
        )
    breakers = sampling.dry_sequence_breakers
    if len(breakers) > MAX_DRY_BREAKERS:
        raise InvalidArgument(
            f"sampling.dry_sequence_breakers: {len(breakers)} given; "
            f"allowed at most {MAX_DRY_BREAKERS}"
        )
    for i, b in enumerate(breakers):
        if not 1 <= len(b) <= MAX_DRY_BREAKER_CHARS:
            raise InvalidArgument(
                f"sampling.dry_sequence_breakers[{i}]: {len(b)} characters; allowed 1 to "
                f"{MAX_DRY_BREAKER_CHARS}"
            )
    bias = sampling.logit_bias
    if len(bias) > limits.max_logit_bias:
        raise InvalidArgument(
            f"sampling.logit_bias: {len(bias)} entries; allowed at most {limits.max_logit_bias}"
        )
    for tok, value in bias:
        _Range("sampling.logit_bias key", 0, vocab_size - 1).check(tok)
        _Range(f"sampling.logit_bias[{tok}]", -100.0, 100.0).check(value)
    for name in ("banned_token_ids", "allowed_token_ids"):
        ids = getattr(sampling, name)
        if len(ids) > vocab_size:
            raise InvalidArgument(
                f"sampling.{name}: {len(ids)} given; allowed at most {vocab_size} (the vocabulary)"
            )
        for i, tok in enumerate(ids):
            _Range(f"sampling.{name}[{i}]", 0, vocab_size - 1).check(tok)
    words = sampling.bad_words
    if len(words) > limits.max_bad_words:
        raise InvalidArgument(
            f"sampling.bad_words: {len(words)} given; allowed at most {limits.max_bad_words}"
        )
    for i, w in enumerate(words):
        if not 1 <= len(w) <= limits.max_stop_sequence_chars:
            raise InvalidArgument(
                f"sampling.bad_words[{i}]: {len(w)} characters; allowed 1 to "
                f"{limits.max_stop_sequence_chars}"
            )


def validate_completions(request: GenerationRequest, limits: LimitsConfig) -> None:
    """``n`` and ``best_of`` of a request (checked before it is split into
    its completions' member requests)."""
    _Range("n", 1, limits.max_completions).check(request.n)
    if request.best_of is not None:
        _Range("best_of", request.n, limits.max_completions).check(request.best_of)
    if request.session_id is not None and max(request.n, request.best_of or 1) > 1:
        raise InvalidArgument(
            "n: several completions are not possible in a session turn (a session has one "
            "history); fork the session (ForkSession) for each"
        )
