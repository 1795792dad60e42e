"""Protobuf <-> dataclass conversion: with ``_request`` (how a
GenerateRequest is built from keyword options), the only client modules that
build or read ``*_pb2`` messages (the client surface never exposes protobuf)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC
from typing import Any

from google.protobuf import json_format

from genai_client._request import (  # noqa: F401 (the request side, re-exported)
    GenerateOptions,
    MessageLike,
    _tool_call,
    constraint_proto,
    context_overflow_proto,
    generate_request,
    messages_proto,
    priority_proto,
    tool_proto,
)
from genai_client.errors import InternalError, error_from_status
from genai_client.types import (
    BidiEvent,
    Completion,
    Delta,
    GenerationResult,
    KvLayout,
    ModelInfo,
    SessionInfo,
    Token,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    Usage,
)
from genai_proto.genai.v1 import common_pb2, generate_pb2, model_pb2, session_pb2

_FINISH_PREFIX = "FINISH_REASON_"
_RUNNER_PREFIX = "RUNNER_KIND_"


def _enum_name(enum: Any, value: int, prefix: str) -> str:
    """An enum value's name without its prefix ("" for UNSPECIFIED; the number
    for a value of a newer server that this client does not know)."""
    try:
        name = str(enum.Name(value)).removeprefix(prefix)
    except ValueError:
        return str(value)
    return "" if name == "UNSPECIFIED" else name


# --- generation results ------------------------------------------------------


def finish_reason_name(value: int) -> str:
    """``FINISH_REASON_EOS_TOKEN`` -> ``"EOS_TOKEN"``; unspecified -> ``""``."""
    if value == common_pb2.FINISH_REASON_UNSPECIFIED:
        return ""
    try:
        return common_pb2.FinishReason.Name(value).removeprefix(_FINISH_PREFIX)
    except ValueError:  # a newer server's reason this client does not know
        return str(value)


def _finish_reason_value(name: str) -> common_pb2.FinishReason:
    if not name:
        return common_pb2.FINISH_REASON_UNSPECIFIED
    return common_pb2.FinishReason.Value(_FINISH_PREFIX + name)


def _logprobs(items: Iterable[common_pb2.TokenLogprob]) -> tuple[TokenLogprob, ...]:
    return tuple(
        TokenLogprob(
            token_id=lp.token_id,
            text=lp.text,
            logprob=lp.logprob,
            top=tuple(TopLogprob(t.token_id, t.text, t.logprob) for t in lp.top),
        )
        for lp in items
    )


def _usage(usage: common_pb2.Usage) -> Usage:
    return Usage(
        usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens, usage.dropped_tokens
    )


def delta_from_proto(delta: generate_pb2.Delta) -> Delta:
    return Delta(
        text=delta.text,
        token_ids=tuple(delta.token_ids),
        logprobs=_logprobs(delta.logprobs),
        prompt_logprobs=_logprobs(delta.prompt_logprobs),
        index=delta.index,
    )


def _completions(
    items: Iterable[generate_pb2.Completion], texts: Mapping[int, str] | None = None
) -> tuple[Completion, ...]:
    """GenerateResponse/Final completions; ``texts``: a stream's text per index."""
    return tuple(
        Completion(
            index=c.index,
            text=texts.get(c.index, "") if texts is not None else c.text,
            token_ids=tuple(c.token_ids),
            finish_reason=finish_reason_name(c.finish_reason),
            stop_sequence=c.stop_sequence,
            logprobs=_logprobs(c.logprobs),
            tool_calls=_tool_calls(c.tool_calls),
        )
        for c in items
    )


