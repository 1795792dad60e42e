"""What real OpenAI clients send (issue 30): every parameter of the SDK's
``create``, an assistant message sent back as ``model_dump()`` gives it,
fields this server does not know (accepted and logged; 400 with
``--strict-openai``), vLLM's structured-output extras, model names, and the
seed a sampled answer can be repeated with."""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.server_harness import ServerThread, start_http_server

CHAT = [{"role": "user", "content": "Hello there"}]
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
# One valid value for each parameter of the SDK's chat.completions.create
# (openai 3.60), with the parameters it needs beside it.
CHAT_PARAMS: dict[str, dict[str, Any]] = {
    "audio": {"audio": {"voice": "alloy", "format": "wav"}},
    "frequency_penalty": {"frequency_penalty": 0.1},
    "function_call": {"function_call": "none"},
    "functions": {"functions": [TOOL["function"]]},
    "logit_bias": {"logit_bias": {"5": 1.0}},
    "logprobs": {"logprobs": True},
    "max_completion_tokens": {"max_completion_tokens": 4},
    "max_tokens": {"max_tokens": 4},
    "metadata": {"metadata": {"k": "v"}},
    "modalities": {"modalities": ["text"]},
    "moderation": {"moderation": {}},
    "n": {"n": 2},
    "parallel_tool_calls": {"parallel_tool_calls": False, "tools": [TOOL]},
    "prediction": {"prediction": {"type": "content", "content": "x"}},
    "presence_penalty": {"presence_penalty": 0.1},
    "prompt_cache_key": {"prompt_cache_key": "k"},
    "prompt_cache_options": {"prompt_cache_options": {}},
    "prompt_cache_retention": {"prompt_cache_retention": "in-memory"},
    "reasoning_effort": {"reasoning_effort": "low"},
    "response_format": {"response_format": {"type": "json_object"}},
    "safety_identifier": {"safety_identifier": "u1"},
    "seed": {"seed": 7},
    "service_tier": {"service_tier": "auto"},
    "stop": {"stop": ["\n\n"]},
    "store": {"store": False},
    "stream": {"stream": True},
    "stream_options": {
        "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False},
    },
    "temperature": {"temperature": 0.5},
    "tool_choice": {"tool_choice": "none", "tools": [TOOL]},
    "tools": {"tools": [TOOL]},
    "top_logprobs": {"logprobs": True, "top_logprobs": 2},
    "top_p": {"top_p": 0.9},
    "user": {"user": "u"},
    "verbosity": {"verbosity": "low"},
    "web_search_options": {"web_search_options": {}},
}
COMPLETION_PARAMS: dict[str, dict[str, Any]] = {
    "best_of": {"best_of": 2},
    "echo": {"echo": True},
    "frequency_penalty": {"frequency_penalty": 0.1},
    "logit_bias": {"logit_bias": {"5": 1.0}},
    "logprobs": {"logprobs": 2},
    "max_tokens": {"max_tokens": 4},
    "n": {"n": 2},
    "presence_penalty": {"presence_penalty": 0.1},
    "seed": {"seed": 7},
    "stop": {"stop": "\n"},
    "stream": {"stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_usage": True}},
    "suffix": {"suffix": " and so on."},
    "temperature": {"temperature": 0.5},
    "top_p": {"top_p": 0.9},
    "user": {"user": "u"},
}
SDK_OWN = {"messages", "model", "prompt", "extra_headers", "extra_query", "extra_body", "timeout"}


start = start_http_server


@pytest.fixture(scope="module")
def server(bytes_models: dict[str, Path]) -> Iterator[ServerThread]:
    srv = start(bytes_models["rope"])
    yield srv
    srv.stop()


def client_of(server: ServerThread) -> openai.OpenAI:
    assert server.server is not None
    url = f"http://127.0.0.1:{server.server.http_port}/v1"
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0)


@pytest.fixture()
def client(server: ServerThread) -> Iterator[openai.OpenAI]:
    with client_of(server) as c:
        yield c


def test_every_parameter_of_the_sdks_create_is_accepted(client: openai.OpenAI) -> None:
    for create, params, base in (
        (client.chat.completions.create, CHAT_PARAMS, {"messages": CHAT}),
        (client.completions.create, COMPLETION_PARAMS, {"prompt": "The sky is"}),
    ):
        sdk = set(inspect.signature(create).parameters) - SDK_OWN
        assert sdk <= set(params), f"a sample value for {sorted(sdk - set(params))}"
        for name in sorted(sdk):
            args = {"model": "default", "max_tokens": 4, **base, **params[name]}
            if name == "suffix":  # this model has no FIM tokens (test_fim.py has one that has)
                with pytest.raises(openai.BadRequestError) as err:
                    create(**args)
                assert err.value.body["param"] == "suffix"  # type: ignore[index]
                continue
            reply = create(**args)
            if args.get("stream"):
                chunks = list(reply)
                assert chunks and chunks[-1].system_fingerprint, name
            else:
                assert reply.choices and reply.usage is not None, name


