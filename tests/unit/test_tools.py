"""Tool calls in the frontend (server/tools.py) and their rendering through the
chat template (model/tokenizer.py): checks, the forced-call grammar, parsing."""

from __future__ import annotations

import json

import pytest

from genai_common.errors import InvalidArgument
from genai_proto.genai.v1 import common_pb2, generate_pb2
from genai_service.guidance.constraints import Guidance
from genai_service.model.tokenizer import TOOL_PREAMBLE, Tokenizer, tool_call_text
from genai_service.server.tools import tool_use
from tests.factories import BYTES_EOS_ID, bytes_tokenizer, tiny_tokenizer

WEATHER = generate_pb2.Tool(
    name="get_weather",
    description="Current weather of a city",
    parameters_json_schema=json.dumps(
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    ),
)
TIME = generate_pb2.Tool(name="get_time", description="Local time")


def request(tools=(WEATHER, TIME), tool_choice: str = "", **fields) -> generate_pb2.GenerateRequest:
    r = generate_pb2.GenerateRequest(tools=list(tools), tool_choice=tool_choice, **fields)
    r.messages.messages.append(common_pb2.ChatMessage(role="user", content="Weather in Paris?"))
    return r


def test_auto_offers_the_tools_and_forces_nothing() -> None:
    use = tool_use(request())
    assert use is not None and [t.name for t in use.tools] == ["get_weather", "get_time"]
    assert use.constraint() is None
    assert use.template_tools()[1] == {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time",
            "parameters": {"type": "object"},
        },
    }
    assert tool_use(request(tool_choice="none")) is None
    assert tool_use(request(tools=())) is None


def test_required_and_named_choices_are_grammars_of_a_call() -> None:
    required = tool_use(request(tool_choice="required"))
    assert required is not None
    grammar = required.constraint()
    assert grammar is not None and grammar.kind == "grammar"
    assert '"get_weather"' in grammar.value and '"get_time"' in grammar.value
    named = tool_use(request(tool_choice="get_time"))
    assert named is not None and named.forced == "get_time"
    c = named.constraint()
    assert c is not None and '"get_weather"' not in c.value