def result_from_response(response: generate_pb2.GenerateResponse) -> GenerationResult:
    return GenerationResult(
        text=response.text,
        token_ids=tuple(response.token_ids),
        finish_reason=finish_reason_name(response.finish_reason),
        stop_sequence=response.stop_sequence,
        logprobs=_logprobs(response.logprobs),
        usage=_usage(response.usage),
        seed=response.seed,
        session_id=response.session_id or None,
        session_tokens=response.session_tokens,
        request_id=response.request_id,
        tool_calls=_tool_calls(response.tool_calls),
        prompt_logprobs=_logprobs(response.prompt_logprobs),
        completions=_completions(response.completions),
    )


def result_from_final(final: generate_pb2.Final, text: str) -> GenerationResult:
    """A streamed request's result: its Final plus the deltas' joined ``text``."""
    return GenerationResult(
        text=text,
        token_ids=tuple(final.token_ids),
        finish_reason=finish_reason_name(final.finish_reason),
        stop_sequence=final.stop_sequence,
        logprobs=_logprobs(final.logprobs),
        usage=_usage(final.usage),
        seed=final.seed,
        session_id=final.session_id or None,
        session_tokens=final.session_tokens,
        request_id=final.request_id,
        tool_calls=_tool_calls(final.tool_calls),
    )


def _tool_calls(calls: Iterable[common_pb2.ToolCall]) -> tuple[ToolCall, ...]:
    return tuple(ToolCall(c.id, c.name, c.arguments_json) for c in calls)


def _logprobs_proto(items: Iterable[TokenLogprob]) -> list[common_pb2.TokenLogprob]:
    return [
        common_pb2.TokenLogprob(
            token_id=lp.token_id,
            text=lp.text,
            logprob=lp.logprob,
            top=[
                common_pb2.TopLogprob(token_id=t.token_id, text=t.text, logprob=t.logprob)
                for t in lp.top
            ],
        )
        for lp in items
    ]


def result_to_response(result: GenerationResult) -> generate_pb2.GenerateResponse:
    """The GenerateResponse a result came from (for protobuf-JSON output)."""
    return generate_pb2.GenerateResponse(
        text=result.text,
        token_ids=result.token_ids,
        finish_reason=_finish_reason_value(result.finish_reason),
        stop_sequence=result.stop_sequence,
        logprobs=_logprobs_proto(result.logprobs),
        prompt_logprobs=_logprobs_proto(result.prompt_logprobs),
        usage=common_pb2.Usage(
            prompt_tokens=result.usage.prompt_tokens,
            completion_tokens=result.usage.completion_tokens,
            cached_tokens=result.usage.cached_tokens,
            dropped_tokens=result.usage.dropped_tokens,
        ),
        seed=result.seed,
        session_id=result.session_id or "",
        session_tokens=result.session_tokens,
        request_id=result.request_id,
        tool_calls=[_tool_call(c) for c in result.tool_calls],
    )


def result_to_json(result: GenerationResult) -> str:
    """A result as protobuf JSON of a GenerateResponse (every field shown)."""
    return json_format.MessageToJson(
        result_to_response(result), always_print_fields_with_no_presence=True
    )


def stream_event(
    response: generate_pb2.GenerateStreamResponse, parts: list[str]
) -> Delta | GenerationResult | None:
    """A GenerateStream message as a Delta (its text appended to ``parts``) or,
    for the final message, the whole result (text: ``parts`` joined)."""
    kind = response.WhichOneof("event")
    if kind == "delta":
        delta = delta_from_proto(response.delta)
        parts.append(delta.text)
        return delta
    if kind == "final":
        return result_from_final(response.final, "".join(parts))
    return None  # an event kind this client does not know


# --- bidi --------------------------------------------------------------------


def bidi_event(
    response: generate_pb2.BidiResponse, texts: dict[str, list[str]]
) -> BidiEvent | None:
    """A BidiResponse as an event. ``texts`` maps each running request id to
    its delta texts so far; a request's entry is removed when it ends. Events
    of unknown or ended requests give ``None``."""
    request_id = response.request_id
    parts = texts.get(request_id)
    if parts is None:
        return None
    kind = response.WhichOneof("event")
    if kind == "delta":
        delta = delta_from_proto(response.delta)
        parts.append(delta.text)
        return BidiEvent(request_id, delta=delta)
    del texts[request_id]
    if kind == "final":
        return BidiEvent(request_id, result=result_from_final(response.final, "".join(parts)))
    if kind == "error":
        return BidiEvent(request_id, error=error_from_status(response.error))
    return BidiEvent(request_id, error=InternalError(f"request {request_id}: empty event"))