def test_an_assistant_message_sent_back_as_model_dump(client: openai.OpenAI) -> None:
    """The most common multi-turn idiom: the SDK's message object, dumped, with
    its null keys (refusal, function_call, audio, annotations)."""
    first = client.chat.completions.create(model="default", messages=CHAT, max_tokens=4)
    dumped = first.choices[0].message.model_dump()
    assert {"refusal", "function_call", "audio", "annotations"} <= set(dumped)
    messages = [*CHAT, dumped, {"role": "user", "content": "And then?"}]
    second = client.chat.completions.create(model="default", messages=messages, max_tokens=4)
    assert second.choices[0].message.content is not None
    dumped["annotations"] = []
    dumped["refusal"] = None
    third = client.chat.completions.create(
        model="default", messages=[*CHAT, dumped, *messages[2:]], max_tokens=4, temperature=0
    )
    again = client.chat.completions.create(
        model="default",
        messages=[*CHAT, {"role": "assistant", "content": dumped["content"]}, *messages[2:]],
        max_tokens=4,
        temperature=0,
    )
    assert third.choices[0].message.content == again.choices[0].message.content


class _Log:
    """Stands in for the gateway's logger: what it warned about."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.warnings: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **kw: Any) -> None:
        self.warnings.append((event, kw))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def test_unknown_fields_are_accepted_and_logged_unless_strict(
    client: openai.OpenAI, bytes_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from genai_service.server.http_api import http_gateway

    log = _Log(http_gateway.log)
    monkeypatch.setattr(http_gateway, "log", log)
    extra = {
        "frobnicate": 1,
        "chat_template_kwargs": {"enable_thinking": False},
        "add_generation_prompt": True,
        "continuous_usage_stats": True,
        "use_beam_search": False,
    }
    plain = client.chat.completions.create(
        model="default", messages=CHAT, max_tokens=5, temperature=0
    )
    sent = client.chat.completions.create(
        model="default", messages=CHAT, max_tokens=5, temperature=0, extra_body=extra
    )
    assert sent.choices[0].message.content == plain.choices[0].message.content
    assert log.warnings == [
        ("openai_fields_ignored", {"fields": ["frobnicate", "use_beam_search"]})
    ]
    strict = start(bytes_models["rope"], strict_openai=True)
    try:
        with client_of(strict) as c:
            with pytest.raises(openai.BadRequestError) as err:
                c.chat.completions.create(
                    model="default", messages=CHAT, max_tokens=5, extra_body={"frobnicate": 1}
                )
            body = err.value.body
            assert isinstance(body, dict) and body["param"] == "frobnicate"
            assert body["message"] == "frobnicate: unknown field (--strict-openai)"
            # The fields the SDK itself sends are never refused.
            c.chat.completions.create(model="default", messages=CHAT, max_tokens=2, user="u")
    finally:
        strict.stop()


def test_vllm_structured_outputs_and_response_format_on_completions(
    client: openai.OpenAI,
) -> None:
    for extra, check in (
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"structured_outputs": {"choice": ["red", "blue"]}}, lambda t: t in ("red", "blue")),
        ({"structured_outputs": {"regex": "[0-9]{3}"}}, lambda t: re.fullmatch("[0-9]{3}", t)),
        (
            {"guided_json": {"type": "object", "properties": {"a": {"type": "integer"}},
                             "required": ["a"], "additionalProperties": False}},
            lambda t: isinstance(json.loads(t)["a"], int),
        ),
    ):  # fmt: skip
        r = client.chat.completions.create(
            model="default", messages=CHAT, max_tokens=40, extra_body=extra
        )
        text = r.choices[0].message.content or ""
        assert check(text), (extra, text)
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a"],
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False},
    }
    r = client.completions.create(
        model="default",
        prompt="Data: ",
        max_tokens=40,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}},
    )
    assert r.choices[0].finish_reason == "stop" and 0 <= json.loads(r.choices[0].text)["a"] <= 9
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="default",
            messages=CHAT,
            response_format={"type": "json_object"},
            extra_body={"guided_regex": "a+"},
        )
    assert err.value.body["param"] == "guided_regex"  # type: ignore[index]


def test_model_names(
    client: openai.OpenAI, server: ServerThread, bytes_models: dict[str, Path]
) -> None:
    assert server.server is not None and server.server.engine.info is not None
    model_id = server.server.engine.info.model_id
    assert [m.id for m in client.models.list().data] == ["default", model_id]
    assert client.models.retrieve("default").id == "default"
    assert client.models.retrieve(model_id).id == model_id
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4o")
    assert err.value.body["code"] == "model_not_found"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)
    assert err.value.body == {  # type: ignore[comparison-overlap]
        "message": "model: the model `gpt-4o` does not exist",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    r = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=2)
    assert r.model == model_id
    named = start(bytes_models["rope"], served_model_names=("tiny", "tiny-chat"))
    try:
        with client_of(named) as c:
            assert [m.id for m in c.models.list().data] == ["tiny", "tiny-chat"]
            assert c.completions.create(model="tiny-chat", prompt="a", max_tokens=2).model == (
                "tiny-chat"
            )
            with pytest.raises(openai.NotFoundError):
                c.completions.create(model="default", prompt="a", max_tokens=2)
    finally:
        named.stop()


def test_the_seed_of_a_sampled_answer_comes_back(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="default", messages=CHAT, max_tokens=8, temperature=1.0
    )
    first = raw.parse()
    seed = int(raw.headers["x-seed"])
    assert first.system_fingerprint == f"seed-{seed}"
    again = client.chat.completions.create(
        model="default", messages=CHAT, max_tokens=8, temperature=1.0, seed=seed
    )
    assert again.choices[0].message.content == first.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            model="default", messages=CHAT, max_tokens=8, temperature=1.0, seed=seed, stream=True
        )
    )
    assert chunks[-1].system_fingerprint == f"seed-{seed}"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        first.choices[0].message.content
    )


LOOSE_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up.",
        # LangChain's bind_tools form: no additionalProperties, nothing required
        "parameters": {
            "type": "object",
            "properties": {
                "word": {"type": "string", "maxLength": 6},
                "limit": {"type": "integer", "minimum": 0, "maximum": 9},
            },
        },
    },
}


def test_a_forced_call_with_a_non_strict_schema_finishes(client: openai.OpenAI) -> None:
    """Issue 30: with JSON Schema's default (any other key, any number of
    times) a forced call repeated keys until max_tokens. Forced calls follow
    OpenAI's strict semantics: only the schema's properties, each once."""
    for choice in ("required", {"type": "function", "function": {"name": "lookup"}}):
        for seed in range(3):
            r = client.chat.completions.create(
                model="default",
                messages=CHAT,
                tools=[LOOSE_TOOL],
                tool_choice=choice,  # type: ignore[arg-type]
                max_tokens=300,
                temperature=1.0,
                seed=seed,
            )
            message = r.choices[0].message
            assert r.choices[0].finish_reason == "tool_calls", message
            (call,) = message.tool_calls or []
            arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
            assert set(arguments) <= {"word", "limit"}, arguments


def test_a_call_cut_off_by_max_tokens_is_a_partial_tool_call(client: openai.OpenAI) -> None:
    """Issue 30: the unary reply returned the raw call text as content and the
    stream dropped it; both give a partial tool_calls entry, as OpenAI does."""
    args = {
        "model": "default",
        "messages": CHAT,
        "tools": [LOOSE_TOOL],
        "tool_choice": "required",
        # one token per byte: the tag and newline (12), then part of the name
        "max_tokens": 24,
        "temperature": 0,
    }
    r = client.chat.completions.create(**args)  # type: ignore[call-overload]
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert "lookup".startswith(call.function.name) and call.function.name  # type: ignore[union-attr]
    assert "tool_call" not in (call.function.arguments or "")  # type: ignore[union-attr]
    chunks = list(client.chat.completions.create(**args, stream=True))  # type: ignore[call-overload]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    last = [c for c in chunks if c.choices][-1].choices[0]
    assert last.finish_reason == "length"
    (streamed,) = last.delta.tool_calls or []
    assert streamed.index == 0
    assert streamed.function.name == call.function.name  # type: ignore[union-attr]
    assert streamed.function.arguments == call.function.arguments  # type: ignore[union-attr]


def test_a_forced_calls_arguments_stream_in_pieces(
    client: openai.OpenAI, bytes_models: dict[str, Path]
) -> None:
    """Issue 30: arguments sent as they are generated (OpenAI, vLLM and
    llama.cpp stream them), including with several tokens per delta
    (--stream-interval 4)."""
    coalescing = start(bytes_models["rope"], stream_interval=4)
    try:
        with client_of(coalescing) as c:
            _check_streamed_call(c, min_pieces=2)
    finally:
        coalescing.stop()
    _check_streamed_call(client, min_pieces=5)


def _check_streamed_call(client: openai.OpenAI, min_pieces: int) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {
                "type": "object",
                "properties": {"word": {"type": "string", "minLength": 8, "maxLength": 12}},
                "required": ["word"],
            },
        },
    }
    args = {
        "model": "default",
        "messages": CHAT,
        "tools": [tool],
        "tool_choice": "required",
        "max_tokens": 200,
        "temperature": 0,
    }
    whole = client.chat.completions.create(**args)  # type: ignore[call-overload]
    (call,) = whole.choices[0].message.tool_calls or []
    chunks = list(client.chat.completions.create(**args, stream=True))  # type: ignore[call-overload]
    pieces = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    first, *rest = pieces
    assert first.id and first.type == "function" and first.function.name == "lookup"  # type: ignore[union-attr]
    assert first.function.arguments == ""  # type: ignore[union-attr]
    assert len(rest) >= min_pieces and all(p.index == 0 and p.id is None for p in rest)
    arguments = "".join(p.function.arguments or "" for p in rest)  # type: ignore[union-attr]
    assert json.loads(arguments) == json.loads(call.function.arguments)  # type: ignore[union-attr]
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "tool_calls"


def test_langchain_openai_forced_tools_and_structured_output(server: ServerThread) -> None:
    """What LangChain sends (issue 30): bind_tools with a forced choice and its
    non-strict schema gives a complete call; with_structured_output parses."""
    import langchain_openai
    from pydantic import BaseModel, Field

    class Lookup(BaseModel):
        """Look a word up."""

        word: str = Field(max_length=6)

    class Pick(BaseModel):
        n: int = Field(ge=0, le=9)

    assert server.server is not None
    chat = langchain_openai.ChatOpenAI(
        base_url=f"http://127.0.0.1:{server.server.http_port}/v1",
        api_key="unused",
        model="default",
        temperature=0,
        max_tokens=200,
        max_retries=0,
    )
    for choice in ("Lookup", "any"):
        message = chat.bind_tools([Lookup], tool_choice=choice).invoke("Find 'cat'.")
        (call,) = message.tool_calls
        assert call["name"] == "Lookup" and set(call["args"]) <= {"word"}
    picked = chat.with_structured_output(Pick).invoke("Pick a digit.")
    assert isinstance(picked, Pick) and 0 <= picked.n <= 9


def test_litellm_completion(server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """litellm's completion() against the HTTP port (issue 30): its OpenAI-
    compatible provider, streamed and not, with a forced tool call."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch from the network
    import litellm

    assert server.server is not None
    base = {
        "model": "openai/default",
        "api_base": f"http://127.0.0.1:{server.server.http_port}/v1",
        "api_key": "unused",
        "messages": CHAT,
        "max_tokens": 8,
        "temperature": 0,
    }
    r = litellm.completion(**base)
    text = r.choices[0].message.content
    assert text
    streamed = "".join(
        chunk.choices[0].delta.content or "" for chunk in litellm.completion(**base, stream=True)
    )
    assert streamed == text
    r = litellm.completion(
        **{**base, "max_tokens": 200}, tools=[LOOSE_TOOL], tool_choice="required"
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "lookup"
    assert set(json.loads(call.function.arguments)) <= {"word", "limit"}


def test_continuous_usage_stats(client: openai.OpenAI) -> None:
    """vLLM's stream_options.continuous_usage_stats: usage in every chunk,
    the completion tokens so far; the last one is the request's usage."""
    chunks = list(
        client.chat.completions.create(
            model="default",
            messages=CHAT,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        )
    )
    final = chunks[-1].usage
    assert final is not None and final.completion_tokens == 6
    counts = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert len(counts) == len(chunks) and counts == sorted(counts) and counts[-1] == 6
    assert {c.usage.prompt_tokens for c in chunks if c.usage} == {final.prompt_tokens}
    assert all(
        c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
        for c in chunks
        if c.usage
    )


def test_a_model_name_before_the_engine_is_ready_is_unavailable_not_unknown(
    tiny_model_dir: Path,
) -> None:
    """While the engine starts, the model id is not known yet: a request is
    503 (retry), never 404 model_not_found (which clients take as final)."""
    from types import SimpleNamespace

    from genai_common.errors import Unavailable
    from genai_service.config import EngineConfig, ServerConfig
    from genai_service.server.http_api.http_gateway import HttpGateway, ModelNotFound

    gateway = HttpGateway.__new__(HttpGateway)
    gateway.fe = SimpleNamespace(engine=SimpleNamespace(info=None))  # type: ignore[assignment]
    gateway.config = ServerConfig(engine=EngineConfig(model_dir=str(tiny_model_dir)))
    with pytest.raises(Unavailable):
        gateway._model_of({"model": "whatever-the-id-will-be"})
    named = ServerConfig(
        engine=EngineConfig(model_dir=str(tiny_model_dir)), served_model_names=("tiny",)
    )
    gateway.config = named  # names given: known without the engine
    assert gateway._model_of({"model": "tiny"}) == "tiny"
    with pytest.raises(ModelNotFound):
        gateway._model_of({"model": "other"})
