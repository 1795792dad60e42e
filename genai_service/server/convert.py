"""Protobuf ↔ engine types, at the boundary. Engine types never see protobuf."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from genai_common import bounded_json
from genai_common.errors import InvalidArgument
from genai_proto.genai.v1 import common_pb2, generate_pb2, model_pb2, session_pb2

from ..contract.request import (
    Constraint,
    EngineInfo,
    FinishReason,
    GenerationRequest,
    Priority,
    RequestOutput,
    SamplingParams,
    StoppingCriteria,
    TokenLogprob,
    by_completion,
    merge_outputs,
)
from ..contract.sessions import SessionInfo
from ..model.tokenizer import Tokenizer
from .tools import ToolUse

_PRIORITY = {
    common_pb2.PRIORITY_UNSPECIFIED: Priority.NORMAL,
    common_pb2.PRIORITY_LOW: Priority.LOW,
    common_pb2.PRIORITY_NORMAL: Priority.NORMAL,
    common_pb2.PRIORITY_HIGH: Priority.HIGH,
}
_OVERFLOW: dict[int, str | None] = {
    common_pb2.CONTEXT_OVERFLOW_UNSPECIFIED: None,
    common_pb2.CONTEXT_OVERFLOW_ERROR: "error",
    common_pb2.CONTEXT_OVERFLOW_SLIDE: "slide",
}
_OVERFLOW_PB = {v: k for k, v in _OVERFLOW.items() if v is not None}


def context_overflow(value: int) -> str | None:
    """A ContextOverflow field as the engine's "error"/"slide" (None: unspecified)."""
    if value not in _OVERFLOW:
        raise InvalidArgument(
            f"context_overflow: {value} is not a known value; allowed "
            "CONTEXT_OVERFLOW_ERROR, CONTEXT_OVERFLOW_SLIDE (or unset)"
        )
    return _OVERFLOW[value]


_FINISH = {reason: getattr(common_pb2, f"FINISH_REASON_{reason.value}") for reason in FinishReason}
_RUNNER = {
    "past_present": model_pb2.RUNNER_KIND_PAST_PRESENT,
    "shared_buffer": model_pb2.RUNNER_KIND_SHARED_BUFFER,
    "static_cache": model_pb2.RUNNER_KIND_STATIC_CACHE,
}
_SPECULATIVE_MODE = {
    "": model_pb2.SPECULATIVE_MODE_UNSPECIFIED,
    "prompt-lookup": model_pb2.SPECULATIVE_MODE_PROMPT_LOOKUP,
    "draft": model_pb2.SPECULATIVE_MODE_DRAFT,
    "auto": model_pb2.SPECULATIVE_MODE_AUTO,
}


def _opt(msg: object, name: str) -> object | None:
    return getattr(msg, name) if msg.HasField(name) else None  # type: ignore[attr-defined]


