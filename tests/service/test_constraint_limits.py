"""Constraint limits end to end (docs/design.md, "Structured output"; issue 29's
table): over gRPC and HTTP every hostile or careless constraint shape is
answered or refused INVALID_ARGUMENT before any token, the engine process
never dies of one, and a greedy stream running beside them keeps its tokens
and its pace. A real server on the tiny "bytes" model, with
``--max-constraint-bytes`` 1 MiB so that 100,000 choices fit.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.load import ref_chain_schema, rule_chain
from genai_client import ChatMessage, Client, InvalidArgumentError, Tool, ToolCall
from genai_common.errors import InvalidArgument
from genai_service.config import EngineConfig, LimitsConfig, ServerConfig
from genai_service.contract.request import Constraint
from genai_service.model.model_dir import load_model_spec
from genai_service.server.constraint_checker import ConstraintChecker
from tests.server_harness import ServerThread, free_port

MAX_CONSTRAINT_BYTES = 1 << 20
# The largest pause a stream beside the bad requests may see between two
# deltas (docs/reliability.md). The checker runs in its own process at a lower
# priority and the engine compiles off its step loop, so the measured pause is
# a few steps' worth; the bound leaves room for a 2-core CI machine under load.
MAX_STREAM_GAP_S = 3.0
STREAM_TOKENS = 48


@pytest.fixture(scope="module")
def server(bytes_models: dict[str, Path]) -> Iterator[ServerThread]:
    config = ServerConfig(
        engine=EngineConfig(
            model_dir=str(bytes_models["rope"]),
            limits=LimitsConfig(max_constraint_bytes=MAX_CONSTRAINT_BYTES),
        ),
        port=free_port(),
        http_port=0,
    )
    srv = ServerThread(config).start()
    yield srv
    srv.stop()


class Beside:
    """Greedy streams, one after another on their own channel, each checked
    against the first one's tokens; the largest gap between two deltas."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.reference: tuple[int, ...] = ()
        self.streams = 0
        self.max_gap_s = 0.0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _one(self, client: Client) -> tuple[int, ...]:
        stream = client.stream(
            "Beside: ", max_new_tokens=STREAM_TOKENS, ignore_eos=True, temperature=0
        )
        tokens: list[int] = []
        last = None
        for delta in stream:
            now = time.monotonic()
            if last is not None:
                self.max_gap_s = max(self.max_gap_s, now - last)
            last = now
            tokens.extend(delta.token_ids)
        return tuple(tokens)

    def _run(self) -> None:
        with Client(self.target) as client:
            while not self._stop.is_set():
                try:
                    tokens = self._one(client)
                except Exception as exc:  # recorded; the test fails on it
                    self.failures.append(repr(exc))
                    return
                if tokens != self.reference:
                    self.failures.append(f"stream {self.streams}: {tokens} != {self.reference}")
                self.streams += 1

    def __enter__(self) -> Beside:
        with Client(self.target) as client:
            self.reference = self._one(client)
        assert len(self.reference) == STREAM_TOKENS
        self.max_gap_s = 0.0
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(120)
        assert not self._thread.is_alive()
        assert not self.failures, self.failures
        assert self.streams >= 1
        assert self.max_gap_s < MAX_STREAM_GAP_S, self.max_gap_s


def attempt(client: Client, prompt: str | None = "Answer: ", **options: Any) -> str | None:
    """Stream one request: None when it was answered, else the message of the
    INVALID_ARGUMENT it got before any token (any other error fails)."""
    deltas = []
    try:
        for delta in client.stream(prompt, max_new_tokens=16, **options):
            deltas.append(delta)
    except InvalidArgumentError as err:
        assert not [d for d in deltas if d.token_ids], "refused after tokens"
        (violation,) = err.field_violations
        assert err.details.startswith(violation.field + ":")
        return err.details
    return None


def post(server: ServerThread, body: dict[str, Any]) -> tuple[int, Any]:
    assert server.server is not None
    conn = http.client.HTTPConnection("127.0.0.1", server.server.http_port, timeout=120)
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps(body).encode(),
            {"content-type": "application/json"},
        )
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def nested_items(depth: int) -> str:
    return '{"type":"array","items":' * depth + "{}" + "}" * depth


WIDE = {
    "type": "object",
    "properties": {f"property_number_{i:04}": {"type": "string"} for i in range(1200)},
}
CYCLES = {
    "$ref #": {"$ref": "#"},
    "a->a": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    "a->b->a": {
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
        "$ref": "#/$defs/a",
    },
}
WEATHER = Tool("weather", "The weather", {"type": "object", "properties": {"city": {}}})


