"""Tool calls (docs/design.md, "Tool calls"): a request's ``tools`` and
``tool_choice`` checked, offered through the chat template, forced by a
constraint when the choice requires a call, and parsed out of the answer.

The call syntax is the one the default preamble (``engine.tokenizer.TOOL_PREAMBLE``)
asks for, which is also what many chat models are trained on:
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from genai_common import bounded_json
from genai_common.errors import InvalidArgument
from genai_proto.genai.v1 import common_pb2, generate_pb2

from ..contract.request import Constraint
from ..model.tokenizer import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128
CALL_WHITESPACE = "[ ]?"
_CHOICES = ("", "auto", "none", "required")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON Schema of the arguments object

    def template_form(self) -> dict[str, Any]:
        """As Hugging Face's apply_chat_template passes a tool to a template."""
        function = {"name": self.name, "description": self.description}
        return {"type": "function", "function": {**function, "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolUse:
    """What a request asked of its tools: which are offered, and whether the
    answer must be a call (``required``) or a call of one tool (``forced``)."""

    tools: tuple[Tool, ...]
    required: bool = False
    forced: str = ""  # a tool's name

    def template_tools(self) -> list[dict[str, Any]]:
        return [t.template_form() for t in self.tools]

    def constraint(self) -> Constraint | None:
        """The grammar of an answer that must be a call; None under ``auto``."""
        if not (self.required or self.forced):
            return None
        tools = [t for t in self.tools if not self.forced or t.name == self.forced]
        # One embedded JSON Schema per tool (llguidance's %json), so that each
        # tool's local $refs resolve against its own $defs/definitions.
        rules = [
            f"call_{i}: %json {json.dumps(call_schema(t, strict=True))}"
            for i, t in enumerate(tools)
        ]
        alternatives = " | ".join(f"call_{i}" for i in range(len(tools)))
        # The tags as JSON string literals (Lark reads those).
        open_tag, close_tag = json.dumps(TOOL_CALL_OPEN + "\n"), json.dumps("\n" + TOOL_CALL_CLOSE)
        grammar = "\n".join(
            [f"start: {open_tag} call {close_tag}", f"call: {alternatives}", *rules, ""]
        )
        return Constraint("grammar", grammar)

    def schema_checks(self) -> list[tuple[Constraint, str]]:
        """Each tool's call as a JSON-Schema constraint, with the field a
        failure names: what the constraint checker compiles (whether or not
        this request forces a call, a schema llguidance cannot take is refused)."""
        field = "tools[{}].parameters_json_schema"
        forcing = self.required or bool(self.forced)
        return [
            (Constraint("json_schema", json.dumps(call_schema(t, strict=forcing))), field.format(i))
            for i, t in enumerate(self.tools)
        ]

    def calls(self, text: str) -> list[common_pb2.ToolCall]:
        """The calls of offered tools written in ``text``, in order; a call
        whose JSON does not parse, or names no offered tool, is left as text."""
        names = {t.name for t in self.tools}
        out = []
        decoder = json.JSONDecoder()
        start = text.find(TOOL_CALL_OPEN)
        while start >= 0:
            # The JSON object right after the tag, then the closing tag (a
            # "</tool_call>" inside a JSON string does not end the call).
            at = start + len(TOOL_CALL_OPEN)
            at += len(text[at:]) - len(text[at:].lstrip())
            try:
                body, end = decoder.raw_decode(text, at)
            except ValueError:
                start = text.find(TOOL_CALL_OPEN, at)
                continue
            closed = text[end:].lstrip().startswith(TOOL_CALL_CLOSE)
            start = text.find(TOOL_CALL_OPEN, end)
            if not closed or not isinstance(body, dict) or body.get("name") not in names:
                continue
            arguments = body.get("arguments", body.get("parameters", {}))
            if not isinstance(arguments, dict):
                continue
            out.append(
                common_pb2.ToolCall(
                    id=new_call_id(),
                    name=body["name"],
                    arguments_json=json.dumps(arguments, ensure_ascii=False),
                )
            )
        return out


def new_call_id() -> str:
    """A tool call's id: "call_" and 24 random hex digits (OpenAI's form)."""
    return "call_" + secrets.token_hex(12)


def tool_use(
    request: generate_pb2.GenerateRequest, max_schema_bytes: int = 65_536
) -> ToolUse | None:
    """The request's tools and tool_choice, checked; None when no tool is
    offered. The tools' ``parameters_json_schema`` together may hold at most
    ``max_schema_bytes`` (``--max-constraint-bytes``: a forced call's grammar
    holds them all). Whether llguidance can compile each one is the constraint
    checker's to say (``ToolUse.schema_checks``)."""
    choice = request.tool_choice
    tools = list(request.tools)
    if choice not in _CHOICES and not _NAME.fullmatch(choice):
        raise InvalidArgument(
            f"tool_choice: {choice[:64]!r} is not one of auto, none, required or a tool's name"
        )
    if not tools:
        if choice not in ("", "auto", "none"):
            raise InvalidArgument(f"tool_choice: {choice!r} needs tools; none were given")
        return None
    if request.WhichOneof("input") != "messages":
        raise InvalidArgument("tools: are offered through the chat template; send messages")
    if len(tools) > MAX_TOOLS:
        raise InvalidArgument(f"tools: {len(tools)} given; allowed at most {MAX_TOOLS}")
    size = sum(len(t.parameters_json_schema.encode("utf-8", "surrogatepass")) for t in tools)
    if size > max_schema_bytes:
        raise InvalidArgument(
            f"tools: {size} bytes of parameters_json_schema; allowed at most {max_schema_bytes}"
        )
    checked: list[Tool] = []
    for i, tool in enumerate(tools):
        if not _NAME.fullmatch(tool.name):
            raise InvalidArgument(
                f"tools[{i}].name: {tool.name[:80]!r} must be 1 to 64 characters of "
                "a-z, A-Z, 0-9, '_' and '-'"
            )
        if any(t.name == tool.name for t in checked):
            raise InvalidArgument(f"tools[{i}].name: {tool.name!r} is given twice")
        checked.append(Tool(tool.name, tool.description, _parameters(i, tool)))
    if choice == "none":
        return None
    names = [t.name for t in checked]
    if choice not in _CHOICES and choice not in names:
        raise InvalidArgument(
            f"tool_choice: {choice!r} is not one of the tools ({', '.join(names)})"
        )
    use = ToolUse(
        tuple(checked), required=choice == "required", forced=choice if choice in names else ""
    )
    if use.constraint() is not None and request.HasField("constraint"):
        raise InvalidArgument(
            f"constraint: cannot be combined with tool_choice {choice!r}, which constrains "
            "the answer to a tool call itself"
        )
    return use


# Where strict_objects looks: the keywords whose schemas each stand for a whole
# value (a property's, an item's, a definition's, one alternative of
# anyOf/oneOf), so that closing an object there keeps the schema's meaning.
# Not allOf, if/then/else, not, dependentSchemas and the like: their branches
# describe a value together with the schema around them, and closing one
# branch would refuse the keys another allows.
_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties")
# An object whose keys may also come from these stays as it is.
_OPEN_KEYS = (
    "additionalProperties",
    "patternProperties",
    "unevaluatedProperties",
    "allOf",
    "$ref",
    "if",
    "dependentSchemas",
)


def strict_objects(schema: Any) -> Any:
    """``schema`` with OpenAI's ``strict`` semantics for objects: an object
    schema that lists ``properties`` and says nothing of other keys gets
    ``additionalProperties: false``, so only its own properties appear, each
    at most once, here and in the schemas of its properties, items,
    definitions and anyOf/oneOf alternatives. JSON Schema's default (any
    other key, any number of times) let a forced call of a schema without it
    repeat a key until max_tokens (issue 30: LangChain's ``bind_tools`` sends
    such schemas). A schema that allows more keys, or takes them from
    elsewhere (``allOf``, a ``$ref`` beside it, ``if``), keeps its meaning."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            out[key] = {name: strict_objects(sub) for name, sub in schema[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            out[key] = [strict_objects(sub) for sub in schema[key]]
    for key in _SCHEMA_VALUES:
        if isinstance(schema.get(key), dict):
            out[key] = strict_objects(schema[key])
    if isinstance(schema.get("properties"), dict) and not any(k in schema for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out


def call_schema(tool: Tool, strict: bool = False) -> dict[str, Any]:
    """The JSON Schema of one call of ``tool``: ``{"name": <its name>,
    "arguments": <its parameters>}``. The parameters' ``$defs`` and
    ``definitions`` move to this schema's root and its other root-relative
    ``$ref``s are rewritten, so every local reference still resolves.
    ``strict``: the parameters under ``strict_objects`` (a forced call: the
    grammar the answer must follow)."""
    params = dict(strict_objects(tool.parameters) if strict else tool.parameters)
    lifted = {k: params.pop(k) for k in ("$defs", "definitions") if k in params}

    def rebase(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: rebase(v) for k, v in node.items()}
            ref = out.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                pointer = ref[1:]
                if not pointer.startswith(("/$defs/", "/definitions/")):
                    out["$ref"] = "#/properties/arguments" + pointer
            return out
        if isinstance(node, list):
            return [rebase(v) for v in node]
        return node

    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": rebase(params)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        **rebase(lifted),
        # A call is one line, as the preamble writes it: at most one space
        # between JSON tokens (a model may not wander in whitespace here).
        "x-guidance": {"whitespace_pattern": CALL_WHITESPACE},
    }


def _parameters(i: int, tool: generate_pb2.Tool) -> dict[str, Any]:
    field = f"tools[{i}].parameters_json_schema"
    if not tool.parameters_json_schema.strip():
        return {"type": "object"}
    schema = bounded_json.loads(tool.parameters_json_schema, field)
    if not isinstance(schema, dict):
        raise InvalidArgument(f"{field}: must be a JSON Schema object")
    return schema
