"""genai.v1 messages → OpenAI's JSON: where the HTTP gateway translates answers
(docs/design.md, "HTTP gateway"; requests are ``openai_api``'s). ``Delta`` and
``Final`` events become OpenAI's responses and stream chunks, domain errors
OpenAI's error object with its HTTP status.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

from genai_common.errors import GenAIError, InvalidArgument
from genai_proto.genai.v1 import common_pb2, generate_pb2

from ...model.tokenizer import TOOL_CALL_OPEN
from ..tools import new_call_id
from .openai_api import CHAT, COMPLETIONS, Call

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
    out: dict[str, Any] = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }
    if u.dropped_tokens:  # truncate_prompt_tokens, context slides (not OpenAI's)
        out["dropped_tokens"] = u.dropped_tokens
    return out


def finish_reason(final: generate_pb2.Final) -> str:
    if final.tool_calls:
        return "tool_calls"
    return _FINISH.get(final.finish_reason, "stop")


_PARTIAL_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)("?)')
_PARTIAL_ARGUMENTS = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def _name(m: re.Match[str]) -> str:
    """The call's name as ``_PARTIAL_NAME`` matched it (JSON escapes decoded;
    as written when it was cut inside one)."""
    try:
        return str(json.loads(f'"{m.group(1)}"'))
    except ValueError:
        return m.group(1)


def partial_call(call_text: str) -> dict[str, Any]:
    """The ``tool_calls`` entry of a call ``max_tokens`` cut off (the text after
    its opening tag), as OpenAI returns one: the name as far as it got, the
    arguments' JSON text as far as it got."""
    name, arguments = "", ""
    m = _PARTIAL_NAME.match(call_text)
    if m:
        name = _name(m)
        if m.group(2):
            rest = _PARTIAL_ARGUMENTS.match(call_text, m.end())
            if rest:
                arguments = call_text[rest.end() :]
    function = {"name": name, "arguments": arguments}
    return {"id": new_call_id(), "type": "function", "function": function}


def tool_calls(calls: Sequence[common_pb2.ToolCall]) -> list[dict[str, Any]]:
    return [
        {
            "id": c.id,
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments_json},
        }
        for c in calls
    ]