def test_calls_are_parsed_from_the_tagged_syntax() -> None:
    use = tool_use(request())
    assert use is not None
    text = (
        "Let me check.\n"
        + tool_call_text("get_weather", {"city": "Paris"})
        + "\n<tool_call>\n{not json}\n</tool_call>"  # left as text
        + "\n<tool_call>\n"
        + json.dumps({"name": "unknown", "arguments": {}})  # not offered: left as text
        + "\n</tool_call>\n"
        + tool_call_text("get_time", "{}")
    )
    calls = use.calls(text)
    assert [(c.name, json.loads(c.arguments_json)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in calls)
    assert len({c.id for c in calls}) == 2
    assert use.calls("no call here") == []


@pytest.mark.parametrize(
    ("tools", "choice", "message"),
    [
        ((WEATHER,), "sometimes", "tool_choice: 'sometimes' is not one of the tools (get_weather)"),
        ((WEATHER,), "bad name!", "tool_choice: 'bad name!' is not one of auto, none, required"),
        ((), "required", "tool_choice: 'required' needs tools; none were given"),
        ((), "get_weather", "tool_choice: 'get_weather' needs tools; none were given"),
        (
            (generate_pb2.Tool(name="a b"),),
            "",
            "tools[0].name: 'a b' must be 1 to 64 characters of a-z, A-Z, 0-9, '_' and '-'",
        ),
        ((WEATHER, WEATHER), "", "tools[1].name: 'get_weather' is given twice"),
        (
            (generate_pb2.Tool(name="f", parameters_json_schema="{x"),),
            "",
            "tools[0].parameters_json_schema: not valid JSON",
        ),
        (
            (generate_pb2.Tool(name="f", parameters_json_schema="[]"),),
            "",
            "tools[0].parameters_json_schema: must be a JSON Schema object",
        ),
    ],
)
def test_bad_tools_are_invalid_argument(tools, choice: str, message: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        tool_use(request(tools=tools, tool_choice=choice))
    assert err.value.message.startswith(message), err.value.message


def test_tools_need_messages_and_a_forced_call_excludes_a_constraint() -> None:
    r = generate_pb2.GenerateRequest(text="hi", tools=[WEATHER])
    with pytest.raises(InvalidArgument, match="^tools: are offered through the chat template"):
        tool_use(r)
    r = request(tool_choice="required")
    r.constraint.regex = "a"
    with pytest.raises(InvalidArgument, match="^constraint: cannot be combined with tool_choice"):
        tool_use(r)
    r = request(tool_choice="auto")
    r.constraint.regex = "a"
    assert tool_use(r) is not None  # auto forces nothing: a constraint may apply


CHATML = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WITH_TOOLS = (
    "{% if tools %}<|tools|>{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}[call {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}]{% endfor %}{% endif %}\n{% endfor %}"
)


def test_a_template_without_tools_gets_the_preamble_in_the_system_message() -> None:
    tok = Tokenizer(tiny_tokenizer(), chat_template=CHATML)
    offered = tool_use(request())
    assert offered is not None
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tools=offered.template_tools()
    )
    head = TOOL_PREAMBLE.split("{tools}")[0]
    assert text.startswith("<|system|>" + head)
    assert '{"name": "get_weather", "description": "Current weather of a city"' in text
    with_system = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        tools=offered.template_tools(),
    )
    assert with_system.count("<|system|>") == 1 and "\n\nBe brief.\n" in with_system
    # An assistant turn's calls, which this template does not render, become content;
    # the tool's answer is a `tool` message.
    history = tok.apply_chat_template(
        [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_time", "arguments": {}},
                    }
                ],
            },
            {"role": "tool", "content": "12:00", "tool_call_id": "call_1", "name": "get_time"},
        ]
    )
    assert "<|assistant|>" + tool_call_text("get_time", {}) + "\n<|tool|>12:00\n" in history


def test_a_template_with_tools_renders_them_itself() -> None:
    tok = Tokenizer(tiny_tokenizer(), chat_template=WITH_TOOLS)
    offered = tool_use(request())
    assert offered is not None
    text = tok.apply_chat_template(
        [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "c",
                        "type": "function",
                        "function": {"name": "f", "arguments": {"x": 1}},
                    }
                ],
            },
        ],
        add_generation_prompt=False,
        tools=offered.template_tools(),
    )
    assert text.startswith('<|tools|>[{"type": "function", "function": {"name": "get_weather"')
    assert TOOL_PREAMBLE[:20] not in text
    assert '<|assistant|>[call f {"x": 1}]' in text


def test_malformed_tool_messages_are_invalid_argument() -> None:
    tok = Tokenizer(tiny_tokenizer(), chat_template=CHATML)
    with pytest.raises(InvalidArgument, match=r"^messages\[0\]\.tool_calls: must be a list of"):
        tok.apply_chat_template([{"role": "assistant", "content": "", "tool_calls": [1]}])
    with pytest.raises(InvalidArgument, match=r"^messages\[0\]\.tool_call_id: must be a string"):
        tok.apply_chat_template([{"role": "tool", "content": "x", "tool_call_id": 3}])


