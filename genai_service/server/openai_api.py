"""OpenAI's JSON ↔ genai.v1 messages: the one place the HTTP gateway translates
(docs/design.md, "HTTP gateway"). Requests become a ``GenerateRequest``, which
then takes the gRPC plane's own path (validation, limits, tools, sessions);
``Delta``/``Final`` events become OpenAI's responses and stream chunks, and
domain errors OpenAI's error object.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from genai_common.errors import GenAIError, InvalidArgument
from genai_proto.genai.v1 import common_pb2, generate_pb2

from ..engine.tokenizer import TOOL_CALL_OPEN

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
}
# Accepted and checked, with no effect on the answer.
_IGNORED = {"model", "user", "parallel_tool_calls", "store", "metadata", "service_tier"}
_COMMON = {
    *_SAMPLING,
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
}
_FIELDS = {
    CHAT: _COMMON
    | {
        "messages",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "response_format",
        "tools",
        "tool_choice",
    },
    COMPLETIONS: _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"},
}
_FINISH = {
    common_pb2.FINISH_REASON_EOS_TOKEN: "stop",
    common_pb2.FINISH_REASON_STOP_SEQUENCE: "stop",
    common_pb2.FINISH_REASON_MAX_TOKENS: "length",
    common_pb2.FINISH_REASON_CONTEXT_LENGTH: "length",
    common_pb2.FINISH_REASON_TIME_LIMIT: "length",
    common_pb2.FINISH_REASON_CANCELLED: "abort",  # as vLLM reports it
}
# HTTP status and OpenAI error type of each gRPC status code (docs/design.md,
# "HTTP gateway"; the gRPC side: "Status codes").
HTTP_STATUS: dict[str, tuple[int, str]] = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "FAILED_PRECONDITION": (409, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "PERMISSION_DENIED": (403, "permission_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "CANCELLED": (499, "invalid_request_error"),
    "UNAVAILABLE": (503, "server_error"),
    "DEADLINE_EXCEEDED": (504, "server_error"),
    "DATA_LOSS": (500, "server_error"),
    "INTERNAL": (500, "server_error"),
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


def parse(kind: str, body: Any, session_id: str = "") -> Call:
    """The GenerateRequest of an OpenAI ``/v1/chat/completions`` or
    ``/v1/completions`` body; INVALID_ARGUMENT naming the JSON field for an
    unknown or ill-typed field or an unsupported value."""
    if not isinstance(body, dict):
        raise InvalidArgument("body: must be a JSON object")
    for name in body:
        if name not in _FIELDS[kind]:
            raise InvalidArgument(f"{name}: unknown field")
    _string(body, "model")
    request = generate_pb2.GenerateRequest(session_id=session_id)
    call = Call(kind, request)
    _sampling(body, request)
    _stopping(body, call)
    n = _integer(body, "n")
    if n is not None and n != 1:
        raise InvalidArgument(f"n: {n} is not supported; only one choice per request (n: 1)")
    best_of = _integer(body, "best_of")
    if best_of is not None and best_of != 1:
        raise InvalidArgument(f"best_of: {best_of} is not supported; allowed 1")
    if _object(body, "logit_bias"):
        raise InvalidArgument("logit_bias: is not supported; send {} or leave it out")
    call.stream = bool(_boolean(body, "stream"))
    options = _object(body, "stream_options")
    if options is not None:
        if not call.stream:
            raise InvalidArgument("stream_options: only with stream: true")
        for name in options:
            if name != "include_usage":
                raise InvalidArgument(f"stream_options.{name}: unknown field")
        call.include_usage = bool(_boolean(options, "include_usage"))
    skip = _boolean(body, "skip_special_tokens")
    if skip is not None:
        request.skip_special_tokens = skip
    salt = _string(body, "cache_salt")
    if salt is not None:
        request.cache_salt = salt
    if kind == CHAT:
        _chat(body, call)
    else:
        _completions(body, call)
    return call


def _sampling(body: Mapping[str, Any], request: generate_pb2.GenerateRequest) -> None:
    s = request.sampling
    s.temperature = DEFAULT_TEMPERATURE
    for name, proto in _SAMPLING.items():
        if name == "top_k":
            k = _integer(body, name)
            # -1 is vLLM's "no filter", as 0 is ours.
            value: float | None = _non_negative(name, 0 if k == -1 else k)
        else:
            value = _number(body, name)
        if value is not None:
            setattr(s, proto, value)
    seed = _non_negative("seed", _integer(body, "seed"))
    if seed is not None:
        s.seed = seed % 2**64


def _stopping(body: Mapping[str, Any], call: Call) -> None:
    st = call.request.stopping
    limit_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else ""
    limit = _integer(body, "max_completion_tokens") if limit_name else None
    if limit is None:
        limit_name, limit = "max_tokens", _integer(body, "max_tokens")
    if limit is not None:
        if limit < 1:
            raise InvalidArgument(f"{limit_name}: {limit} is out of range; allowed >= 1")
        st.max_new_tokens = min(limit, 2**32 - 1)
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
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages: must be a non-empty list of messages")
    for i, m in enumerate(messages):
        request.messages.messages.append(_message(i, m))
    call.names["input"] = "messages"
    want = _boolean(body, "logprobs")
    top = _non_negative("top_logprobs", _integer(body, "top_logprobs"))
    if top is not None and not want:
        raise InvalidArgument("top_logprobs: needs logprobs: true")
    _logprobs(call, (top or 0) if want else None)
    _response_format(body, request)
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


def _message(i: int, m: Any) -> common_pb2.ChatMessage:
    if not isinstance(m, dict):
        raise InvalidArgument(f"messages[{i}]: must be an object")
    for name in m:
        if name not in ("role", "content", "name", "tool_calls", "tool_call_id"):
            raise InvalidArgument(f"messages[{i}].{name}: unknown field")
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


def _response_format(body: Mapping[str, Any], request: generate_pb2.GenerateRequest) -> None:
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
        request.constraint.json_schema = json.dumps(schema)
    else:
        raise InvalidArgument(
            f"response_format.type: {json.dumps(kind)[:40]} is not one of text, json_object, "
            "json_schema"
        )


def _completions(body: Mapping[str, Any], call: Call) -> None:
    request, prompt = call.request, body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        request.text = prompt
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in prompt)
    ):
        request.token_ids.ids.extend(prompt)
    else:
        raise InvalidArgument(
            "prompt: must be a string or a list of token ids (one prompt per request)"
        )
    for proto in ("input", "text", "token_ids"):
        call.names[proto] = "prompt"
    if _boolean(body, "echo"):
        raise InvalidArgument("echo: true is not supported")
    if _string(body, "suffix"):
        raise InvalidArgument("suffix: is not supported")
    _logprobs(call, _integer(body, "logprobs"))


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


def is_final(event: generate_pb2.Delta | generate_pb2.Final) -> bool:
    return isinstance(event, generate_pb2.Final)


# -- errors -----------------------------------------------------------------------

_PATH = re.compile(r"^(?P<path>[A-Za-z_][\w.\[\]]*): ")
_RENAMES = (
    (re.compile(r"^sampling\.(\w+)"), r"\1"),
    (re.compile(r"^stopping\.stop_sequences"), "stop"),
    (re.compile(r"^stopping\.min_new_tokens"), "min_tokens"),
    (re.compile(r"^stopping\.stop_token_ids"), "stop_token_ids"),
    (re.compile(r"^stopping\.time_limit_ms"), "time_limit_ms"),
    (re.compile(r"^constraint\.json_schema"), "response_format.json_schema.schema"),
    (re.compile(r"^constraint(\.json_object)?"), "response_format"),
    (re.compile(r"^tools\[(\d+)\]\.parameters_json_schema"), r"tools[\1].function.parameters"),
    (re.compile(r"^tools\[(\d+)\]\.name"), r"tools[\1].function.name"),
    (
        re.compile(r"^messages\[(\d+)\]\.tool_calls\[(\d+)\]\.arguments_json"),
        r"messages[\1].tool_calls[\2].function.arguments",
    ),
)


def error_body(exc: GenAIError, names: Mapping[str, str] | None = None) -> tuple[int, dict]:
    """The HTTP status and OpenAI error object of a domain error; a bad
    argument's message and ``param`` name the JSON field the client sent."""
    status, kind = HTTP_STATUS.get(exc.code, (500, "server_error"))
    message, param = exc.message, None
    if isinstance(exc, InvalidArgument):
        path, _ = exc.field_violation()
        if path:
            renamed = _rename(path, names or {})
            message = renamed + message[len(path) :]
            param = renamed
    error = {"message": message, "type": kind, "param": param, "code": exc.code.lower()}
    return status, {"error": error}