def test_every_row_of_the_table_over_grpc(server: ServerThread) -> None:
    assert server.server is not None
    engine_pid = server.server.engine.pid
    with Beside(server.target), Client(server.target) as client:
        choices = [f"c{i}" for i in range(5000)]
        # 5,000 choices are answered (one lexeme, not 5,000 parser items).
        assert attempt(client, choice=choices) is None
        assert client.generate("Pick: ", choice=choices).text in choices
        many = [f"c{i}" for i in range(100_000)]
        assert attempt(client, choice=many) is None
        # The 3,000-rule chain that overflowed the engine's stack is answered.
        assert client.generate("X: ", grammar=rule_chain(3000)).text == "x"
        for name, schema in CYCLES.items():
            message = attempt(client, json_schema=schema)
            assert message is not None, name
            assert message.startswith("constraint.json_schema: ")
        for depth in (2000, 6000):
            assert attempt(client, json_schema=nested_items(depth)) == (
                f"constraint.json_schema: JSON nested {depth + 1} levels deep; allowed at most 128"
            )
        assert attempt(client, json_schema="[" * 20000 + "]" * 20000) == (
            "constraint.json_schema: JSON nested 20000 levels deep; allowed at most 128"
        )
        deep_tool = Tool("deep", "", nested_items(400))
        message = attempt(client, None, messages=[ChatMessage("user", "hi")], tools=[deep_tool])
        assert message == (
            "tools[0].parameters_json_schema: JSON nested 401 levels deep; allowed at most 128"
        )
        call = ToolCall("call_1", "weather", "[" * 100000 + "]" * 100000)
        history = [
            ChatMessage("user", "Weather?"),
            ChatMessage("assistant", "", tool_calls=(call,)),
            ChatMessage("tool", "sunny", tool_call_id="call_1"),
        ]
        message = attempt(client, None, messages=history, tools=[WEATHER])
        assert message == (
            "messages[1].tool_calls[0].arguments_json: JSON nested 100000 levels deep; "
            "allowed at most 128"
        )
        assert len(json.dumps(WIDE)) > 52_000
        assert attempt(client, json_schema=WIDE) is None
        for regex in ("a{1000000}", "(a{1000}){1000}"):
            message = attempt(client, regex=regex)
            assert message is not None and message.startswith("constraint.regex: "), regex
            assert "allowed at most 100000" in message
        message = attempt(client, grammar='start: "a" start')
        assert message is not None and message.startswith(
            "constraint.grammar: llguidance stopped matching it at generated token "
        )
        # What the old table answered still answers.
        for regex in ("(a+)+$", "(a|aa)*b{1000}", "a{1,100000}"):
            assert attempt(client, regex=regex) is None, regex
        # A $ref chain past the limit (950 links overflowed the compiler's stack).
        assert attempt(client, json_schema=ref_chain_schema(950)) == (
            "constraint.json_schema: a chain of 951 $refs, each leading to the next; allowed at most 256"
        )
        chained = Tool("chained", "", ref_chain_schema(3000))
        message = attempt(client, None, messages=[ChatMessage("user", "hi")], tools=[chained])
        assert message == (
            "tools[0].parameters_json_schema: a chain of 3001 $refs, each leading to the next; allowed at most 256"
        )
    assert server.server.engine.pid == engine_pid


def test_the_schema_rows_over_http(server: ServerThread) -> None:
    assert server.server is not None
    engine_pid = server.server.engine.pid
    chat = [{"role": "user", "content": "hi"}]

    def schema(value: Any) -> dict[str, Any]:
        return {
            "model": "default",
            "messages": chat,
            "max_tokens": 16,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": value},
            },
        }

    with Beside(server.target):
        for name, value in CYCLES.items():
            status, reply = post(server, schema(value))
            assert status == 400, (name, reply)
            assert reply["error"]["param"] == "response_format.json_schema.schema"
        status, reply = post(server, schema(WIDE))
        assert status == 200, reply
        status, reply = post(server, schema(ref_chain_schema(950)))
        assert status == 400 and reply["error"]["message"] == (
            "response_format.json_schema.schema: a chain of 951 $refs, each leading to the next; allowed at most 256"
        )
        # Nested past the body's own bound: the body is refused before it is read.
        deep = json.loads(nested_items(100))
        status, reply = post(server, schema(deep))
        assert status == 200 or reply["error"]["param"] == "response_format.json_schema.schema"
        raw = (
            '{"model":"default","messages":[],"response_format":' + "[" * 20000 + "]" * 20000 + "}"
        )
        assert server.server.http_port
        conn = http.client.HTTPConnection("127.0.0.1", server.server.http_port, timeout=60)
        try:
            conn.request("POST", "/v1/chat/completions", raw, {"content-type": "application/json"})
            response = conn.getresponse()
            status, reply = response.status, json.loads(response.read())
        finally:
            conn.close()
        assert status == 400 and reply["error"]["message"] == (
            "body: JSON nested 20001 levels deep; allowed at most 136"
        )
        tools = [
            {"type": "function", "function": {"name": "deep", "parameters": deep}},
        ]
        status, reply = post(server, {"model": "default", "messages": chat, "tools": tools})
        assert status in (200, 400), reply
        chained = [
            {"type": "function", "function": {"name": "c", "parameters": ref_chain_schema(3000)}}
        ]
        status, reply = post(server, {"model": "default", "messages": chat, "tools": chained})
        assert status == 400 and reply["error"]["param"] == "tools[0].function.parameters"
        call = {
            "id": "c1",
            "type": "function",
            "function": {"name": "weather", "arguments": "[" * 100000 + "]" * 100000},
        }
        messages = [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ]
        weather = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
        status, reply = post(server, {"model": "default", "messages": messages, "tools": weather})
        assert status == 400 and reply["error"]["message"].endswith(
            "JSON nested 100000 levels deep; allowed at most 128"
        )
    assert server.server.engine.pid == engine_pid