def test_tool_schemas_with_local_refs_compile_and_bad_ones_name_the_tool() -> None:
    import llguidance

    located = generate_pb2.Tool(
        name="locate",
        parameters_json_schema=json.dumps(
            {
                "type": "object",
                "properties": {
                    "where": {"$ref": "#/$defs/Loc"},
                    "again": {"$ref": "#/properties/where"},
                },
                "required": ["where"],
                "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string"}}}},
            }
        ),
    )
    use = tool_use(request(tools=(located, TIME), tool_choice="required"))
    assert use is not None
    grammar = use.constraint()
    assert grammar is not None
    lark = llguidance.LLMatcher.grammar_from_lark(grammar.value)
    assert llguidance.LLMatcher.validate_grammar_with_warnings(lark)[0] is False
    broken = generate_pb2.Tool(
        name="broken",
        parameters_json_schema='{"type": "object", "properties": {"a": {"$ref": "#/nope"}}}',
    )
    # The constraint checker compiles each tool's call, naming the tool's field.
    broken_use = tool_use(request(tools=(TIME, broken)))
    assert broken_use is not None
    guidance = Guidance(bytes_tokenizer(), 257, [BYTES_EOS_ID], max_constraint_bytes=65_536)
    (ok, _), (bad, field) = broken_use.schema_checks()
    guidance.check(ok)
    assert field == "tools[1].parameters_json_schema"
    with pytest.raises(InvalidArgument) as err:
        guidance.check(bad, field)
    assert err.value.message.startswith("tools[1].parameters_json_schema: ")
    assert "nope" in err.value.message


def test_a_closing_tag_inside_an_argument_does_not_end_the_call() -> None:
    use = tool_use(request())
    assert use is not None
    text = tool_call_text("get_weather", {"city": "a</tool_call>b"})
    (call,) = use.calls(text)
    assert json.loads(call.arguments_json) == {"city": "a</tool_call>b"}
    assert use.calls("<tool_call>\n" + json.dumps({"name": "get_time", "arguments": {}})) == []


def test_the_client_sends_openai_style_tool_calls_in_history() -> None:
    from genai_client._request import generate_request

    openai_call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'},
    }
    ours = {"id": "call_2", "name": "get_weather", "arguments": {"city": "Rome"}}
    request = generate_request(
        messages=[{"role": "assistant", "content": "", "tool_calls": [openai_call, ours]}]
    )
    calls = request.messages.messages[0].tool_calls
    assert [(c.id, c.name, json.loads(c.arguments_json)) for c in calls] == [
        ("call_1", "get_time", {"tz": "UTC"}),
        ("call_2", "get_weather", {"city": "Rome"}),
    ]


def test_forced_calls_follow_strict_object_semantics() -> None:
    """Only a schema's own properties, unless it allows more (issue 30)."""
    from genai_service.server.tools import strict_objects

    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {}}}},
            "free": {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
            "kind": {"enum": [{"properties": {}}]},
        },
        "$defs": {"d": {"properties": {"y": {}}}},
    }
    strict = strict_objects(schema)
    assert strict["additionalProperties"] is False
    props = strict["properties"]
    assert set(props) == {"properties", "tags", "free", "kind"}  # names untouched
    assert props["properties"]["additionalProperties"] is False
    assert props["tags"]["items"]["additionalProperties"] is False
    assert props["free"]["additionalProperties"] is True  # it allows more: kept
    assert props["kind"] == {"enum": [{"properties": {}}]}  # data, not a schema
    assert strict["$defs"]["d"]["additionalProperties"] is False
    assert strict_objects({"type": "object"}) == {"type": "object"}  # no properties: any


def test_strict_objects_leave_combined_schemas_their_meaning() -> None:
    """Closing an allOf branch (or an if) would refuse the keys the other
    branch allows: those, and objects that take keys from them, stay open."""
    from genai_service.server.tools import strict_objects

    both = {
        "allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}],
        "required": ["a", "b"],
    }
    assert strict_objects(both) == both
    conditional = {
        "properties": {"kind": {}},
        "if": {"properties": {"kind": {"const": "x"}}},
        "then": {"required": ["kind"]},
    }
    assert strict_objects(conditional) == conditional
    either = {"anyOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert [b["additionalProperties"] for b in strict_objects(either)["anyOf"]] == [False, False]
    with_ref = {"$ref": "#/$defs/base", "properties": {"extra": {}}}
    assert "additionalProperties" not in strict_objects(with_ref)