def _rename(path: str, names: Mapping[str, str]) -> str:
    head = re.match(r"[A-Za-z_][\w.]*", path)
    if head and names.get(head.group()):
        return names[head.group()] + path[head.end() :]
    for pattern, replacement in _RENAMES:
        if pattern.match(path):
            return pattern.sub(replacement, path, count=1)
    return path


# -- responses --------------------------------------------------------------------


def usage(u: common_pb2.Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def finish_reason(final: generate_pb2.Final) -> str:
    if final.tool_calls:
        return "tool_calls"
    return _FINISH.get(final.finish_reason, "stop")


def tool_calls(calls: Sequence[common_pb2.ToolCall]) -> list[dict[str, Any]]:
    return [
        {
            "id": c.id,
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments_json},
        }
        for c in calls
    ]


def logprobs(call: Call, items: Sequence[common_pb2.TokenLogprob], offset: int = 0) -> Any:
    """A choice's ``logprobs`` in the shape of the call's endpoint (None: none asked)."""
    if call.logprobs is None:
        return None
    n = call.logprobs
    if call.kind == CHAT:

        def entry(text: str, lp: float) -> dict[str, Any]:
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        return {
            "content": [
                {
                    **entry(t.text, t.logprob),
                    "top_logprobs": [entry(a.text, a.logprob) for a in t.top[:n]],
                }
                for t in items
            ]
        }
    offsets, at = [], offset
    for t in items:
        offsets.append(at)
        at += len(t.text)
    return {
        "tokens": [t.text for t in items],
        "token_logprobs": [t.logprob for t in items],
        "top_logprobs": [{a.text: a.logprob for a in t.top[:n]} for t in items],
        "text_offset": offsets,
    }