def test_a_check_that_crashes_the_checker_costs_only_its_request(
    bytes_models: dict[str, Path],
) -> None:
    # A checker whose compiler has a 256 KiB stack: a grammar that overflows it
    # kills the checker process, which is INVALID_ARGUMENT for that request; the
    # next check starts a new process.
    async def run() -> None:
        checker = ConstraintChecker(
            load_model_spec(bytes_models["rope"]), MAX_CONSTRAINT_BYTES, stack_bytes=256 * 1024
        )
        try:
            await checker.start()
            with pytest.raises(InvalidArgument) as err:
                await checker.check(Constraint("grammar", rule_chain(3000)))
            assert err.value.message == (
                "constraint.grammar: checking it crashed the constraint checker (SIGSEGV); "
                "it nests too deeply or is too large for llguidance"
            )
            await checker.check(Constraint("regex", "[a-z]{3}"))
            assert checker.starts == 2
            # The verdict is kept: the same grammar again costs no process.
            with pytest.raises(InvalidArgument):
                await checker.check(Constraint("grammar", rule_chain(3000)))
            assert checker.starts == 2 and checker.counters["verdict_hits"] == 1
        finally:
            await checker.close()

    asyncio.run(run())


# -- fuzz ----------------------------------------------------------------------


def _choices(draw: st.DrawFn) -> dict[str, Any]:
    count = draw(st.sampled_from([2, 3, 1999, 2001, 5000, 20_000, 100_000, 100_001]))
    length = draw(st.sampled_from([1, 8, 200, 4000]))
    # At most twice the byte limit in all (more would pass gRPC's message limit).
    pad = "x" * min(length, 2 * MAX_CONSTRAINT_BYTES // count)
    return {"choice": [f"{i}{pad}" for i in range(count)]}


@st.composite
def shapes(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["choice", "size", "depth", "enum", "regex", "refs", "rules"]))
    if kind == "choice":
        return _choices(draw)
    if kind == "size":
        target = MAX_CONSTRAINT_BYTES + draw(st.sampled_from([-1, 0, 1, 4096]))
        text = '{"type":"string","description":""}'
        return {"json_schema": text.replace('""', '"' + "d" * (target - len(text)) + '"')}
    if kind == "depth":
        depth = draw(st.sampled_from([1, 60, 64, 65, 127, 128, 129, 400, 50_000]))
        shape = draw(st.sampled_from(["items", "brackets", "properties"]))
        if shape == "items":
            return {"json_schema": nested_items(depth)}
        if shape == "brackets":
            return {"json_schema": "[" * depth + "]" * depth}
        return {"json_schema": '{"type":"object","properties":{"p":' * depth + "{}" + "}}" * depth}
    if kind == "enum":
        count = draw(st.sampled_from([1, 100, 2001, 10_000, 60_000]))
        return {"json_schema": {"enum": [f"value-{i}" for i in range(count)]}}
    if kind == "regex":
        n = draw(st.sampled_from([1, 1000, 65_535, 100_000, 100_001, 10**6, 10**9]))
        outer = draw(st.sampled_from([1, 2, 100, 1000]))
        form = draw(st.sampled_from(["a{%d}", "(a{%d}){%d}", "[ab]{1,%d}", "(a|b){0,%d}c"]))
        return {"regex": form % ((n, outer) if form.count("%d") == 2 else n)}
    if kind == "refs":
        return {"json_schema": ref_chain_schema(draw(st.sampled_from([1, 255, 256, 257, 2000])))}
    rules = draw(st.sampled_from([1, 100, 3000, 9999, 10_000, 10_001]))
    return {"grammar": rule_chain(rules)}


@settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(shapes())
def test_fuzz_constraint_shapes(
    server: ServerThread, beside: Beside, shape: dict[str, Any]
) -> None:
    with Client(server.target) as client:
        message = attempt(client, **shape)
    del message  # answered or INVALID_ARGUMENT before any token; nothing else
    assert not beside.failures, beside.failures
    assert beside.max_gap_s < MAX_STREAM_GAP_S, beside.max_gap_s


@pytest.fixture(scope="module")
def beside(server: ServerThread) -> Iterator[Beside]:
    assert server.server is not None
    engine_pid = server.server.engine.pid
    with Beside(server.target) as b:
        yield b
    assert server.server.engine.pid == engine_pid
