"""OpenAI JSON ↔ genai.v1 translation (server/http_api/openai_api.py), without a server."""

from __future__ import annotations

import json

import pytest

from genai_common.errors import InvalidArgument, NotFound, ResourceExhausted
from genai_proto.genai.v1 import common_pb2, generate_pb2
from genai_service.server.http_api import openai_api, openai_reply
from genai_service.server.http_api.openai_api import CHAT, COMPLETIONS, parse

USER = [{"role": "user", "content": "hi"}]


def test_fields_map_onto_the_generate_request() -> None:
    call = parse(
        CHAT,
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ]},
                {"role": "tool", "content": "42", "tool_call_id": "c1"},
            ],
            "max_tokens": 5,
            "max_completion_tokens": 7,
            "temperature": 0.5,
            "top_k": -1,
            "seed": 3,
            "stop": "END",
            "logprobs": True,
            "top_logprobs": 0,
            "response_format": {"type": "json_object"},
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        session_id="s1",
    )  # fmt: skip
    r = call.request
    system, assistant, tool = r.messages.messages
    assert (system.role, system.content) == ("system", "be brief")
    assert assistant.tool_calls[0].name == "f" and tool.tool_call_id == "c1"
    assert r.stopping.max_new_tokens == 7  # max_completion_tokens wins
    assert call.names["stopping.max_new_tokens"] == "max_completion_tokens"
    assert r.sampling.temperature == 0.5 and r.sampling.top_k == 0 and r.sampling.seed == 3
    assert list(r.stopping.stop_sequences) == ["END"]
    assert r.top_logprobs == 1 and call.logprobs == 0  # at least 1 asked, none returned
    assert r.constraint.json_object and r.session_id == "s1"
    assert call.stream and call.include_usage
    # OpenAI's default temperature samples.
    assert parse(COMPLETIONS, {"prompt": [1, 2]}).request.sampling.temperature == 1.0
    assert list(parse(COMPLETIONS, {"prompt": [[1, 2]]}).request.token_ids.ids) == [1, 2]


@pytest.mark.parametrize(
    ("kind", "body", "param"),
    [
        (CHAT, {"messages": USER, "temperature": "hot"}, "temperature"),
        (CHAT, {"messages": USER, "stream": 1}, "stream"),
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {"messages": USER, "top_logprobs": 2}, "top_logprobs"),
        (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (CHAT, {"messages": USER, "n": 0}, "n"),
        (CHAT, {"messages": USER, "response_format": {"type": "yaml"}}, "response_format.type"),
        (CHAT, {"messages": USER, "stream_options": {"include_usage": True}}, "stream_options"),
        (CHAT, {"messages": USER, "logit_bias": {"x": 2}}, "logit_bias"),
        (COMPLETIONS, {"prompt": {"a": 1}}, "prompt"),
        (COMPLETIONS, {"prompt": [5, 6], "echo": True}, "echo"),
        (COMPLETIONS, {"prompt": "a", "max_tokens": 0}, "max_tokens"),
        (COMPLETIONS, {"prompt": "a", "seed": -1}, "seed"),
    ],
)
def test_bad_fields_are_named(kind: str, body: dict, param: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        parse(kind, body)
    status, error = openai_reply.error_body(err.value)
    assert status == 400 and error["error"]["param"] == param


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": USER, "frobnicate": 1}, "frobnicate"),
        ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages[0].extra"),
        ({"messages": USER, "stream": True, "stream_options": {"x": 1}}, "stream_options.x"),
        (
            {"messages": USER, "structured_outputs": {"regex": "a+", "disable_fallback": True}},
            "structured_outputs.disable_fallback",
        ),
    ],
)
def test_unknown_fields_are_listed_or_refused_when_strict(body: dict, field: str) -> None:
    assert parse(CHAT, body).unknown == [field]
    with pytest.raises(InvalidArgument) as err:
        parse(CHAT, body, strict=True)
    status, error = openai_reply.error_body(err.value)
    assert status == 400 and error["error"]["param"] == field
    assert error["error"]["message"] == f"{field}: unknown field (--strict-openai)"


