"""Building a ``GenerateRequest`` from the client's keyword options: the
generate calls' options (``GenerateOptions``), chat messages, structured
output and tools. Part of the protobuf boundary of ``_convert``."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypedDict

from genai_client.types import ChatMessage, Tool, ToolCall
from genai_proto.genai.v1 import common_pb2, generate_pb2

MessageLike = ChatMessage | Mapping[str, Any] | tuple[str, str]


class GenerateOptions(TypedDict, total=False):
    """Keyword options of every generate call (``generate``, ``stream``,
    ``bidi().start``, and the same on sessions). ``None`` (or absent) leaves
    a field unset so the server's default applies. See
    ``protos/genai/v1/generate.proto`` for exact semantics.

    Input (exactly one of the positional ``prompt``, ``token_ids``,
    ``messages`` and fill-in-the-middle): ``token_ids`` — a token-id prompt
    used as-is; ``messages`` — chat messages (``ChatMessage``, ``{"role",
    "content"}`` mappings or ``(role, content)`` pairs) rendered with the
    model's chat template; ``fim_prefix`` and/or ``fim_suffix`` — the text
    before and after the gap the model fills (``fim_mode`` "psm", the
    default, or "spm"; the model needs FIM tokens, ``ModelInfo.fim_supported``).

    Sampling: ``temperature`` (None/0: greedy), ``top_k``, ``top_p``,
    ``min_p``, ``repetition_penalty``, ``frequency_penalty``,
    ``presence_penalty``, ``seed``; ``repetition_penalty_last_n``,
    ``typical_p``, ``top_a``, ``xtc_threshold``, ``xtc_probability``,
    ``dry_multiplier``, ``dry_base``, ``dry_allowed_length``,
    ``dry_penalty_last_n``, ``dry_sequence_breakers``, ``mirostat`` (2:
    Mirostat v2), ``mirostat_tau``, ``mirostat_eta``; logit controls:
    ``logit_bias`` (a mapping of token id to bias, in [-100, 100]),
    ``banned_token_ids``, ``allowed_token_ids``, ``bad_words``.

    Stopping: ``max_new_tokens``, ``min_new_tokens``, ``stop`` (a string or a
    list of stop sequences), ``stop_token_ids``, ``ignore_eos``,
    ``include_stop_sequence``, ``time_limit_ms``.

    Other: ``session_id`` (make the request a turn of that session),
    ``top_logprobs`` (N alternatives per token; 0: no logprobs),
    ``prompt_logprobs`` (N: every prompt token's logprob with N alternatives,
    in ``GenerationResult.prompt_logprobs``), ``n`` and ``best_of`` (several
    completions, in ``GenerationResult.completions``; a stream's deltas name
    theirs in ``Delta.index``), ``priority``
    ("low", "normal" or "high"), ``add_special_tokens``,
    ``skip_special_tokens``, ``request_id`` (default: the server assigns one;
    ``bidi().start`` generates one), ``cache_salt`` (only requests with the
    same salt share reused prompt KV), ``truncate_prompt_tokens`` (a longer
    prompt keeps its first sink tokens and its last ones, this many in all;
    ``Usage.dropped_tokens`` counts the rest), ``context_overflow`` ("error":
    stop at the context window; "slide": drop the oldest tokens after the
    sink tokens and go on; unset: the session's or the server's default),
    ``chat_template_kwargs`` (with ``messages``: more variables for the
    model's chat template, e.g. ``{"enable_thinking": False}`` for Qwen3).

    Structured output (at most one): ``json_schema`` (a JSON Schema, as a
    mapping or JSON text), ``regex``, ``grammar`` (Lark, or GBNF), ``choice``
    (the allowed answers), ``json_object`` (True: any JSON object).

    Tools (with ``messages``): ``tools`` (``Tool`` objects or mappings, OpenAI's
    function form accepted) and ``tool_choice`` ("auto", "none", "required"
    or a tool's name); calls come back as ``GenerationResult.tool_calls``.
    """

    token_ids: Sequence[int] | None
    messages: Sequence[MessageLike] | None
    fim_prefix: str | None
    fim_suffix: str | None
    fim_mode: str | None
    session_id: str | None
    max_new_tokens: int | None
    min_new_tokens: int | None
    temperature: float | None
    top_k: int | None
    top_p: float | None
    min_p: float | None
    repetition_penalty: float | None
    frequency_penalty: float | None
    presence_penalty: float | None
    seed: int | None
    repetition_penalty_last_n: int | None
    typical_p: float | None
    top_a: float | None
    xtc_threshold: float | None
    xtc_probability: float | None
    dry_multiplier: float | None
    dry_base: float | None
    dry_allowed_length: int | None
    dry_penalty_last_n: int | None
    dry_sequence_breakers: Sequence[str] | None
    mirostat: int | None
    mirostat_tau: float | None
    mirostat_eta: float | None
    logit_bias: Mapping[int, float] | None
    banned_token_ids: Sequence[int] | None
    allowed_token_ids: Sequence[int] | None
    bad_words: Sequence[str] | None
    stop: str | Sequence[str] | None
    stop_token_ids: Sequence[int] | None
    ignore_eos: bool | None
    include_stop_sequence: bool | None
    time_limit_ms: int | None
    top_logprobs: int | None
    prompt_logprobs: int | None
    n: int | None
    best_of: int | None
    priority: str | None
    add_special_tokens: bool | None
    skip_special_tokens: bool | None
    request_id: str | None
    cache_salt: str | None
    truncate_prompt_tokens: int | None
    chat_template_kwargs: Mapping[str, Any] | None
    context_overflow: str | None
    json_schema: Mapping[str, Any] | str | None
    regex: str | None
    grammar: str | None
    choice: Sequence[str] | None
    json_object: bool | None
    tools: Sequence[Tool | Mapping[str, Any]] | None
    tool_choice: str | None


def _set_optional(message: object, **values: object) -> None:
    for name, value in values.items():
        if value is not None:
            setattr(message, name, value)


def _tool_call(call: ToolCall | Mapping[str, Any]) -> common_pb2.ToolCall:
    if isinstance(call, ToolCall):
        return common_pb2.ToolCall(id=call.id, name=call.name, arguments_json=call.arguments_json)
    # Ours ({id, name, arguments_json}) or OpenAI's ({id, type, function: {name, arguments}}).
    spec = call.get("function", call)
    arguments = spec.get("arguments_json", spec.get("arguments", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return common_pb2.ToolCall(id=call.get("id", ""), name=spec["name"], arguments_json=arguments)


def _chat_message(message: MessageLike) -> common_pb2.ChatMessage:
    if isinstance(message, ChatMessage):
        return common_pb2.ChatMessage(
            role=message.role,
            content=message.content,
            name=message.name,
            tool_call_id=message.tool_call_id,
            tool_calls=[_tool_call(c) for c in message.tool_calls],
        )
    if isinstance(message, tuple):
        role, content = message
        return common_pb2.ChatMessage(role=role, content=content)
    return common_pb2.ChatMessage(
        role=message["role"],
        content=message["content"],
        name=message.get("name", ""),
        tool_call_id=message.get("tool_call_id", ""),
        tool_calls=[_tool_call(c) for c in message.get("tool_calls", ())],
    )


def tool_proto(tool: Tool | Mapping[str, Any]) -> generate_pb2.Tool:
    """A ``Tool``, or a mapping with name, description and parameters (a JSON
    Schema mapping or text; OpenAI's ``{"type": "function", "function": {...}}``
    form too)."""
    if isinstance(tool, Tool):
        name, description, parameters = tool.name, tool.description, tool.parameters
    else:
        spec = tool.get("function", tool)
        name, description = spec["name"], spec.get("description", "")
        parameters = spec.get("parameters")
    if parameters is not None and not isinstance(parameters, str):
        parameters = json.dumps(parameters)
    return generate_pb2.Tool(
        name=name, description=description, parameters_json_schema=parameters or ""
    )


def messages_proto(messages: Iterable[MessageLike]) -> common_pb2.Messages:
    return common_pb2.Messages(messages=[_chat_message(m) for m in messages])


def priority_proto(priority: str | None) -> common_pb2.Priority:
    if priority is None:
        return common_pb2.PRIORITY_UNSPECIFIED
    name = priority.upper().removeprefix("PRIORITY_")
    try:
        return common_pb2.Priority.Value("PRIORITY_" + name)
    except ValueError:
        raise ValueError(f"priority {priority!r} is not one of 'low', 'normal', 'high'") from None


def _enum_option(enum: Any, prefix: str, names: tuple[str, ...], field: str, value: str) -> int:
    """A string option (case-insensitive, with or without the enum's prefix)
    as its proto enum value; ValueError naming ``field`` and the choices."""
    name = value.upper().removeprefix(prefix)
    if name not in names:
        choices = ", ".join(repr(n.lower()) for n in names)
        raise ValueError(f"{field} {value!r} is not one of {choices}")
    return int(enum.Value(prefix + name))


def fim_mode_proto(mode: str | None) -> generate_pb2.FimMode:
    """ "psm" or "spm" (or None: unset, PSM) as a FimMode value."""
    if mode is None:
        return generate_pb2.FIM_MODE_UNSPECIFIED
    return _enum_option(generate_pb2.FimMode, "FIM_MODE_", ("PSM", "SPM"), "fim_mode", mode)  # type: ignore[return-value]


def context_overflow_proto(mode: str | None) -> common_pb2.ContextOverflow:
    """ "error" or "slide" (or None: unset) as a ContextOverflow value."""
    if mode is None:
        return common_pb2.CONTEXT_OVERFLOW_UNSPECIFIED
    return _enum_option(  # type: ignore[return-value]
        common_pb2.ContextOverflow,
        "CONTEXT_OVERFLOW_",
        ("ERROR", "SLIDE"),
        "context_overflow",
        mode,
    )


def generate_request(
    prompt: str | None = None,
    *,
    token_ids: Sequence[int] | None = None,
    messages: Sequence[MessageLike] | None = None,
    fim_prefix: str | None = None,
    fim_suffix: str | None = None,
    fim_mode: str | None = None,
    session_id: str | None = None,
    max_new_tokens: int | None = None,
    min_new_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    seed: int | None = None,
    repetition_penalty_last_n: int | None = None,
    typical_p: float | None = None,
    top_a: float | None = None,
    xtc_threshold: float | None = None,
    xtc_probability: float | None = None,
    dry_multiplier: float | None = None,
    dry_base: float | None = None,
    dry_allowed_length: int | None = None,
    dry_penalty_last_n: int | None = None,
    dry_sequence_breakers: Sequence[str] | None = None,
    mirostat: int | None = None,
    mirostat_tau: float | None = None,
    mirostat_eta: float | None = None,
    logit_bias: Mapping[int, float] | None = None,
    banned_token_ids: Sequence[int] | None = None,
    allowed_token_ids: Sequence[int] | None = None,
    bad_words: Sequence[str] | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    ignore_eos: bool | None = None,
    include_stop_sequence: bool | None = None,
    time_limit_ms: int | None = None,
    top_logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    n: int | None = None,
    best_of: int | None = None,
    priority: str | None = None,
    add_special_tokens: bool | None = None,
    skip_special_tokens: bool | None = None,
    request_id: str | None = None,
    cache_salt: str | None = None,
    truncate_prompt_tokens: int | None = None,
    context_overflow: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    json_schema: Mapping[str, Any] | str | None = None,
    regex: str | None = None,
    grammar: str | None = None,
    choice: Sequence[str] | None = None,
    json_object: bool | None = None,
    tools: Sequence[Tool | Mapping[str, Any]] | None = None,
    tool_choice: str | None = None,
) -> generate_pb2.GenerateRequest:
    """Build a GenerateRequest; ``None`` leaves a field unset (server default)."""
    fim = fim_prefix is not None or fim_suffix is not None
    given = [
        name
        for name, value in (
            ("prompt", prompt),
            ("token_ids", token_ids),
            ("messages", messages),
            ("fim_prefix/fim_suffix", True if fim else None),
        )
        if value is not None
    ]
    if len(given) != 1:
        raise ValueError(
            "give exactly one of prompt, token_ids, messages, fim_prefix/fim_suffix"
            + (f" (got {', '.join(given)})" if given else "")
        )
    if fim_mode is not None and not fim:
        raise ValueError("fim_mode: only with fim_prefix or fim_suffix")
    request = generate_pb2.GenerateRequest(
        request_id=request_id or "",
        session_id=session_id or "",
        top_logprobs=top_logprobs or 0,
        prompt_logprobs=prompt_logprobs or 0,
        n=n or 0,
        priority=priority_proto(priority),
        context_overflow=context_overflow_proto(context_overflow),
    )
    if prompt is not None:
        request.text = prompt
    elif token_ids is not None:
        request.token_ids.ids.extend(token_ids)
    elif messages is not None:
        request.messages.CopyFrom(messages_proto(messages))
    else:
        request.fim.CopyFrom(
            generate_pb2.Fim(
                prefix=fim_prefix or "", suffix=fim_suffix or "", mode=fim_mode_proto(fim_mode)
            )
        )
    if chat_template_kwargs:
        request.chat_template_kwargs = json.dumps(dict(chat_template_kwargs))
    _set_optional(
        request,
        add_special_tokens=add_special_tokens,
        skip_special_tokens=skip_special_tokens,
        cache_salt=cache_salt,
        truncate_prompt_tokens=truncate_prompt_tokens,
        best_of=best_of,
    )
    sampling = generate_pb2.SamplingParams()
    _set_optional(
        sampling,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        seed=seed,
        repetition_penalty_last_n=repetition_penalty_last_n,
        typical_p=typical_p,
        top_a=top_a,
        xtc_threshold=xtc_threshold,
        xtc_probability=xtc_probability,
        dry_multiplier=dry_multiplier,
        dry_base=dry_base,
        dry_allowed_length=dry_allowed_length,
        dry_penalty_last_n=dry_penalty_last_n,
        mirostat=mirostat,
        mirostat_tau=mirostat_tau,
        mirostat_eta=mirostat_eta,
    )
    if dry_sequence_breakers:
        sampling.dry_sequence_breakers.extend(dry_sequence_breakers)
    if logit_bias:
        for token, bias in logit_bias.items():
            sampling.logit_bias[int(token)] = float(bias)
    if banned_token_ids:
        sampling.banned_token_ids.extend(banned_token_ids)
    if allowed_token_ids:
        sampling.allowed_token_ids.extend(allowed_token_ids)
    if bad_words:
        if isinstance(bad_words, str):
            raise ValueError("bad_words: give a list of strings, not one string")
        sampling.bad_words.extend(bad_words)
    if sampling.ListFields():
        request.sampling.CopyFrom(sampling)
    stopping = generate_pb2.StoppingCriteria()
    _set_optional(
        stopping,
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens,
        ignore_eos=ignore_eos,
        include_stop_sequence=include_stop_sequence,
        time_limit_ms=time_limit_ms,
    )
    if stop is not None:
        stopping.stop_sequences.extend([stop] if isinstance(stop, str) else stop)
    if stop_token_ids is not None:
        stopping.stop_token_ids.extend(stop_token_ids)
    if stopping.ListFields():
        request.stopping.CopyFrom(stopping)
    constraint = constraint_proto(json_schema, regex, grammar, choice, json_object)
    if constraint is not None:
        request.constraint.CopyFrom(constraint)
    if tools:
        request.tools.extend(tool_proto(t) for t in tools)
    if tool_choice is not None:
        request.tool_choice = tool_choice
    return request


def constraint_proto(
    json_schema: Mapping[str, Any] | str | None = None,
    regex: str | None = None,
    grammar: str | None = None,
    choice: Sequence[str] | None = None,
    json_object: bool | None = None,
) -> generate_pb2.Constraint | None:
    """The request's Constraint from the structured-output options (at most one)."""
    given = {
        name: value
        for name, value in (
            ("json_schema", json_schema),
            ("regex", regex),
            ("grammar", grammar),
            ("choice", choice),
            ("json_object", json_object or None),
        )
        if value is not None
    }
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"give at most one constraint (got {', '.join(given)})")
    if json_schema is not None:
        text = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
        return generate_pb2.Constraint(json_schema=text)
    if regex is not None:
        return generate_pb2.Constraint(regex=regex)
    if grammar is not None:
        return generate_pb2.Constraint(grammar=grammar)
    if choice is not None:
        if isinstance(choice, str):
            raise ValueError("choice: give a list of strings, not one string")
        return generate_pb2.Constraint(choice=generate_pb2.Choice(choices=list(choice)))
    return generate_pb2.Constraint(json_object=True)