def bidi_start(request: generate_pb2.GenerateRequest) -> generate_pb2.BidiRequest:
    return generate_pb2.BidiRequest(start=request)


def bidi_cancel(request_id: str) -> generate_pb2.BidiRequest:
    return generate_pb2.BidiRequest(cancel=generate_pb2.CancelRequest(request_id=request_id))


# --- sessions ----------------------------------------------------------------


def create_session_request(
    idle_ttl_seconds: int | None,
    metadata: Mapping[str, str] | None,
    context_overflow: str | None = None,
) -> session_pb2.CreateSessionRequest:
    request = session_pb2.CreateSessionRequest(
        metadata=dict(metadata or {}), context_overflow=context_overflow_proto(context_overflow)
    )
    if idle_ttl_seconds is not None:
        request.idle_ttl_seconds = idle_ttl_seconds
    return request


def get_session_request(session_id: str) -> session_pb2.GetSessionRequest:
    return session_pb2.GetSessionRequest(session_id=session_id)


def reset_session_request(session_id: str) -> session_pb2.ResetSessionRequest:
    return session_pb2.ResetSessionRequest(session_id=session_id)


def rewind_session_request(
    session_id: str, turns: int | None, history_tokens: int | None
) -> session_pb2.RewindSessionRequest:
    if (turns is None) == (history_tokens is None):
        raise ValueError("give one of turns and history_tokens")
    request = session_pb2.RewindSessionRequest(session_id=session_id)
    if turns is not None:
        request.turns = turns
    else:
        request.history_tokens = history_tokens  # type: ignore[assignment]
    return request


def fork_session_request(
    session_id: str,
    turns: int | None,
    idle_ttl_seconds: int | None,
    metadata: Mapping[str, str] | None,
) -> session_pb2.ForkSessionRequest:
    request = session_pb2.ForkSessionRequest(session_id=session_id, metadata=dict(metadata or {}))
    if turns is not None:
        request.turns = turns
    if idle_ttl_seconds is not None:
        request.idle_ttl_seconds = idle_ttl_seconds
    return request


def close_session_request(session_id: str) -> session_pb2.CloseSessionRequest:
    return session_pb2.CloseSessionRequest(session_id=session_id)


def list_sessions_request(
    page_token: str = "", page_size: int = 0
) -> session_pb2.ListSessionsRequest:
    return session_pb2.ListSessionsRequest(page_token=page_token, page_size=page_size)


def session_from_proto(session: session_pb2.Session) -> SessionInfo:
    return SessionInfo(
        session_id=session.session_id,
        created_at=session.created_at.ToDatetime(tzinfo=UTC),
        last_used_at=session.last_used_at.ToDatetime(tzinfo=UTC),
        history_tokens=session.history_tokens,
        turns=session.turns,
        idle_ttl_seconds=session.idle_ttl_seconds,
        busy=session.busy,
        metadata=dict(session.metadata),
        context_overflow=_OVERFLOW_NAMES.get(session.context_overflow, "error"),
        dropped_tokens=session.dropped_tokens,
    )


_OVERFLOW_NAMES = {
    common_pb2.CONTEXT_OVERFLOW_ERROR: "error",
    common_pb2.CONTEXT_OVERFLOW_SLIDE: "slide",
}


# --- model -------------------------------------------------------------------


def model_info_request() -> model_pb2.GetModelInfoRequest:
    return model_pb2.GetModelInfoRequest()