class Reply:
    """Builds one call's response or stream chunks, from its events."""

    def __init__(self, call: Call, model: str, request_id: str) -> None:
        self.call = call
        self.model = model
        prefix = "chatcmpl-" if call.kind == CHAT else "cmpl-"
        self.id = prefix + request_id
        self.created = int(time.time())
        self.object = "chat.completion" if call.kind == CHAT else "text_completion"
        self.text_len = 0  # completions' text_offset of the next token
        self.sent_role = False
        # With tools offered, streamed content stops where a call starts (the
        # call comes whole, as tool_calls, at the end).
        self.hold = (
            call.kind == CHAT and len(call.request.tools) > 0 and call.request.tool_choice != "none"
        )
        self.buffer = ""
        self.in_call = False

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _choice(self, text: str | None, lps: Any, finish: str | None, final: Any = None) -> dict:
        choice: dict[str, Any] = {"index": 0}
        if self.call.kind == CHAT:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if final is not None and final.tool_calls:
                message["tool_calls"] = tool_calls(final.tool_calls)
            choice["message"] = message
        else:
            choice["text"] = text
        choice["logprobs"] = lps
        choice["finish_reason"] = finish
        return choice

    def response(self, text: str, final: generate_pb2.Final) -> dict[str, Any]:
        """The unary response body."""
        content: str | None = text
        if self.call.kind == CHAT and final.tool_calls:
            content = text.split(TOOL_CALL_OPEN, 1)[0].strip() or None
        body = self._base(self.object)
        body["choices"] = [
            self._choice(content, logprobs(self.call, final.logprobs), finish_reason(final), final)
        ]
        body["usage"] = usage(final.usage)
        body["system_fingerprint"] = None
        return body

    def _chunk(self, delta: dict[str, Any] | str, lps: Any, finish: str | None) -> dict:
        chunk = self._base("chat.completion.chunk" if self.call.kind == CHAT else self.object)
        choice: dict[str, Any] = {"index": 0}
        if self.call.kind == CHAT:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        choice["logprobs"] = lps
        choice["finish_reason"] = finish
        chunk["choices"] = [choice]
        if self.call.include_usage:
            chunk["usage"] = None
        return chunk

    def _visible(self, text: str, end: bool) -> str:
        """The part of ``text`` to stream as content (all of it without tools)."""
        if not self.hold or self.in_call:
            return "" if self.in_call else text
        self.buffer += text
        at = self.buffer.find(TOOL_CALL_OPEN)
        if at >= 0:
            self.in_call = True
            out, self.buffer = self.buffer[:at], ""
            return out
        keep = 0 if end else _partial_tag(self.buffer)
        out, self.buffer = (
            self.buffer[: len(self.buffer) - keep],
            self.buffer[len(self.buffer) - keep :],
        )
        return out

    def delta_chunk(self, delta: generate_pb2.Delta) -> dict[str, Any] | None:
        lps = logprobs(self.call, delta.logprobs, self.text_len)
        self.text_len += len(delta.text)
        if self.call.kind == COMPLETIONS:
            return self._chunk(delta.text, lps, None)
        text = self._visible(delta.text, end=False)
        d: dict[str, Any] = {"content": text}
        if not self.sent_role:
            d = {"role": "assistant", **d}
            self.sent_role = True
        elif not text and lps is None:
            return None
        return self._chunk(d, lps, None)

    def final_chunks(self, final: generate_pb2.Final) -> list[dict[str, Any]]:
        chunks = []
        finish = finish_reason(final)
        if self.call.kind == CHAT:
            d: dict[str, Any] = {}
            if not self.sent_role:
                d["role"] = "assistant"
                self.sent_role = True
            rest = self._visible("", end=True)
            if rest or "role" in d:
                d["content"] = rest
            if final.tool_calls:
                d["tool_calls"] = [
                    {"index": i, **c} for i, c in enumerate(tool_calls(final.tool_calls))
                ]
            chunks.append(self._chunk(d, None, finish))
        else:
            chunks.append(self._chunk("", None, finish))
        if self.call.include_usage:
            tail = self._base(chunks[0]["object"])
            tail["choices"] = []
            tail["usage"] = usage(final.usage)
            chunks.append(tail)
        return chunks


def _partial_tag(text: str) -> int:
    """How many characters at the end of ``text`` may begin a call's tag."""
    for n in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


def models(model_id: str, created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": model_id, "object": "model", "created": created, "owned_by": "genai-grpc"}],
    }
