"""OpenAI's JSON → genai.v1 messages: where the HTTP gateway translates requests
(docs/design.md, "HTTP gateway"; the way back is ``openai_reply``). A body
becomes a ``GenerateRequest``, which then takes the gRPC plane's own path
(validation, limits, tools, sessions).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from genai_common.errors import InvalidArgument
from genai_proto.genai.v1 import common_pb2, generate_pb2

from ..tools import strict_objects

CHAT, COMPLETIONS = "chat", "completions"
DEFAULT_TEMPERATURE = 1.0  # OpenAI's: a request that sets none samples
MAX_TOP_LOGPROBS = {CHAT: 20, COMPLETIONS: 5}  # OpenAI's bounds

# The sampling fields, OpenAI's and vLLM's extras, by their SamplingParams name.
_SAMPLING = {
    "temperature": "temperature",
    "top_p": "top_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    # llama.cpp's and text-generation-webui's samplers, by our names (docs/api.md)
    "typical_p": "typical_p",
    "top_a": "top_a",
    "xtc_threshold": "xtc_threshold",
    "xtc_probability": "xtc_probability",
    "dry_multiplier": "dry_multiplier",
    "dry_base": "dry_base",
    "mirostat_tau": "mirostat_tau",
    "mirostat_eta": "mirostat_eta",
}
# Non-negative integers of SamplingParams, and its lists (JSON arrays of this type).
_SAMPLING_INTEGERS = (
    "repetition_penalty_last_n",
    "dry_allowed_length",
    "dry_penalty_last_n",
    "mirostat",
)
_SAMPLING_LISTS = {
    "dry_sequence_breakers": "string",
    "banned_token_ids": "integer",
    "allowed_token_ids": "integer",
    "bad_words": "string",
}
# Accepted and checked for type, with no effect on the answer: what the OpenAI
# SDKs and agent frameworks send for features this server has no use for (one
# model, no reasoning budget, text out only, no stored completions), by JSON type.
_IGNORED = {
    "model": "string",
    "user": "string",
    "parallel_tool_calls": "boolean",
    "store": "boolean",
    "metadata": "object",
    "service_tier": "string",
    "reasoning_effort": "string",
    "verbosity": "string",
    "modalities": "array",
    "audio": "object",
    "prediction": "object",
    "web_search_options": "object",
    "prompt_cache_key": "string",
    "safety_identifier": "string",
    "prompt_cache_retention": "string",
    "prompt_cache_options": "object",
    "moderation": "object",
    # Deprecated forms the SDK still has in its signature (functions → tools).
    "functions": "array",
    "function_call": "string_or_object",
    # vLLM's extras this server has no use for: the chat template always adds
    # the generation prompt, usage is in the last chunk.
    "add_generation_prompt": "boolean",
    "return_tokens_as_token_ids": "boolean",
    "spaces_between_special_tokens": "boolean",
    "priority": "integer",
    "request_id": "string",
}
# What an assistant message the SDK returned carries besides role, content and
# tool_calls (``message.model_dump()`` sent back): accepted, null or not, and
# unused (a refusal is not a turn the model continues from; no audio).
_MESSAGE_IGNORED = ("refusal", "function_call", "audio", "annotations", "reasoning_content")
# stream_options beyond include_usage: accepted, no effect.
_STREAM_OPTIONS_IGNORED = ("include_obfuscation",)
# vLLM's structured-output fields (guided_* and their successor
# structured_outputs), as constraints.
_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "string_or_object": lambda v: isinstance(v, str | dict),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}
# OpenAI's range (vLLM's too); gRPC's own is wider (docs/api.md).
MAX_TEMPERATURE = 2.0
_COMMON = {
    *_SAMPLING,
    *_SAMPLING_INTEGERS,
    *_SAMPLING_LISTS,
    *_IGNORED,
    "seed",
    "stop",
    "max_tokens",
    "n",
    "stream",
    "stream_options",
    "logit_bias",
    "min_tokens",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "cache_salt",
    "truncate_prompt_tokens",
    "context_overflow",
    "continuous_usage_stats",
    "response_format",
    "structured_outputs",
    *_GUIDED,
}
_FIELDS = {
    CHAT: _COMMON
    | {
        "messages",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "tools",
        "tool_choice",
        "chat_template_kwargs",
    },
    COMPLETIONS: _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix", "prompt_logprobs"},
}


@dataclass
class Call:
    """One translated request: the GenerateRequest and what the reply needs."""

    kind: str  # CHAT | COMPLETIONS
    request: generate_pb2.GenerateRequest
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # alternatives per token to return; None: no logprobs
    # proto field path → the JSON field the client sent (error messages name it).
    names: dict[str, str] = field(default_factory=dict)
    echo: str | None = None  # completions' echo: the prompt text, before the answer
    # vLLM's continuous_usage_stats: usage (prompt and completion tokens so
    # far) in every streamed chunk.
    continuous_usage: bool = False
    # Fields the body had that this server does not know (accepted unless
    # --strict-openai, ``strict``; the gateway logs them).
    unknown: list[str] = field(default_factory=list)
    strict: bool = False

    def unknown_field(self, path: str) -> None:
        """A field this server does not know: listed in ``unknown``, or
        INVALID_ARGUMENT under --strict-openai."""
        if self.strict:
            raise InvalidArgument(f"{path}: unknown field (--strict-openai)")
        self.unknown.append(path)

    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs field, as asked


# -- requests ---------------------------------------------------------------------


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _typed(body: Mapping[str, Any], name: str, check: Callable[[Any], bool], what: str) -> Any:
    value = body.get(name)
    if value is not None and not check(value):
        raise InvalidArgument(f"{name}: {json.dumps(value)[:80]} is not {what}")
    return value


def _number(body: Mapping[str, Any], name: str) -> float | None:
    return _typed(body, name, _is_number, "a number")  # type: ignore[no-any-return]


def _integer(body: Mapping[str, Any], name: str) -> int | None:
    ok = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    return _typed(body, name, ok, "an integer")  # type: ignore[no-any-return]


def _boolean(body: Mapping[str, Any], name: str) -> bool | None:
    return _typed(body, name, lambda v: isinstance(v, bool), "a boolean")  # type: ignore[no-any-return]


def _object(body: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    return _typed(body, name, lambda v: isinstance(v, dict), "an object")  # type: ignore[no-any-return]


def _string(body: Mapping[str, Any], name: str) -> str | None:
    return _typed(body, name, lambda v: isinstance(v, str), "a string")  # type: ignore[no-any-return]


def _non_negative(name: str, value: int | None) -> int | None:
    if value is not None and value < 0:
        raise InvalidArgument(f"{name}: {value} is out of range; allowed >= 0")
    return value


def _check_text(value: Any, path: str) -> None:
    """INVALID_ARGUMENT naming the field of the first string that is not valid
    Unicode text (JSON's \\ud800 escapes decode to lone surrogates, which UTF-8,
    protobuf and the tokenizer refuse)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidArgument(
                f"{path or 'body'}: not valid Unicode text (a lone surrogate at {e.start})"
            ) from e
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, path or "body")
            _check_text(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_text(item, f"{path}[{i}]")


def context_overflow(value: str, where: str = "context_overflow") -> int:
    """ "error" or "slide" as GenerateRequest.context_overflow; INVALID_ARGUMENT otherwise."""
    values = {
        "error": common_pb2.CONTEXT_OVERFLOW_ERROR,
        "slide": common_pb2.CONTEXT_OVERFLOW_SLIDE,
    }
    if value not in values:
        raise InvalidArgument(f"{where}: {value[:64]!r} is not allowed; allowed 'error', 'slide'")
    return values[value]


def parse(
    kind: str, body: Any, session_id: str = "", overflow: str = "", strict: bool = False
) -> Call:
    """The GenerateRequest of an OpenAI ``/v1/chat/completions`` or
    ``/v1/completions`` body; INVALID_ARGUMENT naming the JSON field for an
    ill-typed field or an unsupported value. A field this server does not
    know is accepted and listed in ``Call.unknown`` (as vLLM and llama-server
    accept what they cannot use), or with ``strict`` (``--strict-openai``)
    INVALID_ARGUMENT."""
    if not isinstance(body, dict):
        raise InvalidArgument("body: must be a JSON object")
    _check_text(body, "")
    request = generate_pb2.GenerateRequest(session_id=session_id)
    call = Call(kind, request, strict=strict)
    for name in body:
        if name not in _FIELDS[kind]:
            call.unknown_field(name)
    for name, kind_of in _IGNORED.items():
        what = {"string_or_object": "a string or an object"}.get(
            kind_of, f"a{'n' if kind_of[0] in 'aoi' else ''} {kind_of}"
        )
        _typed(body, name, _JSON_TYPES[kind_of], what)
    _sampling(body, request)
    _stopping(body, call)
    n = _integer(body, "n")
    if n is not None:
        if not 1 <= n < 2**32:
            raise InvalidArgument(f"n: {n} is out of range; allowed >= 1")
        request.n = n
    best_of = _integer(body, "best_of")
    if best_of is not None:
        if not 1 <= best_of < 2**32:
            raise InvalidArgument(f"best_of: {best_of} is out of range; allowed >= 1")
        request.best_of = best_of
    call.stream = bool(_boolean(body, "stream"))
    options = _object(body, "stream_options")
    if options is not None:
        if not call.stream:
            raise InvalidArgument("stream_options: only with stream: true")
        for name in options:
            known = ("include_usage", "continuous_usage_stats", *_STREAM_OPTIONS_IGNORED)
            if name not in known:
                call.unknown_field(f"stream_options.{name}")
        for name in _STREAM_OPTIONS_IGNORED:
            _typed(options, name, _JSON_TYPES["boolean"], "a boolean")
        call.include_usage = bool(_boolean(options, "include_usage"))
        call.continuous_usage = bool(_boolean(options, "continuous_usage_stats"))
    if _boolean(body, "continuous_usage_stats"):  # vLLM also takes it at the top level
        call.continuous_usage = call.stream
    skip = _boolean(body, "skip_special_tokens")
    if skip is not None:
        request.skip_special_tokens = skip
    keep = _integer(body, "truncate_prompt_tokens")
    if keep is not None:
        if not 1 <= keep < 2**32:
            raise InvalidArgument(
                f"truncate_prompt_tokens: {keep} is out of range; allowed [1, 4294967295]"
            )
        request.truncate_prompt_tokens = keep
    if overflow:  # the X-Context-Overflow header
        request.context_overflow = context_overflow(overflow, "X-Context-Overflow")  # type: ignore[assignment]
    mode = _string(body, "context_overflow")
    if mode is not None:
        request.context_overflow = context_overflow(mode)  # type: ignore[assignment]
    salt = _string(body, "cache_salt")
    if salt is not None:
        request.cache_salt = salt
    if kind == CHAT:
        _chat(body, call)
    else:
        _completions(body, call)
    _response_format(body, call)
    _guided(body, call)
    if max(request.n, 1) > 1:
        if call.stream and len(request.tools) and request.tool_choice != "none":
            raise InvalidArgument("n: more than one choice is not streamed with tools")
        if call.echo is not None:
            raise InvalidArgument("n: more than one choice is not possible with echo")
    return call


def _sampling(body: Mapping[str, Any], request: generate_pb2.GenerateRequest) -> None:
    s = request.sampling
    s.temperature = DEFAULT_TEMPERATURE
    for name, proto in _SAMPLING.items():
        if name == "top_k":
            k = _integer(body, name)
            if k is not None and k >= 2**32:
                raise InvalidArgument(f"top_k: {k} is out of range; allowed [-1, 4294967295]")
            # -1 is vLLM's "no filter", as 0 is ours.
            value: float | None = _non_negative(name, 0 if k == -1 else k)
        else:
            value = _number(body, name)
        if name == "temperature" and value is not None and not 0 <= value <= MAX_TEMPERATURE:
            raise InvalidArgument(
                f"temperature: {value} is out of range; allowed [0, {MAX_TEMPERATURE:g}]"
            )
        if value is not None:
            setattr(s, proto, value)
    seed = _non_negative("seed", _integer(body, "seed"))
    if seed is not None:
        s.seed = seed % 2**64
    for name in _SAMPLING_INTEGERS:
        value = _non_negative(name, _integer(body, name))
        if value is not None:
            if value >= 2**32:
                raise InvalidArgument(f"{name}: {value} is out of range; allowed [0, 4294967295]")
            setattr(s, name, value)
    for name, item in _SAMPLING_LISTS.items():
        values = _list_of(body, name, item)
        if values:
            getattr(s, name).extend(values)
    bias = _object(body, "logit_bias")
    for key, value in (bias or {}).items():
        # OpenAI's form: token ids as JSON object keys (strings), biases in [-100, 100].
        if not key.isdigit() or int(key) >= 2**32:
            raise InvalidArgument(f"logit_bias: key {json.dumps(key)[:40]} is not a token id")
        if not _is_number(value):
            raise InvalidArgument(f"logit_bias.{key}: {json.dumps(value)[:80]} is not a number")
        s.logit_bias[int(key)] = float(value)


def _list_of(body: Mapping[str, Any], name: str, item: str) -> list[Any] | None:
    """A JSON array of strings or of non-negative 32-bit integers."""
    values = body.get(name)
    if values is None:
        return None
    if not isinstance(values, list):
        raise InvalidArgument(f"{name}: {json.dumps(values)[:80]} is not an array")
    for i, v in enumerate(values):
        if item == "string" and not isinstance(v, str):
            raise InvalidArgument(f"{name}[{i}]: {json.dumps(v)[:80]} is not a string")
        if item == "integer" and not (
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**32
        ):
            raise InvalidArgument(f"{name}[{i}]: {json.dumps(v)[:80]} is not a token id")
    return values


def _stopping(body: Mapping[str, Any], call: Call) -> None:
    st = call.request.stopping
    limit_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else ""
    limit = _integer(body, "max_completion_tokens") if limit_name else None
    if limit is None:
        limit_name, limit = "max_tokens", _integer(body, "max_tokens")
    if limit is not None:
        if not 1 <= limit < 2**32:
            raise InvalidArgument(f"{limit_name}: {limit} is out of range; allowed [1, 4294967295]")
        st.max_new_tokens = limit
    call.names["stopping.max_new_tokens"] = limit_name
    stop = body.get("stop")
    if isinstance(stop, str):
        st.stop_sequences.append(stop)
    elif isinstance(stop, list) and all(isinstance(x, str) for x in stop):
        st.stop_sequences.extend(stop)
    elif stop is not None:
        raise InvalidArgument("stop: must be a string or a list of strings")
    minimum = _non_negative("min_tokens", _integer(body, "min_tokens"))
    if minimum is not None:
        st.min_new_tokens = min(minimum, 2**32 - 1)
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**32 for x in ids
        ):
            raise InvalidArgument("stop_token_ids: must be a list of token ids")
        st.stop_token_ids.extend(ids)
    st.ignore_eos = bool(_boolean(body, "ignore_eos"))
    st.include_stop_sequence = bool(_boolean(body, "include_stop_str_in_output"))