def messages_to_dicts(messages: common_pb2.Messages) -> list[dict[str, Any]]:
    """Chat messages as the template reads them (tool calls in Hugging Face's form)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages.messages):
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.name:
            message["name"] = m.name
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": _arguments(i, j, call)},
                }
                for j, call in enumerate(m.tool_calls)
            ]
        out.append(message)
    return out


def _arguments(i: int, j: int, call: common_pb2.ToolCall) -> Any:
    if not call.arguments_json.strip():
        return {}
    return bounded_json.loads(call.arguments_json, f"messages[{i}].tool_calls[{j}].arguments_json")


def _messages_size(messages: common_pb2.Messages) -> int:
    return sum(
        len(m.content)
        + len(m.role)
        + len(m.name)
        + len(m.tool_call_id)
        + sum(len(c.name) + len(c.arguments_json) + len(c.id) for c in m.tool_calls)
        for m in messages.messages
    )


def prompt_token_ids(
    request: generate_pb2.GenerateRequest | model_pb2.TokenizeRequest,
    tokenizer: Tokenizer,
    max_input_chars: int,
    session: SessionInfo | None = None,
    tools: ToolUse | None = None,
) -> tuple[list[int], str]:
    """Tokenize the request's input; returns the ids and the text they came from.

    For a turn of a session that has history, text gets no special tokens by
    default (no BOS mid-conversation) and messages render as a continuation
    of the conversation rather than a new one. ``tools`` are offered through
    the template when a conversation starts (a continuing session turn keeps
    the first turn's rendering).
    """
    kind = request.WhichOneof("input")
    extra = template_kwargs(request)
    if extra and kind != "messages":
        raise InvalidArgument("chat_template_kwargs: only with messages (the chat template)")
    continuing = session is not None and session.history_tokens > 0
    default_special = not continuing
    add_special = (
        request.add_special_tokens if request.HasField("add_special_tokens") else default_special
    )
    if kind == "messages" and continuing:
        assert session is not None
        if not request.messages.messages:
            raise InvalidArgument("messages: is empty; give at least one message")
        _check_size("messages", _messages_size(request.messages), max_input_chars)
        last = session.last_token_id
        ends_with = tokenizer.token_text(last) if last is not None else ""
        text = tokenizer.render_continuation(
            messages_to_dicts(request.messages), ends_with, extra=extra
        )
        return tokenizer.encode(text, add_special_tokens=False), text
    if kind == "text":
        text = request.text
        _check_size("text", len(text), max_input_chars)
        return tokenizer.encode(text, add_special_tokens=add_special), text
    if kind == "fim":
        if request.session_id:
            raise InvalidArgument(
                "fim: not allowed on a session turn (a fill-in-the-middle prompt is whole)"
            )
        fim = request.fim
        if fim.mode not in generate_pb2.FimMode.values():
            raise InvalidArgument(
                f"fim.mode: {fim.mode} is not a known value; allowed FIM_MODE_PSM, FIM_MODE_SPM"
            )
        _check_size("fim", len(fim.prefix) + len(fim.suffix), max_input_chars)
        spm = fim.mode == generate_pb2.FIM_MODE_SPM
        return tokenizer.fim_ids(fim.prefix, fim.suffix, spm, add_special), fim.prefix
    if kind == "messages":
        if not request.messages.messages:
            raise InvalidArgument("messages: is empty; give at least one message")
        size = _messages_size(request.messages)
        offered = tools.template_tools() if tools is not None else None
        if offered:
            size += len(json.dumps(offered))
        _check_size("messages", size, max_input_chars)
        text = tokenizer.apply_chat_template(
            messages_to_dicts(request.messages), tools=offered, extra=extra
        )
        # The template carries the special tokens itself.
        return tokenizer.encode(text, add_special_tokens=False), text
    if kind == "token_ids":
        return list(request.token_ids.ids), ""
    raise InvalidArgument("input: is empty; give text, token_ids or messages")


# The chat template's own variables (Tokenizer.apply_chat_template), which a
# request's chat_template_kwargs may not set.
_TEMPLATE_VARIABLES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")
MAX_TEMPLATE_KWARGS_BYTES = 65_536


def template_kwargs(
    request: generate_pb2.GenerateRequest | model_pb2.TokenizeRequest,
) -> dict[str, Any]:
    """GenerateRequest.chat_template_kwargs as the template's extra variables
    (empty: none; a TokenizeRequest has none); INVALID_ARGUMENT for anything
    but a JSON object of identifiers, or one that names the template's own
    variables."""
    if not isinstance(request, generate_pb2.GenerateRequest):
        return {}
    raw = request.chat_template_kwargs
    if not raw:
        return {}
    size = len(raw.encode("utf-8", "surrogatepass"))
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise InvalidArgument(
            f"chat_template_kwargs: {size} bytes; allowed at most {MAX_TEMPLATE_KWARGS_BYTES}"
        )
    value = bounded_json.loads(raw, "chat_template_kwargs")
    if not isinstance(value, dict):
        raise InvalidArgument("chat_template_kwargs: must be a JSON object")
    for key in value:
        if not key.isidentifier():
            raise InvalidArgument(f"chat_template_kwargs: {key[:64]!r} is not a variable name")
        if key in _TEMPLATE_VARIABLES:
            raise InvalidArgument(
                f"chat_template_kwargs: {key!r} is the template's own variable; not settable"
            )
    return value


def _check_size(field: str, size: int, limit: int) -> None:
    if size > limit:
        raise InvalidArgument(f"{field}: {size} characters; allowed at most {limit}")


_OPTIONAL_SAMPLING = (
    "repetition_penalty_last_n",
    "typical_p",
    "top_a",
    "xtc_threshold",
    "xtc_probability",
    "dry_multiplier",
    "dry_base",
    "dry_allowed_length",
    "dry_penalty_last_n",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
)


def _decoding_surface(s: generate_pb2.SamplingParams) -> dict[str, Any]:
    """The SamplingParams fields past the classic ones, as ``SamplingParams`` keywords."""
    out: dict[str, Any] = {name: _opt(s, name) for name in _OPTIONAL_SAMPLING}
    out["dry_sequence_breakers"] = tuple(s.dry_sequence_breakers)
    out["logit_bias"] = tuple(sorted((int(k), float(v)) for k, v in s.logit_bias.items()))
    out["banned_token_ids"] = tuple(s.banned_token_ids)
    out["allowed_token_ids"] = tuple(s.allowed_token_ids)
    out["bad_words"] = tuple(s.bad_words)
    return out


def generation_request(
    request: generate_pb2.GenerateRequest, token_ids: Sequence[int]
) -> GenerationRequest:
    if request.priority not in _PRIORITY:
        raise InvalidArgument(
            f"priority: {request.priority} is not a known value; allowed "
            "PRIORITY_LOW, PRIORITY_NORMAL, PRIORITY_HIGH"
        )
    s, st = request.sampling, request.stopping
    sampling = SamplingParams(
        temperature=_opt(s, "temperature"),  # type: ignore[arg-type]
        top_k=_opt(s, "top_k"),  # type: ignore[arg-type]
        top_p=_opt(s, "top_p"),  # type: ignore[arg-type]
        min_p=_opt(s, "min_p"),  # type: ignore[arg-type]
        repetition_penalty=_opt(s, "repetition_penalty"),  # type: ignore[arg-type]
        frequency_penalty=_opt(s, "frequency_penalty"),  # type: ignore[arg-type]
        presence_penalty=_opt(s, "presence_penalty"),  # type: ignore[arg-type]
        seed=_opt(s, "seed"),  # type: ignore[arg-type]
        **_decoding_surface(s),
    )
    stopping = StoppingCriteria(
        max_new_tokens=_opt(st, "max_new_tokens"),  # type: ignore[arg-type]
        min_new_tokens=st.min_new_tokens,
        stop_sequences=tuple(st.stop_sequences),
        stop_token_ids=tuple(st.stop_token_ids),
        ignore_eos=st.ignore_eos,
        include_stop_sequence=st.include_stop_sequence,
        time_limit_ms=_opt(st, "time_limit_ms"),  # type: ignore[arg-type]
    )
    return GenerationRequest(
        request_id=request.request_id,  # never empty: `rpc` assigns one; GenerateBidi needs one
        prompt_token_ids=tuple(token_ids),
        sampling=sampling,
        stopping=stopping,
        top_logprobs=request.top_logprobs,
        prompt_logprobs=request.prompt_logprobs,
        n=max(request.n, 1),
        best_of=_opt(request, "best_of"),  # type: ignore[arg-type]
        priority=_PRIORITY[request.priority],
        session_id=request.session_id or None,
        skip_special_tokens=(
            request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        ),
        cache_salt=_opt(request, "cache_salt"),  # type: ignore[arg-type]
        constraint=constraint(request),
        truncate_prompt_tokens=_opt(request, "truncate_prompt_tokens"),  # type: ignore[arg-type]
        context_overflow=context_overflow(request.context_overflow),
    )


def constraint(request: generate_pb2.GenerateRequest) -> Constraint | None:
    """GenerateRequest.constraint for the engine, which validates the text."""
    if not request.HasField("constraint"):
        return None
    c = request.constraint
    kind = c.WhichOneof("kind")
    if kind is None:
        raise InvalidArgument(
            "constraint: set one of json_schema, regex, grammar, choice, json_object"
        )
    if kind == "choice":
        return Constraint(kind, choices=tuple(c.choice.choices))
    if kind == "json_object":
        if not c.json_object:
            raise InvalidArgument("constraint.json_object: false; set it to true or unset it")
        return Constraint(kind)
    return Constraint(kind, value=getattr(c, kind))


def logprobs(items: Sequence[TokenLogprob]) -> list[common_pb2.TokenLogprob]:
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


def delta(out: RequestOutput) -> generate_pb2.Delta:
    return generate_pb2.Delta(
        text=out.text,
        token_ids=list(out.token_ids),
        logprobs=logprobs(out.logprobs),
        prompt_logprobs=logprobs(out.prompt_logprobs),
        index=max(out.index, 0),
    )


def final(outputs: Sequence[RequestOutput], tools: ToolUse | None = None) -> generate_pb2.Final:
    """The ``Final`` event of a finished request, from all of its outputs."""
    whole, completions = _whole(outputs, tools)
    f = _final(whole, tools)
    for c in completions:
        c.text = ""  # the deltas carry it
    f.completions.extend(completions)
    return f


def _whole(
    outputs: Sequence[RequestOutput], tools: ToolUse | None
) -> tuple[RequestOutput, list[generate_pb2.Completion]]:
    """A request's outputs as one (completion 0's, with the end's usage, for
    n > 1) and its completions (none for n = 1)."""
    if outputs[-1].index >= 0:
        return merge_outputs(*outputs), []
    end = outputs[-1]
    each = by_completion(list(outputs))
    completions = [
        generate_pb2.Completion(
            index=c.index,
            text=c.text,
            token_ids=list(c.token_ids),
            finish_reason=_FINISH[c.finish_reason or FinishReason.MAX_TOKENS],
            stop_sequence=c.stop_sequence,
            logprobs=logprobs(c.logprobs),
            tool_calls=tools.calls(c.text) if tools is not None else (),
        )
        for c in each
    ]
    first = each[0]
    whole = dataclasses.replace(
        end,
        token_ids=first.token_ids,
        text=first.text,
        logprobs=first.logprobs,
        finish_reason=first.finish_reason or end.finish_reason,
        stop_sequence=first.stop_sequence,
        prompt_logprobs=next((o.prompt_logprobs for o in outputs if o.prompt_logprobs), ()),
    )
    return whole, completions


def _final(whole: RequestOutput, tools: ToolUse | None = None) -> generate_pb2.Final:
    usage = whole.usage
    assert whole.finish_reason is not None and usage is not None
    return generate_pb2.Final(
        token_ids=list(whole.token_ids),
        finish_reason=_FINISH[whole.finish_reason],
        stop_sequence=whole.stop_sequence,
        logprobs=logprobs(whole.logprobs),
        usage=common_pb2.Usage(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
            dropped_tokens=usage.dropped_tokens,
        ),
        seed=whole.seed or 0,
        session_id=whole.session_id or "",
        session_tokens=whole.session_tokens,
        request_id=whole.request_id,
        tool_calls=tools.calls(whole.text) if tools is not None else (),
    )


def generate_response(
    outputs: Sequence[RequestOutput], tools: ToolUse | None = None
) -> generate_pb2.GenerateResponse:
    whole, completions = _whole(outputs, tools)
    f = _final(whole, tools)
    return generate_pb2.GenerateResponse(
        text=whole.text,
        token_ids=f.token_ids,
        finish_reason=f.finish_reason,
        stop_sequence=f.stop_sequence,
        logprobs=f.logprobs,
        usage=f.usage,
        seed=f.seed,
        session_id=f.session_id,
        session_tokens=f.session_tokens,
        request_id=f.request_id,
        tool_calls=f.tool_calls,
        prompt_logprobs=logprobs(whole.prompt_logprobs),
        completions=completions,
    )


def _timestamp(seconds: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def session(info: SessionInfo) -> session_pb2.Session:
    return session_pb2.Session(
        session_id=info.session_id,
        created_at=_timestamp(info.created_at),
        last_used_at=_timestamp(info.last_used_at),
        history_tokens=info.history_tokens,
        turns=info.turns,
        idle_ttl_seconds=int(info.idle_ttl_s),
        busy=info.busy,
        metadata=info.metadata,
        context_overflow=_OVERFLOW_PB[info.context_overflow],  # type: ignore[arg-type]
        dropped_tokens=info.dropped_tokens,
    )


def model_info(info: EngineInfo) -> model_pb2.ModelInfo:
    return model_pb2.ModelInfo(
        model_id=info.model_id,
        context_length=info.context_length,
        vocab_size=info.vocab_size,
        eos_token_ids=list(info.eos_token_ids),
        kv_layout=model_pb2.KvLayout(
            num_layers=info.num_layers,
            num_kv_heads=info.num_kv_heads,
            head_dim=info.head_dim,
            dtype=info.kv_dtype,
        ),
        runner_kind=_RUNNER.get(info.runner_kind, model_pb2.RUNNER_KIND_UNSPECIFIED),
        has_chat_template=info.has_chat_template,
        kv_chunk_size=info.kv_chunk_size,
        fim_supported=info.fim_supported,
        attention_windows=list(info.attention_windows),
        speculative_mode=_SPECULATIVE_MODE[info.speculative_mode],  # type: ignore[arg-type]
        speculative_tokens=info.speculative_tokens,
        draft_model_id=info.draft_model_id,
    )