def test_the_sdks_assistant_message_keys_and_vllm_extras_are_known() -> None:
    message = {
        "role": "assistant",
        "content": "hi",
        "refusal": None,
        "function_call": None,
        "audio": None,
        "annotations": [],
        "tool_calls": None,
    }
    call = parse(
        CHAT,
        {
            "messages": [*USER, message],
            "chat_template_kwargs": {"enable_thinking": False},
            "add_generation_prompt": True,
            "continuous_usage_stats": True,
            "functions": [],
            "function_call": "none",
        },
    )
    assert call.unknown == [] and len(call.request.messages.messages) == 2
    assert parse(CHAT, {"messages": USER, "guided_regex": "a+"}).request.constraint.regex == "a+"
    c = parse(CHAT, {"messages": USER, "structured_outputs": {"json": {"type": "object"}}})
    assert json.loads(c.request.constraint.json_schema) == {"type": "object"}
    c = parse(COMPLETIONS, {"prompt": "a", "response_format": {"type": "json_object"}})
    assert c.request.constraint.json_object


def test_engine_field_paths_become_the_json_fields() -> None:
    names = parse(COMPLETIONS, {"prompt": "a", "logprobs": 1}).names
    cases = {
        "sampling.top_p: 2 is out of range; allowed (0, 1]": "top_p",
        "stopping.stop_sequences[1]: must not be empty": "stop[1]",
        "stopping.max_new_tokens: 9999 is out of range": "max_tokens",
        "top_logprobs: 9 is out of range": "logprobs",
        "input: the prompt has 200 tokens": "prompt",
        "constraint.json_schema: bad schema": "response_format.json_schema.schema",
        "tools[2].parameters_json_schema: not valid JSON": "tools[2].function.parameters",
    }
    for message, param in cases.items():
        status, body = openai_reply.error_body(InvalidArgument(message), names)
        assert status == 400 and body["error"]["param"] == param
        assert body["error"]["message"].startswith(param + ": ")
    assert openai_reply.error_body(NotFound("session"))[0] == 404
    status, body = openai_reply.error_body(ResourceExhausted("queue full"))
    assert status == 429 and body["error"] == {
        "message": "queue full",
        "type": "rate_limit_error",
        "param": None,
        "code": "resource_exhausted",
    }


def test_a_resent_conversation_continues_after_the_last_answer() -> None:
    def msgs(*roles: str) -> list[common_pb2.ChatMessage]:
        return [common_pb2.ChatMessage(role=r, content=r) for r in roles]

    new = openai_api.continuation(msgs("system", "user", "assistant", "user"))
    assert [m.role for m in new] == ["user"]
    assert [m.role for m in openai_api.continuation(msgs("user"))] == ["user"]
    assert openai_api.continuation(msgs("user", "assistant")) == []
    tool_turn = openai_api.continuation(msgs("user", "assistant", "tool", "tool"))
    assert [m.role for m in tool_turn] == ["tool", "tool"]


def test_streamed_content_stops_where_a_tool_call_starts() -> None:
    call = parse(
        CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]}
    )
    reply = openai_reply.Reply(call, "m", "r")
    texts = ["Sure <to", "ol_", "call>\n{", '"name": "f"}']
    chunks = [reply.delta_chunk(generate_pb2.Delta(text=t)) for t in texts]
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c)
    assert content == "Sure "
    final = generate_pb2.Final(finish_reason=common_pb2.FINISH_REASON_EOS_TOKEN)
    final.tool_calls.add(id="call_1", name="f", arguments_json="{}")
    (last,) = reply.final_chunks(final)
    assert last["choices"][0]["finish_reason"] == "tool_calls"
    assert last["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] == "f"
    # Text that only looked like a tag's start is let out at the end.
    reply = openai_reply.Reply(call, "m", "r")
    reply.delta_chunk(generate_pb2.Delta(text="a <t"))
    (last,) = reply.final_chunks(generate_pb2.Final())
    assert last["choices"][0]["delta"]["content"] == "<t"


def test_response_format_strict_allows_only_the_listed_properties() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    strict = parse(CHAT, {"messages": USER, "response_format": fmt}).request.constraint
    assert json.loads(strict.json_schema)["additionalProperties"] is False
    fmt["json_schema"]["strict"] = False  # type: ignore[index]
    loose = parse(CHAT, {"messages": USER, "response_format": fmt}).request.constraint
    assert "additionalProperties" not in json.loads(loose.json_schema)