def _logprobs(call: Call, n: int | None) -> None:
    """Return logprobs with ``n`` alternatives; GenerateRequest.top_logprobs
    needs at least 1 (the extra ones are cut from the reply)."""
    if n is None:
        return
    name = "top_logprobs" if call.kind == CHAT else "logprobs"
    high = MAX_TOP_LOGPROBS[call.kind]
    if not 0 <= n <= high:
        raise InvalidArgument(f"{name}: {n} is out of range; allowed [0, {high}]")
    call.logprobs = n
    call.request.top_logprobs = max(n, 1)
    call.names["top_logprobs"] = name


def _chat(body: Mapping[str, Any], call: Call) -> None:
    request = call.request
    kwargs = _object(body, "chat_template_kwargs")  # vLLM's: the template's extra variables
    if kwargs:
        request.chat_template_kwargs = json.dumps(kwargs)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages: must be a non-empty list of messages")
    for i, m in enumerate(messages):
        request.messages.messages.append(_message(i, m, call))
    call.names["input"] = "messages"
    want = _boolean(body, "logprobs")
    top = _non_negative("top_logprobs", _integer(body, "top_logprobs"))
    if top is not None and not want:
        raise InvalidArgument("top_logprobs: needs logprobs: true")
    _logprobs(call, (top or 0) if want else None)
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise InvalidArgument("tools: must be a list of tools")
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(fn, dict) or t.get("type", "function") != "function":
                raise InvalidArgument(f"tools[{i}]: must be {{type: function, function: {{...}}}}")
            name = fn.get("name")
            if not isinstance(name, str):
                raise InvalidArgument(f"tools[{i}].function.name: must be a string")
            params = fn.get("parameters")
            if params is not None and not isinstance(params, dict):
                raise InvalidArgument(
                    f"tools[{i}].function.parameters: must be a JSON Schema object"
                )
            description = fn.get("description") or ""
            if not isinstance(description, str):
                raise InvalidArgument(f"tools[{i}].function.description: must be a string")
            request.tools.add(
                name=name,
                description=description,
                parameters_json_schema=json.dumps(params) if params is not None else "",
            )
    choice = body.get("tool_choice")
    if isinstance(choice, str):
        request.tool_choice = choice
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict):
            raise InvalidArgument("tool_choice: must be {type: function, function: {name}}")
        if not isinstance(fn.get("name"), str):
            raise InvalidArgument("tool_choice.function.name: must be a string")
        request.tool_choice = fn["name"]
    elif choice is not None:
        raise InvalidArgument("tool_choice: must be a string or {type: function, ...}")


