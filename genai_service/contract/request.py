"""What a caller asks of the engine and what it gets back.

These are plain frozen dataclasses: they cross the engine-process boundary
by pickle and never carry protobuf (the servicers convert at the boundary).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace


class FinishReason(enum.Enum):
    """Why a request stopped producing tokens (mirrors genai.v1.FinishReason)."""

    MAX_TOKENS = "MAX_TOKENS"
    EOS_TOKEN = "EOS_TOKEN"
    STOP_SEQUENCE = "STOP_SEQUENCE"
    CONTEXT_LENGTH = "CONTEXT_LENGTH"
    TIME_LIMIT = "TIME_LIMIT"
    CANCELLED = "CANCELLED"


class Priority(enum.IntEnum):
    """Scheduling class: higher runs first; FCFS within a class."""

    LOW = 0
    NORMAL = 1
    HIGH = 2


@dataclass(frozen=True)
class SamplingParams:
    """Token selection. ``None`` means "not set" (model default, then neutral).

    No temperature, or ``temperature == 0``, means greedy decoding.
    """

    temperature: float | None = None
    top_k: int | None = None  # 0 or None: disabled
    top_p: float | None = None  # 1.0 or None: disabled
    min_p: float | None = None  # 0.0 or None: disabled
    repetition_penalty: float | None = None  # 1.0 or None: disabled
    frequency_penalty: float | None = None  # 0.0 or None: disabled
    presence_penalty: float | None = None  # 0.0 or None: disabled
    seed: int | None = None  # None: the engine picks one and reports it
    # The rest of the decoding surface (docs/design.md, "Sampling"); each
    # None (or its neutral value, or empty) is off and costs nothing.
    repetition_penalty_last_n: int | None = None  # 0 or None: the whole context
    typical_p: float | None = None  # 1.0 or None: disabled
    top_a: float | None = None  # 0.0 or None: disabled
    xtc_threshold: float | None = None  # None: 0.1 (when xtc_probability > 0)
    xtc_probability: float | None = None  # 0.0 or None: disabled
    dry_multiplier: float | None = None  # 0.0 or None: disabled
    dry_base: float | None = None  # None: 1.75
    dry_allowed_length: int | None = None  # None: 2
    dry_penalty_last_n: int | None = None  # 0 or None: the whole context
    dry_sequence_breakers: tuple[str, ...] = ()  # empty: DRY_DEFAULT_BREAKERS
    mirostat: int | None = None  # 0 or None: off; 2: Mirostat v2
    mirostat_tau: float | None = None  # None: 5.0
    mirostat_eta: float | None = None  # None: 0.1
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids unique
    banned_token_ids: tuple[int, ...] = ()
    allowed_token_ids: tuple[int, ...] = ()  # empty: every token
    bad_words: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature is None or self.temperature == 0.0

    @property
    def penalizes(self) -> bool:
        """Whether a repetition, frequency or presence penalty is set (it reads
        the tokens so far, so a row with one changes from step to step)."""
        return (
            self.repetition_penalty not in (None, 1.0)
            or bool(self.frequency_penalty)
            or bool(self.presence_penalty)
        )

    @property
    def changes_logits(self) -> bool:
        """Whether a logit control beyond the classic penalties is set (greedy
        rows then need the sampler too)."""
        return bool(
            self.dry_multiplier
            or self.logit_bias
            or self.banned_token_ids
            or self.allowed_token_ids
            or self.bad_words
        )

    @property
    def extended(self) -> bool:
        """Whether a sampled row uses a stage after top-p (top-a, typical,
        Mirostat, XTC): it then takes the sampler's extended path."""
        return bool(
            (self.typical_p is not None and self.typical_p < 1.0)
            or self.top_a
            or self.xtc_probability
            or self.mirostat
        )


DRY_DEFAULT_BREAKERS = ("\n", ":", '"', "*")  # llama.cpp's and text-generation-webui's
DRY_DEFAULT_BASE = 1.75
DRY_DEFAULT_ALLOWED_LENGTH = 2
XTC_DEFAULT_THRESHOLD = 0.1
MIROSTAT_DEFAULT_TAU = 5.0
MIROSTAT_DEFAULT_ETA = 0.1


@dataclass(frozen=True)
class StoppingCriteria:
    """When to stop. ``max_new_tokens=None`` means "until EOS or the context limit"."""

    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    stop_sequences: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_sequence: bool = False
    time_limit_ms: int | None = None


@dataclass(frozen=True)
class Constraint:
    """Structured output (guidance/constraints.py): ``kind`` is one of
    ``json_schema``, ``regex``, ``grammar`` (``value`` holds the text),
    ``choice`` (``choices``) or ``json_object``."""

    kind: str
    value: str = ""
    choices: tuple[str, ...] = ()


@dataclass(frozen=True)
class GenerationRequest:
    """One generation: a tokenized prompt plus how to sample and when to stop.

    With ``session_id`` set, ``prompt_token_ids`` are the *new* tokens of a
    turn; they are appended to the session's history.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stopping: StoppingCriteria = field(default_factory=StoppingCriteria)
    top_logprobs: int = 0
    priority: Priority = Priority.NORMAL
    session_id: str | None = None
    skip_special_tokens: bool = True
    principal: str = ""  # who asked (authenticated caller); owns the sessions it creates
    # Only requests with the same salt (and scope) share reused prefixes; None: no salt.
    cache_salt: str | None = None
    constraint: Constraint | None = None  # structured output for this request (turn) only
    # A longer prompt keeps its first sink tokens and its last ones up to this
    # many in all (vLLM's truncate_prompt_tokens); None: never cut.
    truncate_prompt_tokens: int | None = None
    # At the context window: "error" or "slide" (config.CONTEXT_OVERFLOWS);
    # None: the session's setting in a turn, else the server's default.
    context_overflow: str | None = None
    # N >= 1: the logprob of every prompt token given those before it, with N
    # alternatives (RequestOutput.prompt_logprobs); 0: none.
    prompt_logprobs: int = 0
    # Completions to return, and to generate (best_of >= n; None: n): the n
    # of highest cumulative logprob (engine/groups/completions.py).
    n: int = 1
    best_of: int | None = None


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    text: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of a chosen token under the model's raw distribution,
    with the ``top`` most likely alternatives at that step."""

    token_id: int
    text: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV was reused, not recomputed
    # Tokens cut by truncate_prompt_tokens, and dropped by context slides
    # (docs/design.md, "Context window").
    dropped_tokens: int = 0