def model_info_from_proto(info: model_pb2.ModelInfo) -> ModelInfo:
    layout = info.kv_layout
    runner = _enum_name(model_pb2.RunnerKind, info.runner_kind, _RUNNER_PREFIX)
    return ModelInfo(
        model_id=info.model_id,
        context_length=info.context_length,
        vocab_size=info.vocab_size,
        eos_token_ids=tuple(info.eos_token_ids),
        kv_layout=KvLayout(layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype),
        runner_kind=runner,
        has_chat_template=info.has_chat_template,
        kv_chunk_size=info.kv_chunk_size,
        fim_supported=info.fim_supported,
        attention_windows=tuple(info.attention_windows),
        speculative_mode=_enum_name(
            model_pb2.SpeculativeMode, info.speculative_mode, "SPECULATIVE_MODE_"
        ),
        speculative_tokens=info.speculative_tokens,
        draft_model_id=info.draft_model_id,
    )


def tokenize_request(
    text: str | None,
    messages: Sequence[MessageLike] | None,
    add_special_tokens: bool | None,
) -> model_pb2.TokenizeRequest:
    if (text is None) == (messages is None):
        raise ValueError("give exactly one of text, messages")
    request = model_pb2.TokenizeRequest(return_tokens=True)
    if text is not None:
        request.text = text
    elif messages is not None:
        request.messages.CopyFrom(messages_proto(messages))
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    return request


def tokens_from_proto(response: model_pb2.TokenizeResponse) -> list[Token]:
    if response.tokens:
        return [Token(t.id, t.text, t.char_start, t.char_end) for t in response.tokens]
    # A server that ignored return_tokens: ids only.
    return [Token(i, "") for i in response.token_ids]


def detokenize_request(
    token_ids: Sequence[int], skip_special_tokens: bool | None
) -> model_pb2.DetokenizeRequest:
    request = model_pb2.DetokenizeRequest(token_ids=token_ids)
    if skip_special_tokens is not None:
        request.skip_special_tokens = skip_special_tokens
    return request


class StreamState:
    """What a sync or asyncio generation stream has received so far: the
    deltas' text and, once the final message arrives, the whole result."""

    _collect_hint = "call collect()"

    def __init__(self, call: Any) -> None:
        self._call = call
        self._text: list[str] = []
        self._result: GenerationResult | None = None
        self._prompt_logprobs: tuple[TokenLogprob, ...] = ()  # the first delta's
        self._texts: dict[int, list[str]] = {}  # n > 1: each completion's deltas' text

    def _absorb(self, response: Any) -> Delta | None:
        """Record one stream message; the delta to hand out, if it is one."""
        if response.WhichOneof("event") == "delta" and response.delta.index:
            # completion 0's text is the stream's own (``text``), the others' apart
            delta = delta_from_proto(response.delta)
            self._texts.setdefault(delta.index, []).append(delta.text)
            if delta.prompt_logprobs:
                self._prompt_logprobs = delta.prompt_logprobs
            return delta
        item = stream_event(response, self._text)
        if isinstance(item, Delta):
            if item.prompt_logprobs:
                self._prompt_logprobs = item.prompt_logprobs
            return item
        if item is not None:
            texts = {i: "".join(t) for i, t in self._texts.items()} | {0: item.text}
            self._result = dataclasses.replace(
                item,
                prompt_logprobs=self._prompt_logprobs,
                completions=_completions(response.final.completions, texts),
            )
        return None

    def _check_finished(self) -> None:
        if self._result is None:
            raise InternalError("the stream ended without a final message")

    @property
    def text(self) -> str:
        """The text received so far."""
        return "".join(self._text)

    @property
    def done(self) -> bool:
        """True once the final message has arrived."""
        return self._result is not None

    @property
    def result(self) -> GenerationResult:
        """The whole result; raises ``RuntimeError`` before the stream ended."""
        if self._result is None:
            raise RuntimeError(f"the stream has not ended: iterate it or {self._collect_hint}")
        return self._result