def logprobs(
    call: Call,
    items: Sequence[common_pb2.TokenLogprob | None],
    offset: int = 0,
    first_text: str = "",
) -> Any:
    """A choice's ``logprobs`` in the shape of the call's endpoint (None: none
    asked). A None item (an echoed prompt's first token, ``first_text``) has
    null logprobs."""
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
                if t is not None
            ]
        }
    texts = [first_text if t is None else t.text for t in items]
    offsets, at = [], offset
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [None if t is None else t.logprob for t in items],
        "top_logprobs": [
            None if t is None else {a.text: a.logprob for a in t.top[:n]} for t in items
        ],
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
        self.call_text = ""  # a stream's text after the first call's opening tag
        # A forced call (required or a named tool) is grammar-constrained, so it
        # always parses: its name and arguments stream as they are generated.
        # Under auto the calls come whole at the end (a model may write a tag
        # that turns out not to be a call).
        self.stream_calls = self.hold and call.request.tool_choice not in ("", "auto")
        self.calls_streamed: list[dict[str, Any]] = []  # per call: id, arguments sent
        self.prompt_tokens = 0  # continuous usage: the prompt's tokens, once counted
        self.completion_tokens = 0  # continuous usage: tokens streamed so far
        self.prompt_lps: Sequence[common_pb2.TokenLogprob] = ()  # the first delta's
        self.echoed = False
        self.sent_first = False
        self.other_len: dict[int, int] = {}  # n > 1: text offsets of choices 1..
        self.other_role: set[int] = set()  # n > 1: choices whose role went out

    def prompt_counted(self, n: int) -> None:
        """The prompt's token count (Frontend.events' on_prompt)."""
        self.prompt_tokens = n

    def seen(self, delta: generate_pb2.Delta) -> None:
        """Note a delta of a unary call (its prompt logprobs, on the first)."""
        if delta.prompt_logprobs:
            self.prompt_lps = delta.prompt_logprobs

    def _with_echo(self, text: str, items: Sequence[common_pb2.TokenLogprob]) -> tuple[str, Any]:
        """The text and logprobs of a completion's choice: with echo, the prompt
        first, and its tokens' logprobs (the first token's null; its text is
        what the other tokens' texts leave of the prompt)."""
        if self.call.echo is None or self.echoed:
            return text, logprobs(self.call, items, self.text_len)
        self.echoed = True
        prompt = self.call.echo
        if not self.prompt_lps:
            return prompt + text, logprobs(self.call, items, len(prompt))
        rest = "".join(t.text for t in self.prompt_lps)
        first = prompt[: len(prompt) - len(rest)] if prompt.endswith(rest) else ""
        lps = logprobs(self.call, [None, *self.prompt_lps, *items], 0, first)
        return prompt + text, lps

    def _vllm_prompt_logprobs(self) -> list[Any] | None:
        """vLLM's ``prompt_logprobs``: None for the first prompt token, then per
        token its own and the top alternatives' logprobs by token id."""
        n = self.call.prompt_logprobs
        if n is None:
            return None
        out: list[Any] = [None]
        for t in self.prompt_lps:
            entry = {str(t.token_id): {"logprob": t.logprob, "decoded_token": t.text}}
            for a in t.top[:n]:
                entry.setdefault(str(a.token_id), {"logprob": a.logprob, "decoded_token": a.text})
            out.append(entry)
        return out

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _choice(
        self, text: str | None, lps: Any, finish: str | None, final: Any = None, index: int = 0
    ) -> dict:
        choice: dict[str, Any] = {"index": index}
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

    def response(self, texts: Mapping[int, str], final: generate_pb2.Final) -> dict[str, Any]:
        """The unary response body; ``texts``: each choice's text (the deltas')."""
        body = self._base(self.object)
        # n > 1: a choice per completion (Final.completions; their text is the deltas')
        ends = list(final.completions) or [final]
        body["choices"] = [
            self._answer(texts.get(getattr(end, "index", 0), ""), end, getattr(end, "index", 0))
            for end in ends
        ]
        body["usage"] = usage(final.usage)
        body["system_fingerprint"] = seed_fingerprint(final.seed)
        return body

    def _answer(self, text: str, end: Any, index: int) -> dict[str, Any]:
        """One choice of the unary body; ``end``: its Final or Completion."""
        content: str | None = text
        partial = None
        if self.call.kind == CHAT and end.tool_calls:
            content = text.split(TOOL_CALL_OPEN, 1)[0].strip() or None
        elif self.hold and TOOL_CALL_OPEN in text and finish_reason(end) == "length":
            # a call cut off by max_tokens: a partial tool_calls entry, not raw text
            before, _, after = text.partition(TOOL_CALL_OPEN)
            content, partial = before.strip() or None, partial_call(after)
        if self.call.kind == CHAT:
            lps = logprobs(self.call, end.logprobs)
        else:
            content, lps = self._with_echo(text, end.logprobs)
        choice = self._choice(content, lps, finish_reason(end), end, index)
        if partial is not None:
            choice["message"]["tool_calls"] = [partial]
        prompt_lps = self._vllm_prompt_logprobs()
        if prompt_lps is not None:
            choice["prompt_logprobs"] = prompt_lps
        return choice

    def _chunk(
        self, delta: dict[str, Any] | str, lps: Any, finish: str | None, index: int = 0
    ) -> dict:
        chunk = self._base("chat.completion.chunk" if self.call.kind == CHAT else self.object)
        choice: dict[str, Any] = {"index": index}
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
        if self.in_call:
            self.call_text += text
            return ""
        if not self.hold:
            return text
        self.buffer += text
        at = self.buffer.find(TOOL_CALL_OPEN)
        if at >= 0:
            self.in_call = True
            self.call_text = self.buffer[at + len(TOOL_CALL_OPEN) :]
            out, self.buffer = self.buffer[:at], ""
            return out
        keep = 0 if end else _partial_tag(self.buffer)
        out, self.buffer = (
            self.buffer[: len(self.buffer) - keep],
            self.buffer[len(self.buffer) - keep :],
        )
        return out

    def delta_chunk(self, delta: generate_pb2.Delta) -> dict[str, Any] | None:
        self.completion_tokens += len(delta.token_ids)
        chunk = self._delta_chunk(delta)
        if chunk is not None and self.call.continuous_usage:
            p, c = self.prompt_tokens, self.completion_tokens
            chunk["usage"] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
        return chunk

    def _delta_chunk(self, delta: generate_pb2.Delta) -> dict[str, Any] | None:
        i = delta.index  # the choice (n > 1; the others' text offsets apart)
        if i:
            return self._other_chunk(delta)
        if self.call.kind == COMPLETIONS:
            self.seen(delta)
            first, self.sent_first = not self.sent_first, True
            text, lps = self._with_echo(delta.text, delta.logprobs)
            self.text_len += len(text)
            chunk = self._chunk(text, lps, None)
            prompt_lps = self._vllm_prompt_logprobs() if first else None
            if prompt_lps is not None:
                chunk["choices"][0]["prompt_logprobs"] = prompt_lps
            return chunk
        lps = logprobs(self.call, delta.logprobs, self.text_len)
        self.text_len += len(delta.text)
        text = self._visible(delta.text, end=False)
        d: dict[str, Any] = {"content": text}
        pieces = self._call_pieces() if self.stream_calls and self.in_call else []
        if pieces:
            d["tool_calls"] = pieces
        if not self.sent_role:
            d = {"role": "assistant", **d}
            self.sent_role = True
        elif not text and lps is None and not pieces:
            return None
        return self._chunk(d, lps, None)

    def _call_pieces(self) -> list[dict[str, Any]]:
        """What the streamed forced calls have grown by since the last chunk,
        as OpenAI streams calls: a call's first piece has its index, id, type
        and complete name with empty arguments, the next ones the arguments'
        JSON text as it was generated (joined, they are the call's arguments).
        Text after the arguments object (its closing brace, the tag) is never
        sent as arguments."""
        pieces: list[dict[str, Any]] = []
        decoder = json.JSONDecoder()
        for k, body in enumerate(self.call_text.split(TOOL_CALL_OPEN)):
            m = _PARTIAL_NAME.match(body)
            if not m or not m.group(2):  # the name is not complete yet
                break
            if k == len(self.calls_streamed):
                call_id = new_call_id()
                self.calls_streamed.append({"id": call_id, "sent": 0})
                function = {"name": _name(m), "arguments": ""}
                pieces.append({"index": k, "id": call_id, "type": "function", "function": function})
            rest = _PARTIAL_ARGUMENTS.match(body, m.end())
            if not rest:
                break
            region = body[rest.end() :]
            try:
                _, end = decoder.raw_decode(region)  # the arguments are complete
            except ValueError:
                end = len(region)  # still open: all of it is arguments
            state = self.calls_streamed[k]
            if end > state["sent"]:
                pieces.append({"index": k, "function": {"arguments": region[state["sent"] : end]}})
                state["sent"] = end
        return pieces

    def _other_chunk(self, delta: generate_pb2.Delta) -> dict[str, Any]:
        """A chunk of choice ``delta.index`` > 0 (no tools, no echo with n > 1)."""
        i = delta.index
        lps = logprobs(self.call, delta.logprobs, self.other_len.get(i, 0))
        self.other_len[i] = self.other_len.get(i, 0) + len(delta.text)
        if self.call.kind == COMPLETIONS:
            return self._chunk(delta.text, lps, None, i)
        d: dict[str, Any] = {"content": delta.text}
        if i not in self.other_role:
            d = {"role": "assistant", **d}
            self.other_role.add(i)
        return self._chunk(d, lps, None, i)

    def final_chunks(self, final: generate_pb2.Final) -> list[dict[str, Any]]:
        chunks = []
        for end in final.completions or [final]:
            i = getattr(end, "index", 0)
            finish = finish_reason(end)
            if self.call.kind == CHAT:
                d: dict[str, Any] = {}
                if i == 0:
                    if not self.sent_role:
                        d["role"] = "assistant"
                        self.sent_role = True
                    rest = self._visible("", end=True)
                    if rest or "role" in d:
                        d["content"] = rest
                elif i not in self.other_role:
                    d = {"role": "assistant", "content": ""}
                if i == 0 and self.stream_calls and self.in_call:
                    pieces = self._call_pieces()  # what is left (its pieces went out)
                    if not self.calls_streamed and finish == "length":  # cut inside the name
                        pieces = [{"index": 0, **partial_call(self.call_text)}]
                    if pieces:
                        d["tool_calls"] = pieces
                elif end.tool_calls:
                    d["tool_calls"] = [
                        {"index": k, **c} for k, c in enumerate(tool_calls(end.tool_calls))
                    ]
                elif i == 0 and self.in_call and finish == "length":
                    d["tool_calls"] = [{"index": 0, **partial_call(self.call_text)}]
                chunks.append(self._chunk(d, None, finish, i))
            else:
                chunks.append(self._chunk("", None, finish, i))
        if self.call.include_usage:
            tail = self._base(chunks[0]["object"])
            tail["choices"] = []
            tail["usage"] = usage(final.usage)
            chunks.append(tail)
        for chunk in chunks:  # the seed, once it is known (the last chunks)
            chunk["system_fingerprint"] = seed_fingerprint(final.seed)
            if self.call.continuous_usage and chunk.get("usage") is None:
                chunk["usage"] = usage(final.usage)
        return chunks


def _partial_tag(text: str) -> int:
    """How many characters at the end of ``text`` may begin a call's tag."""
    for n in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


def model_object(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "genai-grpc"}


def models(names: Sequence[str], created: int) -> dict[str, Any]:
    """``/v1/models``: every name the model is served under (one model)."""
    return {"object": "list", "data": [model_object(name, created) for name in names]}


def seed_fingerprint(seed: int) -> str:
    """``system_fingerprint``: the seed the request sampled with (the one it
    gave, or the one the engine picked), so a sampled answer can be repeated
    by sending it back as ``seed``; also the unary response's ``x-seed``."""
    return f"seed-{seed}"