@dataclass(frozen=True)
class RequestOutput:
    """What one engine step produced for one request (a delta).

    The last output of a request has ``finished=True`` and carries the finish
    reason, usage, seed and session fields; ``error`` is set when the request
    failed instead (its other fields are then not meaningful).
    """

    request_id: str
    token_ids: tuple[int, ...] = ()
    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_sequence: str = ""
    usage: Usage | None = None
    seed: int | None = None
    session_id: str | None = None
    session_tokens: int = 0
    error: Exception | None = None
    # GenerationRequest.prompt_logprobs: in the request's first output only;
    # entry i is prompt token i + 1's (the first token has none).
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    # n > 1: the completion this output belongs to (its last one has a
    # finish_reason but finished False); -1: the request's end (usage only).
    index: int = 0


@dataclass(frozen=True)
class GenerationResult:
    """A whole request's outcome, gathered from its outputs (see ``collect``)."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: FinishReason
    stop_sequence: str
    usage: Usage
    seed: int | None
    session_id: str | None
    session_tokens: int
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    # n > 1: every completion (index order); the fields above are completion 0's.
    completions: tuple[Completion, ...] = ()


@dataclass(frozen=True)
class Completion:
    """One of the completions of a request with n > 1."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: FinishReason | None
    stop_sequence: str


def by_completion(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """The outputs of a request with several completions, merged per completion
    (index order); a plain request's: its outputs merged, as one."""
    indexes = sorted({o.index for o in outputs if o.index >= 0})
    return [merge_outputs(*[o for o in outputs if o.index == i]) for i in indexes]


@dataclass(frozen=True)
class EngineInfo:
    """The served model, as the frontend needs it (GetModelInfo, tokenizing)."""

    model_id: str
    context_length: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str
    runner_kind: str
    has_chat_template: bool
    kv_chunk_size: int
    fim_supported: bool = False  # the tokenizer has fill-in-the-middle tokens
    # per layer: sliding attention window in tokens, 0 = the whole context
    attention_windows: tuple[int, ...] = ()
    # speculative decoding: "" (off), "prompt-lookup", "draft" or "auto"; the
    # draft tokens per step; the draft model's id ("" without one)
    speculative_mode: str = ""
    speculative_tokens: int = 0
    draft_model_id: str = ""


def merge_outputs(*outputs: RequestOutput) -> RequestOutput:
    """Consecutive outputs of one request as one: their tokens, text and
    logprobs joined, the last one's end fields (finish reason, usage, ...).
    The one place deltas are joined (a step's draft tokens, a consumer that
    fell behind, a whole request's result)."""
    if not outputs:
        raise ValueError("no outputs to merge")
    if len(outputs) == 1:
        return outputs[0]
    return replace(
        outputs[-1],
        token_ids=tuple(t for o in outputs for t in o.token_ids),
        text="".join(o.text for o in outputs),
        logprobs=tuple(lp for o in outputs for lp in o.logprobs),
        prompt_logprobs=next((o.prompt_logprobs for o in outputs if o.prompt_logprobs), ()),
    )


def collect(outputs: list[RequestOutput]) -> GenerationResult:
    """Fold a request's deltas into one result; raises the request's error."""
    if not outputs:
        raise ValueError("no outputs to collect")
    if outputs[-1].index < 0:  # several completions
        return _collect_completions(outputs)
    last = merge_outputs(*outputs)
    if last.error is not None:
        raise last.error
    if not last.finished or last.finish_reason is None or last.usage is None:
        raise ValueError(f"request {last.request_id} has not finished")
    return GenerationResult(
        request_id=last.request_id,
        text=last.text,
        token_ids=last.token_ids,
        logprobs=last.logprobs,
        finish_reason=last.finish_reason,
        stop_sequence=last.stop_sequence,
        usage=last.usage,
        seed=last.seed,
        session_id=last.session_id,
        session_tokens=last.session_tokens,
        prompt_logprobs=last.prompt_logprobs,
    )


def _collect_completions(outputs: list[RequestOutput]) -> GenerationResult:
    end = outputs[-1]
    if end.error is not None:
        raise end.error
    assert end.usage is not None
    completions = tuple(
        Completion(
            index=o.index,
            text=o.text,
            token_ids=o.token_ids,
            logprobs=o.logprobs,
            finish_reason=o.finish_reason,
            stop_sequence=o.stop_sequence,
        )
        for o in by_completion(outputs)
    )
    first = completions[0]
    return GenerationResult(
        request_id=end.request_id,
        text=first.text,
        token_ids=first.token_ids,
        logprobs=first.logprobs,
        finish_reason=first.finish_reason or FinishReason.MAX_TOKENS,
        stop_sequence=first.stop_sequence,
        usage=end.usage,
        seed=end.seed,
        session_id=None,
        session_tokens=0,
        prompt_logprobs=next((o.prompt_logprobs for o in outputs if o.prompt_logprobs), ()),
        completions=completions,
    )
