"""Structured output on the real default model (slow): every constrained answer
parses and validates, greedy and sampled, with and without speculation."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jsonschema
import pytest

from genai_service.config import EngineConfig, RunnerConfig, SpeculationConfig
from genai_service.contract.request import (
    Constraint,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
)
from genai_service.engine.engine import LLMEngine

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["student", "teacher", "engineer", "artist", "doctor"]},
        "hobbies": {
            "type": "array",
            "items": {"type": "string", "maxLength": 20},
            "minItems": 1,
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "hobbies", "address"],
    "additionalProperties": False,
}
PEOPLE = [
    "a retired doctor from Lisbon",
    "a young art student",
    "an engineer who likes chess",
    "a teacher in Nairobi",
    "a painter who lives by the sea",
    "a nurse who runs marathons",
    "a physics student in Tokyo",
    "a chef who grows vegetables",
    "a musician from New Orleans",
    "a software engineer who bakes bread",
    "a librarian who collects stamps",
    "a carpenter in the mountains",
    "a high-school teacher who hikes",
    "a surgeon who plays the violin",
    "an architect in Berlin",
    "a farmer who keeps bees",
    "a photographer who travels",
    "a pilot who reads poetry",
    "a student who learns Spanish",
    "a sculptor who swims every day",
]
assert len(PEOPLE) == 20


def engine(model_dir: Path, speculate: int = 0) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model_dir=str(model_dir),
            runner=RunnerConfig(intra_op_threads=2),
            speculation=SpeculationConfig(num_tokens=speculate),
        )
    )


def chat(eng: LLMEngine, content: str) -> tuple[int, ...]:
    text = eng.tokenizer.apply_chat_template([{"role": "user", "content": content}])
    return tuple(eng.tokenizer.encode(text, add_special_tokens=False))


def person_requests(eng: LLMEngine, sampling: SamplingParams, tag: str) -> list[GenerationRequest]:
    constraint = Constraint("json_schema", json.dumps(PERSON))
    return [
        GenerationRequest(
            f"{tag}-{i}",
            chat(eng, f"Describe {who} as a JSON object with name, age, role, hobbies, address."),
            sampling=sampling,
            # Enough for the longest answer the schema allows: its strings are
            # bounded in characters, and a model that drifts into CJK (the int8
            # graph on some CPUs does, greedy) spends up to 3 tokens a character.
            stopping=StoppingCriteria(max_new_tokens=512),
            constraint=constraint,
        )
        for i, who in enumerate(PEOPLE)
    ]


def test_json_schema_answers_validate_greedy_and_sampled(default_model_dir: Path) -> None:
    eng = engine(default_model_dir)
    reqs = person_requests(eng, SamplingParams(), "greedy")
    for seed in (1, 2):
        reqs += person_requests(
            eng, SamplingParams(temperature=0.8, top_p=0.95, seed=seed), f"s{seed}"
        )
    results = eng.run_to_completion(reqs)
    for rid, result in results.items():
        assert result.finish_reason is FinishReason.EOS_TOKEN, (rid, result.text)
        jsonschema.validate(json.loads(result.text), PERSON)
    assert eng.guidance.counters["grammars_compiled"] == 1  # one schema, compiled once


def test_regex_and_choice_answers(default_model_dir: Path) -> None:
    eng = engine(default_model_dir)
    date = r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
    questions = [
        "When did the Apollo 11 landing happen? Answer with a date.",
        "On what date did the Berlin Wall fall?",
        "Give the date of the first day of the year 2000.",
        "What is a date in the summer of 1999?",
        "When was the first iPhone announced?",
    ]
    colors = ("red", "green", "blue", "yellow")
    reqs = [
        GenerationRequest(
            f"date-{i}",
            chat(eng, q),
            stopping=StoppingCriteria(max_new_tokens=30),
            constraint=Constraint("regex", date),
        )
        for i, q in enumerate(questions)
    ] + [
        GenerationRequest(
            f"color-{i}",
            chat(eng, q),
            sampling=SamplingParams(temperature=0.7, seed=i),
            stopping=StoppingCriteria(max_new_tokens=10),
            constraint=Constraint("choice", choices=colors),
        )
        for i, q in enumerate(
            ["What color is the sky?", "What color is grass?", "What color is a banana?"]
        )
    ]
    results = eng.run_to_completion(reqs)
    for rid, result in results.items():
        if rid.startswith("date"):
            assert re.fullmatch(date, result.text), (rid, result.text)
        else:
            assert result.text in colors, (rid, result.text)
        assert result.finish_reason is FinishReason.EOS_TOKEN


def test_json_schema_answers_validate_with_speculation(default_model_dir: Path) -> None:
    eng = engine(default_model_dir, speculate=4)
    source = {
        "name": "Ada Lovelace",
        "age": 36,
        "role": "engineer",
        "hobbies": ["mathematics", "poetry"],
        "address": {"city": "London", "zip": 10001},
    }
    prompt = f"Copy this JSON exactly:\n{json.dumps(source)}"
    greedy = dataclasses.replace(
        person_requests(eng, SamplingParams(), "spec")[0], prompt_token_ids=chat(eng, prompt)
    )
    sampled = dataclasses.replace(
        greedy, request_id="spec-s", sampling=SamplingParams(seed=3, temperature=0.7)
    )
    for request in (greedy, sampled, *person_requests(eng, SamplingParams(), "spec-p")[:4]):
        result = eng.generate(request)  # alone: speculation runs at batch 1
        assert result.finish_reason is FinishReason.EOS_TOKEN, result.text
        jsonschema.validate(json.loads(result.text), PERSON)
    assert eng.counters["spec_accepted_tokens"] > 0


WEATHER_ARGS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": WEATHER_ARGS,
    },
    {
        "name": "get_population",
        "description": "How many people live in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
]


def test_tool_calls_and_a_session_turn_with_the_result(default_model_dir: Path) -> None:
    from genai_client import ChatMessage, Client
    from genai_service.config import ServerConfig
    from tests.server_harness import ServerThread, free_port

    schemas = {t["name"]: t["parameters"] for t in TOOLS}
    config = ServerConfig(
        engine=EngineConfig(
            model_dir=str(default_model_dir), runner=RunnerConfig(intra_op_threads=2)
        ),
        port=free_port(),
    )
    srv = ServerThread(config).start()
    try:
        with Client(srv.target) as client, client.session() as chat:
            first = chat.generate(
                messages=[("user", "What is the weather like in Paris today?")],
                tools=TOOLS,
                tool_choice="required",
                max_new_tokens=80,
            )
            (call,) = first.tool_calls
            jsonschema.validate(call.arguments, schemas[call.name])
            answer = chat.generate(
                messages=[
                    ChatMessage("tool", '{"temperature": 21, "sky": "sunny"}', tool_call_id=call.id)
                ],
                max_new_tokens=60,
            )
            assert answer.finish_reason == "EOS_TOKEN" and answer.text.strip()
            assert answer.usage.cached_tokens >= first.session_tokens - 1
            # A named tool, streamed: the call arrives with the final.
            stream = client.stream(
                messages=[("user", "How many people live in Lyon?")],
                tools=TOOLS,
                tool_choice="get_population",
                max_new_tokens=60,
            )
            "".join(d.text for d in stream)
            (named,) = stream.result.tool_calls
            assert named.name == "get_population"
            jsonschema.validate(named.arguments, schemas["get_population"])
    finally:
        srv.stop()
