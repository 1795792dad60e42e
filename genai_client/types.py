"""What the client returns: plain frozen dataclasses, never protobuf messages.

Field meanings follow ``protos/genai/v1/*.proto``; enums are given as their
short names (``finish_reason="EOS_TOKEN"``, ``runner_kind="SHARED_BUFFER"``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from genai_client.errors import GenAIClientError


@dataclass(frozen=True)
class ToolCall:
    """A call of one of the request's tools: ``arguments_json`` is a JSON
    object as text; a ``tool`` message answering it names ``id``."""

    id: str
    name: str
    arguments_json: str

    @property
    def arguments(self) -> Any:
        return json.loads(self.arguments_json) if self.arguments_json else {}


@dataclass(frozen=True)
class Tool:
    """A tool the model may call: ``parameters`` is the JSON Schema of its
    arguments (a mapping or JSON text)."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] | str | None = None


@dataclass(frozen=True)
class ChatMessage:
    """One message of a chat conversation (``role`` is e.g. "user"; a tool's
    result is ``role="tool"`` with the ``tool_call_id`` it answers; an
    assistant turn that called tools carries its ``tool_calls``)."""

    role: str
    content: str
    name: str = ""
    tool_call_id: str = ""
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class TopLogprob:
    """One alternative token at a generation step."""

    token_id: int
    text: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """Natural-log probability of a generated token, with the ``top`` most
    likely alternatives at that step (most likely first)."""

    token_id: int
    text: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class Usage:
    """Token accounting of one request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV cache was reused, not recomputed
    dropped_tokens: int = 0  # prompt tokens cut by truncate_prompt_tokens


@dataclass(frozen=True)
class Delta:
    """Output of a streamed request since its previous delta.

    ``text`` may be empty while the new tokens do not complete a character
    (or may start a stop sequence); concatenating every delta's text gives the
    request's whole text.
    """

    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    # The first delta of a request with prompt_logprobs: entry i is prompt token i + 1's.
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    index: int = 0  # n > 1: the completion these tokens belong to


@dataclass(frozen=True)
class GenerationResult:
    """The whole outcome of one generation request.

    ``finish_reason`` is one of "MAX_TOKENS", "EOS_TOKEN", "STOP_SEQUENCE",
    "CONTEXT_LENGTH", "TIME_LIMIT", "CANCELLED". ``session_id`` is ``None``
    and ``session_tokens`` 0 for a stateless request.
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    stop_sequence: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    usage: Usage = field(default_factory=Usage)
    seed: int = 0
    session_id: str | None = None
    session_tokens: int = 0
    request_id: str = ""
    tool_calls: tuple[ToolCall, ...] = ()  # when the model called offered tools
    # prompt_logprobs=N: entry i is the logprob of prompt token i + 1 (the first has none)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    # n > 1: every completion, index order (the fields above are completion 0's)
    completions: tuple[Completion, ...] = ()


@dataclass(frozen=True)
class Completion:
    """One of the completions of a request with ``n`` > 1."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    stop_sequence: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class SessionInfo:
    """A server-side session (see ``SessionService``)."""

    session_id: str
    created_at: datetime
    last_used_at: datetime
    history_tokens: int
    turns: int
    idle_ttl_seconds: int
    busy: bool
    metadata: dict[str, str] = field(default_factory=dict)
    context_overflow: str = "error"  # its turns' default at the context window: or "slide"
    dropped_tokens: int = 0  # history dropped by slides since creation or reset


@dataclass(frozen=True)
class KvLayout:
    """Shape and element type (numpy name, e.g. "float16") of the KV cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str


@dataclass(frozen=True)
class ModelInfo:
    """The served model. ``runner_kind`` is "PAST_PRESENT", "SHARED_BUFFER" or "STATIC_CACHE"."""

    model_id: str
    context_length: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    kv_layout: KvLayout
    runner_kind: str
    has_chat_template: bool
    kv_chunk_size: int
    fim_supported: bool = False  # fill in the middle (fim_prefix/fim_suffix) works
    # per layer: sliding attention window in tokens, 0 = the whole context
    attention_windows: tuple[int, ...] = ()
    # speculative decoding: "" (off), "PROMPT_LOOKUP", "DRAFT" or "AUTO"; the
    # draft tokens checked per step; the draft model's id ("" without one)
    speculative_mode: str = ""
    speculative_tokens: int = 0
    draft_model_id: str = ""


@dataclass(frozen=True)
class Token:
    """One token of a tokenized text: its id, its vocabulary string and its
    span ``[char_start, char_end)`` in the encoded text, in code points."""

    id: int
    text: str
    char_start: int = 0
    char_end: int = 0


@dataclass(frozen=True)
class BidiEvent:
    """One event of a :meth:`Client.bidi` stream, tagged with its request.

    Exactly one of ``delta``, ``result`` and ``error`` is set. A request's
    events are zero or more deltas, then one ``result`` (its text is the
    concatenation of the deltas' text) or one ``error``.
    """

    request_id: str
    delta: Delta | None = None
    result: GenerationResult | None = None
    error: GenAIClientError | None = None

    @property
    def done(self) -> bool:
        """True for the last event of its request (a result or an error)."""
        return self.result is not None or self.error is not None