def _content(i: int, content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise InvalidArgument(f"messages[{i}].content[{j}]: only text parts are supported")
            if not isinstance(part.get("text"), str):
                raise InvalidArgument(f"messages[{i}].content[{j}].text: must be a string")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidArgument(f"messages[{i}].content: must be a string or a list of text parts")


def _message(i: int, m: Any, call: Call) -> common_pb2.ChatMessage:
    if not isinstance(m, dict):
        raise InvalidArgument(f"messages[{i}]: must be an object")
    for name in m:
        if name not in ("role", "content", "name", "tool_calls", "tool_call_id", *_MESSAGE_IGNORED):
            call.unknown_field(f"messages[{i}].{name}")
    role = m.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise InvalidArgument(
            f"messages[{i}].role: {json.dumps(role)[:40]} is not one of system, developer, "
            "user, assistant, tool"
        )
    out = common_pb2.ChatMessage(
        role="system" if role == "developer" else role, content=_content(i, m.get("content"))
    )
    for key in ("name", "tool_call_id"):
        value = m.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise InvalidArgument(f"messages[{i}].{key}: must be a string")
            setattr(out, key, value)
    calls = m.get("tool_calls") or []
    if not isinstance(calls, list):
        raise InvalidArgument(f"messages[{i}].tool_calls: must be a list")
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidArgument(f"messages[{i}].tool_calls[{j}].function: needs a name")
        arguments = fn.get("arguments", "")
        if not isinstance(arguments, str):
            raise InvalidArgument(
                f"messages[{i}].tool_calls[{j}].function.arguments: must be a JSON string"
            )
        out.tool_calls.add(id=str(c.get("id") or ""), name=fn["name"], arguments_json=arguments)
    return out


def _response_format(body: Mapping[str, Any], call: Call) -> None:
    request = call.request
    fmt = _object(body, "response_format")
    if fmt is None:
        return
    kind = fmt.get("type")
    if kind == "text":
        return
    if kind == "json_object":
        request.constraint.json_object = True
    elif kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidArgument(
                "response_format.json_schema.schema: must be a JSON Schema object"
            )
        # OpenAI's strict: only the listed properties
        if isinstance(spec, dict) and spec.get("strict") is True:
            schema = strict_objects(schema)
        request.constraint.json_schema = json.dumps(schema)
    else:
        raise InvalidArgument(
            f"response_format.type: {json.dumps(kind)[:40]} is not one of text, json_object, "
            "json_schema"
        )


def _guided(body: Mapping[str, Any], call: Call) -> None:
    """vLLM's structured output: ``structured_outputs`` {json, regex, choice,
    grammar, json_object} or the older ``guided_json``/``guided_regex``/
    ``guided_choice``/``guided_grammar``, as the request's constraint (at
    most one, with ``response_format`` too)."""
    given: list[tuple[str, str, Any]] = []  # (field the client sent, kind, value)
    outputs = _object(body, "structured_outputs")
    for key, value in (outputs or {}).items():
        if key in ("json", "regex", "choice", "grammar", "json_object"):
            if value is not None and value is not False:
                given.append((f"structured_outputs.{key}", key, value))
        else:  # vLLM's options for its own backends (disable_fallback, ...): unused
            call.unknown_field(f"structured_outputs.{key}")
    for name, key in _GUIDED.items():
        if body.get(name) is not None:
            given.append((name, key, body[name]))
    if not given:
        return
    if len(given) > 1 or call.request.HasField("constraint"):
        names = [g[0] for g in given]
        if call.request.HasField("constraint"):
            names.insert(0, "response_format")
        raise InvalidArgument(f"{names[-1]}: at most one structured output; got {', '.join(names)}")
    name, key, value = given[0]
    c = call.request.constraint
    if key == "json":
        if isinstance(value, dict):
            value = json.dumps(value)
        if not isinstance(value, str):
            raise InvalidArgument(f"{name}: must be a JSON Schema (an object or its JSON text)")
        c.json_schema = value
    elif key in ("regex", "grammar"):
        if not isinstance(value, str):
            raise InvalidArgument(f"{name}: must be a string")
        setattr(c, key, value)
    elif key == "choice":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise InvalidArgument(f"{name}: must be a list of strings")
        c.choice.choices.extend(value)
    else:  # json_object
        if value is not True:
            raise InvalidArgument(f"{name}: must be true")
        c.json_object = True
    field_name = {"json": "json_schema"}.get(key, key)
    call.names["constraint"] = call.names[f"constraint.{field_name}"] = name


def _completions(body: Mapping[str, Any], call: Call) -> None:
    request, prompt = call.request, body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        request.text = prompt
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**32 for x in prompt)
    ):
        request.token_ids.ids.extend(prompt)
    else:
        raise InvalidArgument(
            "prompt: must be a string or a list of token ids (one prompt per request)"
        )
    for proto in ("input", "text", "token_ids"):
        call.names[proto] = "prompt"
    _logprobs(call, _integer(body, "logprobs"))
    if _boolean(body, "echo"):
        # OpenAI's echo: the prompt before the answer, and with logprobs its
        # tokens' logprobs too (the first token's null).
        if not request.HasField("text"):
            raise InvalidArgument("echo: needs a text prompt, not token ids")
        call.echo = request.text
        if call.logprobs is not None:
            request.prompt_logprobs = max(call.logprobs, 1)
            call.names["prompt_logprobs"] = "echo"
    asked = _non_negative("prompt_logprobs", _integer(body, "prompt_logprobs"))
    if asked:  # vLLM's: every prompt token's logprob with N alternatives
        if asked >= 2**32:
            raise InvalidArgument(f"prompt_logprobs: {asked} is out of range")
        call.prompt_logprobs = asked
        request.prompt_logprobs = max(request.prompt_logprobs, asked)
    suffix = _string(body, "suffix")
    if suffix is not None:
        # OpenAI's insert mode: fill in between the prompt and the suffix.
        if not request.HasField("text"):
            raise InvalidArgument("suffix: needs a text prompt, not token ids")
        if call.echo is not None:
            raise InvalidArgument("suffix: not with echo")
        request.fim.CopyFrom(generate_pb2.Fim(prefix=request.text, suffix=suffix))
        call.names["fim"] = "suffix"


def continuation(
    messages: Sequence[common_pb2.ChatMessage],
) -> list[common_pb2.ChatMessage]:
    """A session turn's new messages, from a conversation an OpenAI client
    resent whole: those after the last assistant message (the session's
    history already holds everything up to its answer)."""
    last = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=-1)
    return list(messages[last + 1 :])


def continue_conversation(call: Call) -> None:
    """Keep only the new messages of a chat turn of a session that has history."""
    messages = call.request.messages.messages
    new = continuation(messages)
    if not new:
        raise InvalidArgument(
            "messages: nothing after the last assistant message; a session turn needs a new message"
        )
    del messages[:]
    messages.extend(new)
