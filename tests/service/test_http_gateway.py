"""The OpenAI-compatible HTTP plane (genai-server --http-port) against a live
server on a tiny model, with the official ``openai`` SDK and ``curl`` as clients."""

from __future__ import annotations

import asyncio
import http.client
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from genai_client import Client
from tests.conftest import require_tool
from tests.server_harness import ServerThread, free_port, start_http_server

TOKEN = "http-test-token"
CHAT = [{"role": "user", "content": "Hello there"}]


start = start_http_server


@pytest.fixture(scope="module")
def server(bytes_models: dict[str, Path]) -> Iterator[ServerThread]:
    srv = start(bytes_models["rope"])
    yield srv
    srv.stop()


def base_url(server: ServerThread) -> str:
    assert server.server is not None
    return f"http://127.0.0.1:{server.server.http_port}/v1"


def call(
    server: ServerThread, method: str, path: str, body: Any = None, **headers: str
) -> tuple[int, Any]:
    """One plain HTTP request (stdlib): the status and the decoded JSON body."""
    assert server.server is not None
    conn = http.client.HTTPConnection("127.0.0.1", server.server.http_port, timeout=60)
    try:
        data = json.dumps(body).encode() if body is not None else None
        hdrs = {k.replace("_", "-"): v for k, v in headers.items()}
        conn.request(method, path, data, {"content-type": "application/json", **hdrs})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        conn.close()


@pytest.fixture()
def client(server: ServerThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=base_url(server), api_key="unused", max_retries=0) as c:
        yield c


def test_chat_completion_unary_and_streamed_agree(client: openai.OpenAI) -> None:
    unary = client.chat.completions.create(
        model="default", messages=CHAT, max_tokens=12, temperature=0
    )
    choice = unary.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert unary.usage is not None and unary.usage.completion_tokens >= 1
    assert unary.usage.total_tokens == unary.usage.prompt_tokens + unary.usage.completion_tokens
    assert unary.id.startswith("chatcmpl-")
    stream = client.chat.completions.create(
        model="default",
        messages=CHAT,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].choices == [] and chunks[-1].usage == unary.usage
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    def once(seed: int) -> str:
        r = client.completions.create(
            model="default",
            prompt="Once upon",
            max_tokens=16,
            temperature=1.0,
            top_p=0.95,
            seed=seed,
        )
        return r.choices[0].text

    assert once(7) == once(7)
    assert len({once(s) for s in range(1, 6)}) > 1  # the seed matters


def test_completions_logprobs_and_stop(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model="default", prompt="abc", max_tokens=8, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == r.usage.completion_tokens  # type: ignore[union-attr]
    assert all(len(t) <= 2 for t in lp.top_logprobs)  # type: ignore[union-attr]
    assert "".join(lp.tokens) == r.choices[0].text  # type: ignore[union-attr]
    chat = client.chat.completions.create(
        model="default", messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=0
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(c.top_logprobs == [] for c in content)
    # A stop string taken from the unary answer ends it there.
    whole = client.completions.create(model="default", prompt="abc", max_tokens=8, temperature=0)
    text = whole.choices[0].text
    assert len(text) >= 4
    stop = text[2:4]
    cut = client.completions.create(
        model="default", prompt="abc", max_tokens=8, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_invalid_parameters_are_bad_requests_naming_the_field(client: openai.OpenAI) -> None:
    cases = {
        "temperature": {"temperature": -1.0},
        "top_p": {"top_p": 1.5},
        "max_tokens": {"max_tokens": 0},
        "n": {"n": 0},
        "top_k": {"extra_body": {"top_k": "x"}},
        "messages[0].role": {"messages": [{"role": "robot", "content": "x"}]},
    }
    for field, kw in cases.items():
        args = {"model": "default", "messages": CHAT, **kw}
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(**args)  # type: ignore[call-overload]
        body = err.value.body
        assert isinstance(body, dict) and body["param"] == field, (field, body)
        assert body["message"].startswith(field + ":")
        assert body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="default", messages=CHAT, max_completion_tokens=10**6)
    assert err.value.body["param"] == "max_completion_tokens"  # type: ignore[index]


def test_openai_ranges_and_the_fields_sdks_send_without_effect(
    client: openai.OpenAI, server: ServerThread
) -> None:
    # OpenAI's temperature range is [0, 2] (gRPC's own is wider).
    for bad in (99, 2.5, -0.1):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="default", messages=CHAT, temperature=bad)
        assert err.value.body == {  # type: ignore[comparison-overlap]
            "message": f"temperature: {bad} is out of range; allowed [0, 2]",
            "type": "invalid_request_error",
            "param": "temperature",
            "code": "invalid_argument",
        }
    plain = client.chat.completions.create(
        model="default", messages=CHAT, max_tokens=6, temperature=0
    )
    # What current SDKs and agent frameworks send: accepted, the same greedy answer.
    sent = client.chat.completions.create(
        model="default",
        messages=CHAT,
        max_tokens=6,
        temperature=0,
        reasoning_effort="low",
        verbosity="low",
        modalities=["text"],
        audio=None,
        prediction={"type": "content", "content": "x"},
        web_search_options={},
        prompt_cache_key="k",
        safety_identifier="u1",
        store=False,
        metadata={"a": "b"},
        service_tier="auto",
        parallel_tool_calls=True,
        user="u",
    )
    assert sent.choices[0].message.content == plain.choices[0].message.content
    # Checked for type (a truly unknown field: test_openai_compat.py).
    for body, param, message in (
        ({"reasoning_effort": 3}, "reasoning_effort", "reasoning_effort: 3 is not a string"),
        ({"modalities": "text"}, "modalities", 'modalities: "text" is not an array'),
    ):
        status, reply = call(
            server, "POST", "/v1/chat/completions", {"model": "default", "messages": CHAT, **body}
        )
        assert status == 400 and reply["error"]["param"] == param
        assert reply["error"]["message"] == message


def test_async_client_and_models(server: ServerThread) -> None:
    async def run() -> tuple[str, list[str]]:
        async with openai.AsyncOpenAI(base_url=base_url(server), api_key="x") as c:
            models = await c.models.list()
            r = await c.chat.completions.create(
                model="default", messages=CHAT, max_tokens=6, temperature=0
            )
            streamed = []
            async for chunk in await c.chat.completions.create(
                model="default", messages=CHAT, max_tokens=6, temperature=0, stream=True
            ):
                streamed.append(chunk.choices[0].delta.content or "")
            assert "".join(streamed) == r.choices[0].message.content
            return r.choices[0].message.content or "", [m.id for m in models.data]

    _, ids = asyncio.run(run())
    assert server.server is not None and ids == ["default", server.server.engine.info.model_id]


def test_response_format_and_tools(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False},
    }
    r = client.chat.completions.create(
        model="default",
        messages=CHAT,
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
    tool = {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "the weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 6}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    r = client.chat.completions.create(
        model="default",
        messages=CHAT,
        max_tokens=120,
        temperature=0,
        tools=[tool],
        tool_choice="required",
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "weather"  # type: ignore[union-attr]
    assert set(json.loads(call.function.arguments)) == {"city"}  # type: ignore[union-attr]
    chunks = list(
        client.chat.completions.create(
            model="default",
            messages=CHAT,
            max_tokens=120,
            temperature=0,
            tools=[tool],
            tool_choice={"type": "function", "function": {"name": "weather"}},
            stream=True,
        )
    )
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    streamed = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    # the call streams as OpenAI streams one: its name first, then its arguments in pieces
    assert {tc.index for tc in streamed} == {0}
    assert [tc.function.name for tc in streamed if tc.function.name] == ["weather"]  # type: ignore[union-attr]
    arguments = "".join(tc.function.arguments or "" for tc in streamed)  # type: ignore[union-attr]
    assert json.loads(arguments) == json.loads(call.function.arguments)  # type: ignore[union-attr]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    with pytest.raises(openai.BadRequestError) as err:
        bad = {**tool, "function": {**tool["function"], "parameters": {"type": "nope"}}}
        client.chat.completions.create(model="default", messages=CHAT, tools=[bad])  # type: ignore[list-item]
    assert err.value.body["param"] == "tools[0].function.parameters"  # type: ignore[index]


def test_sessions_keep_the_kv_between_turns(server: ServerThread) -> None:
    url = base_url(server)
    if True:
        _, session = call(server, "POST", "/v1/sessions", {"metadata": {"user": "u1"}})
        sid = session["id"]
        assert session["object"] == "session" and session["metadata"] == {"user": "u1"}
        with openai.OpenAI(base_url=url, api_key="x", default_headers={"X-Session-Id": sid}) as c:
            messages = [{"role": "user", "content": "First question"}]
            one = c.chat.completions.create(
                model="default", messages=messages, max_tokens=8, temperature=0
            )
            assert one.usage is not None
            # The OpenAI habit: the whole conversation again, plus the new message.
            messages += [
                {"role": "assistant", "content": one.choices[0].message.content},
                {"role": "user", "content": "Second"},
            ]
            two = c.chat.completions.create(
                model="default", messages=messages, max_tokens=8, temperature=0
            )
            assert two.usage is not None and two.usage.prompt_tokens_details is not None
            turn_one = one.usage.prompt_tokens + one.usage.completion_tokens
            assert two.usage.prompt_tokens_details.cached_tokens >= turn_one
            # README's way to make one with the SDK alone.
            other = c.post("/sessions", body={}, cast_to=dict)["id"]
            assert call(server, "DELETE", f"/v1/sessions/{other}")[0] == 200
        assert call(server, "GET", f"/v1/sessions/{sid}")[1]["turns"] == 2
        resent = {"messages": [*CHAT, {"role": "assistant", "content": "ok"}]}
        status, body = call(server, "POST", "/v1/chat/completions", resent, x_session_id=sid)
        assert status == 400 and body["error"]["param"] == "messages"
        assert call(server, "DELETE", f"/v1/sessions/{sid}")[1]["deleted"] is True
        status, gone = call(server, "GET", f"/v1/sessions/{sid}")
        assert status == 404 and gone["error"]["type"] == "not_found_error"
        body = {"model": "default", "messages": CHAT}
        assert call(server, "POST", "/v1/chat/completions", body, x_session_id=sid)[0] == 404


def test_curl_streams_server_sent_events(server: ServerThread) -> None:
    curl = require_tool("curl")
    body = {"model": "default", "prompt": "abc", "max_tokens": 5, "temperature": 0, "stream": True}
    out = subprocess.run(
        [curl, "-sS", "-N", "--max-time", "60", "-H", "Content-Type: application/json",
         "-d", json.dumps(body), f"{base_url(server)}/completions"],
        capture_output=True, text=True, timeout=90, check=True,
    ).stdout  # fmt: skip
    events = [line[len("data: ") :] for line in out.splitlines() if line.startswith("data: ")]
    assert events, out
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    headers = subprocess.run(
        [curl, "-sS", "-N", "-D", "-", "-o", "/dev/null", "--max-time", "60",
         "-H", "Content-Type: application/json", "-H", "X-Request-Id: curl-1",
         "-d", json.dumps(body), f"{base_url(server)}/completions"],
        capture_output=True, text=True, timeout=90, check=True,
    ).stdout.lower()  # fmt: skip
    assert "content-type: text/event-stream" in headers and "x-request-id: curl-1" in headers
    health = subprocess.run(
        [curl, "-s", "-o", "/dev/null", "-w", "%{http_code}",
         f"http://127.0.0.1:{server.server.http_port}/health"],  # type: ignore[union-attr]
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    assert health == "200"
    metrics = subprocess.run(
        [curl, "-sS", f"http://127.0.0.1:{server.server.http_port}/metrics"],  # type: ignore[union-attr]
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    assert 'genai_rpc_requests_total{code="OK",rpc="Completions"}' in metrics


def test_client_disconnect_aborts_the_engine_request(long_context_model_dir: Path) -> None:
    srv = start(long_context_model_dir)
    try:
        body = {
            "model": "default",
            "prompt": "x",
            "max_tokens": 3000,
            "ignore_eos": True,
            "stream": True,
        }
        assert srv.server is not None
        engine = srv.server.engine
        conn = http.client.HTTPConnection("127.0.0.1", srv.server.http_port, timeout=60)
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"}
        )
        response = conn.getresponse()
        events = 0
        for _ in range(30):  # chunked: size lines and event lines
            events += response.fp.readline().startswith(b"data: ")
            if events == 3:
                break
        assert events == 3
        conn.sock.close()  # type: ignore[union-attr]
        conn.close()
        for _ in range(100):  # the abort reaches the engine at its next step
            stats = srv.run(engine.stats())
            if stats.get("requests_aborted", 0) == 1 and stats["running"] == 0:
                break
            time.sleep(0.05)
        assert stats.get("requests_aborted", 0) == 1 and stats["running"] == 0
        assert srv.server.frontend.inflight == 0
    finally:
        srv.stop()


def test_bearer_tokens_and_draining(tiny_model_dir: Path) -> None:
    srv = start(tiny_model_dir, auth_tokens=((TOKEN, "alice"), ("other-token", "bob")))
    try:
        url = base_url(srv)
        with openai.OpenAI(base_url=url, api_key="wrong", max_retries=0) as c:
            with pytest.raises(openai.AuthenticationError) as err:
                c.models.list()
            assert err.value.status_code == 401
        status, body = call(srv, "GET", "/v1/models")  # no token at all
        assert status == 401 and body["error"]["type"] == "authentication_error"
        alice = f"Bearer {TOKEN}"
        sid = call(srv, "POST", "/v1/sessions", authorization=alice)[1]["id"]
        bob = {"authorization": "Bearer other-token", "x_session_id": sid}
        status, body = call(
            srv, "POST", "/v1/completions", {"model": "default", "prompt": "a"}, **bob
        )
        assert status == 403 and body["error"]["type"] == "permission_error"
        assert call(srv, "DELETE", f"/v1/sessions/{sid}", **bob)[0] == 403
        with openai.OpenAI(base_url=url, api_key=TOKEN, max_retries=0) as c:
            r = c.completions.create(model="default", prompt="ab", max_tokens=3)
            assert r.usage is not None and r.usage.completion_tokens == 3
        # The gRPC plane takes the same token.
        with Client(srv.target, token=TOKEN) as g:
            assert g.generate("ab", max_new_tokens=3).usage.completion_tokens == 3
        srv.server.frontend.draining = True  # type: ignore[union-attr]
        assert call(srv, "GET", "/health")[0] == 503
        status, body = call(srv, "POST", "/v1/completions", {"prompt": "a"}, authorization=alice)
        assert status == 503 and body["error"]["code"] == "unavailable"
        srv.server.frontend.draining = False  # type: ignore[union-attr]
    finally:
        srv.stop()


def test_unknown_routes_bad_bodies_and_methods_answer_in_openai_shape(server: ServerThread) -> None:
    status, body = call(server, "GET", "/v1/nope")
    assert status == 404 and body["error"]["type"] == "not_found_error"
    status, body = call(server, "GET", "/v1/chat/completions")
    assert status == 405 and body["error"]["type"] == "invalid_request_error"
    status, body = call(server, "POST", "/v1/completions", ["not", "an", "object"])
    assert status == 400 and body["error"]["param"] == "body"
    status, body = call(server, "POST", "/v1/completions", {"prompt": "a", "stop": [1]})
    assert status == 400 and body["error"]["param"] == "stop"
    # The engine's own checks, named by the JSON field the client sent.
    status, body = call(server, "POST", "/v1/completions", {"prompt": "a", "stop": ["x"] * 99})
    assert status == 400 and body["error"]["param"] == "stop", body
    status, body = call(server, "POST", "/v1/completions", {"prompt": "a", "logprobs": 6})
    assert status == 400 and body["error"]["param"] == "logprobs"


def test_sigterm_drains_the_http_plane_too(long_context_model_dir: Path, tmp_path: Path) -> None:
    """The real `genai-server --http-port`: SIGTERM mid-stream; the SSE stream
    completes while /health and new calls answer 503; exit 0, JSON logs only."""
    import signal
    import sys

    port, http_port = free_port(), free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "genai_service", "--model", str(long_context_model_dir),
             "--port", str(port), "--http-port", str(http_port), "--log-format", "json",
             "--grace-period", "20"],
            stdout=log_file, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def get(path: str) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=5)
        try:
            conn.request("GET", path)
            return conn.getresponse().status
        finally:
            conn.close()

    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if get("/health") == 200:
                    break
            except OSError:
                pass
            time.sleep(0.1)
        conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=60)
        body = {"prompt": "the cat", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"}
        )
        response = conn.getresponse()
        assert response.readline().startswith(b"data: ")
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while get("/health") == 200 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert get("/health") == 503 and get("/v1/models") == 503
        assert proc.poll() is None
        events = [line for line in response if line.startswith(b"data: ")]
        assert events[-1] == b"data: [DONE]\n"
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
        conn.close()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = log_path.read_text().splitlines()
    assert all(line.startswith("{") for line in lines), lines
    records = [json.loads(line) for line in lines]
    assert "http_listening" in [r["event"] for r in records]
    assert "stopped" in [r["event"] for r in records]


def test_a_chunked_body_is_bounded_while_it_is_read(bytes_models: dict[str, Path]) -> None:
    """No Content-Length to check first: the gateway stops reading past the limit."""
    srv = start(bytes_models["rope"], max_message_bytes=64 * 1024)
    try:
        assert srv.server is not None
        conn = http.client.HTTPConnection("127.0.0.1", srv.server.http_port, timeout=60)
        piece = b"x" * 16_384
        body = (piece for _ in range(64))  # 1 MiB, sent chunked
        conn.request(
            "POST", "/v1/completions", body, {"content-type": "application/json"},
            encode_chunked=True,
        )  # fmt: skip
        response = conn.getresponse()
        answer = json.loads(response.read())
        assert response.status == 400 and answer["error"]["param"] == "body", answer
        assert "at most 65536" in answer["error"]["message"]
    finally:
        srv.stop()


def test_truncate_prompt_tokens_over_http_and_grpc(server: ServerThread) -> None:
    prompt = "abcdefghijklmnopqrstuvwxyz" * 2  # one token per byte: 52 tokens
    status, body = call(
        server,
        "POST",
        "/v1/completions",
        {
            "model": "default",
            "prompt": prompt,
            "max_tokens": 4,
            "temperature": 0,
            "truncate_prompt_tokens": 12,
        },
    )
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == 12
    # the same cut through gRPC: the kept tokens are the first 4 and the last 8
    with Client(server.target) as client:
        cut = client.generate(prompt, max_new_tokens=4, temperature=0, truncate_prompt_tokens=12)
        kept = client.generate(prompt[:4] + prompt[-8:], max_new_tokens=4, temperature=0)
    assert cut.usage.dropped_tokens == 40 and cut.usage.prompt_tokens == 12
    assert cut.token_ids == kept.token_ids
    assert body["choices"][0]["text"] == cut.text
    status, body = call(
        server,
        "POST",
        "/v1/completions",
        {"model": "default", "prompt": "x", "truncate_prompt_tokens": 0},
    )
    assert status == 400 and body["error"]["param"] == "truncate_prompt_tokens"


def test_client_errors_that_were_500s_are_400s(server: ServerThread) -> None:
    assert server.server is not None
    cases = [
        (
            '{"model": "default", "messages": [{"role": "user", "content": "\\ud800"}]}',
            "messages[0].content",
            "/v1/chat/completions",
        ),
        (
            '{"model": "default", "prompt": "x", "stop": ["ok", "\\udfff"]}',
            "stop[1]",
            "/v1/completions",
        ),
        ('{"model": "default", "prompt": "x", "top_k": 1099511627776}', "top_k", "/v1/completions"),
        ('{"model": "default", "prompt": [8589934592]}', "prompt", "/v1/completions"),
    ]
    for raw, param, path in cases:
        conn = http.client.HTTPConnection("127.0.0.1", server.server.http_port, timeout=60)
        try:
            conn.request("POST", path, raw, {"content-type": "application/json"})
            response = conn.getresponse()
            status, body = response.status, json.loads(response.read())
        finally:
            conn.close()
        assert status == 400, (raw, body)
        assert body["error"]["param"] == param, (raw, body)


def test_a_huge_max_tokens_is_named_with_its_own_value(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="default", prompt="x", max_tokens=10**12)
    assert err.value.body["message"] == (  # type: ignore[index]
        "max_tokens: 1000000000000 is out of range; allowed [1, 4294967295]"
    )


def test_logit_bias_and_the_extra_samplers_over_http_and_grpc(
    client: openai.OpenAI, server: ServerThread
) -> None:
    with Client(server.target) as grpc:
        x = grpc.tokenize("x", add_special_tokens=False)[0].id
        # OpenAI's logit_bias (token ids as keys): +100 forces the token.
        r = client.completions.create(
            model="default", prompt="abc", max_tokens=5, temperature=0, logit_bias={str(x): 100}
        )
        assert r.choices[0].text == "xxxxx"
        chat = client.chat.completions.create(
            model="default", messages=CHAT, max_tokens=3, temperature=0.9, seed=3,
            logit_bias={str(x): 100},
        )  # fmt: skip
        assert chat.choices[0].message.content == "xxx"
        # llama.cpp's and vLLM's extras, as extra body fields: the same tokens as
        # the same fields through gRPC.
        extras = {
            "typical_p": 0.9,
            "top_a": 0.1,
            "xtc_probability": 0.5,
            "xtc_threshold": 0.05,
            "dry_multiplier": 0.8,
            "dry_sequence_breakers": ["\n"],
            "mirostat": 2,
            "mirostat_tau": 4.0,
            "repetition_penalty_last_n": 16,
            "banned_token_ids": [x],
            "bad_words": ["ab"],
        }
        r = client.completions.create(
            model="default", prompt="abc", max_tokens=12, temperature=1.0, seed=5, extra_body=extras
        )
        same = grpc.generate(
            "abc", max_new_tokens=12, temperature=1.0, seed=5, ignore_eos=False, **extras
        )
        assert r.choices[0].text == same.text
        assert "x" not in same.text
    for body, param, message in [
        ({"logit_bias": {"x": 1}}, "logit_bias", 'logit_bias: key "x" is not a token id'),
        ({"logit_bias": {"3": 101}}, "logit_bias[3]", "logit_bias[3]: 101.0 is out of range"),
        ({"mirostat": 1}, "mirostat", "mirostat: 1 is not a known value (Mirostat v1"),
        ({"typical_p": 0}, "typical_p", "typical_p: 0.0 is out of range; allowed (0, 1]"),
        ({"bad_words": "ab"}, "bad_words", 'bad_words: "ab" is not an array'),
        ({"banned_token_ids": [-1]}, "banned_token_ids[0]", "banned_token_ids[0]: -1 is not a"),
    ]:
        status, answer = call(
            server, "POST", "/v1/completions", {"model": "default", "prompt": "a", **body}
        )
        assert status == 400, (body, answer)
        assert answer["error"]["message"].startswith(message), answer
        assert answer["error"]["param"] == param, answer


def test_prompt_logprobs_over_grpc_and_echo_over_http(
    client: openai.OpenAI, server: ServerThread
) -> None:
    prompt = "hello world"
    with Client(server.target) as grpc:
        whole = grpc.generate(prompt, max_new_tokens=4, temperature=0, prompt_logprobs=2)
        ids = [t.id for t in grpc.tokenize(prompt)]
        assert [lp.token_id for lp in whole.prompt_logprobs] == ids[1:]
        assert all(len(lp.top) == 2 and lp.logprob <= 0 for lp in whole.prompt_logprobs)
        with grpc.stream(prompt, max_new_tokens=4, temperature=0, prompt_logprobs=2) as stream:
            deltas = list(stream)
        assert deltas[0].prompt_logprobs == whole.prompt_logprobs
        assert all(not d.prompt_logprobs for d in deltas[1:])
        assert stream.result.prompt_logprobs == whole.prompt_logprobs
    r = client.completions.create(
        model="default", prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=1
    )
    choice = r.choices[0]
    assert choice.text == prompt + whole.text
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # type: ignore[index]
    n = len(whole.prompt_logprobs)
    assert lp.token_logprobs[1 : n + 1] == pytest.approx([p.logprob for p in whole.prompt_logprobs])
    assert len(lp.tokens) == len(ids) + r.usage.completion_tokens  # type: ignore[union-attr]
    # echo without logprobs: the text only; streamed: the prompt leads the first chunk
    plain = client.completions.create(
        model="default", prompt=prompt, max_tokens=4, temperature=0, echo=True
    )
    assert plain.choices[0].text == prompt + whole.text
    chunks = list(
        client.completions.create(
            model="default", prompt=prompt, max_tokens=4, temperature=0, echo=True, stream=True
        )
    )
    assert chunks[0].choices[0].text.startswith(prompt)
    assert "".join(c.choices[0].text for c in chunks) == prompt + whole.text
    # vLLM's prompt_logprobs field
    status, body = call(
        server,
        "POST",
        "/v1/completions",
        {
            "model": "default",
            "prompt": prompt,
            "max_tokens": 2,
            "temperature": 0,
            "prompt_logprobs": 1,
        },
    )
    assert status == 200, body
    entries = body["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    first = whole.prompt_logprobs[0]
    assert entries[1][str(first.token_id)]["logprob"] == pytest.approx(first.logprob)


def test_several_completions_over_grpc_and_http(
    client: openai.OpenAI, server: ServerThread
) -> None:
    with Client(server.target) as grpc:
        whole = grpc.generate("Once", max_new_tokens=6, temperature=1.0, seed=11, n=3)
        assert [c.index for c in whole.completions] == [0, 1, 2]
        assert whole.text == whole.completions[0].text
        for c in whole.completions:
            alone = grpc.generate("Once", max_new_tokens=6, temperature=1.0, seed=11 + c.index)
            assert (c.text, c.token_ids) == (alone.text, alone.token_ids)
        with grpc.stream("Once", max_new_tokens=6, temperature=1.0, seed=11, n=3) as stream:
            deltas = list(stream)
        assert {d.index for d in deltas} == {0, 1, 2}
        assert stream.result.completions == whole.completions
        assert stream.result.usage.completion_tokens == whole.usage.completion_tokens == 18
    r = client.completions.create(
        model="default", prompt="Once", max_tokens=6, temperature=1.0, seed=11, n=3
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [c.text for c in whole.completions]
    chat = client.chat.completions.create(
        model="default", messages=CHAT, max_tokens=5, temperature=1.0, seed=2, n=2
    )
    assert [c.index for c in chat.choices] == [0, 1]
    chunks = list(
        client.chat.completions.create(
            model="default", messages=CHAT, max_tokens=5, temperature=1.0, seed=2, n=2, stream=True
        )
    )
    streamed = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == {c.index: c.message.content for c in chat.choices}
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert len(finishes) == 2
    best = client.completions.create(
        model="default", prompt="Once", max_tokens=6, temperature=1.0, seed=11, n=1, best_of=3
    )
    assert len(best.choices) == 1 and best.usage.completion_tokens == 18  # type: ignore[union-attr]
    status, body = call(
        server, "POST", "/v1/completions", {"model": "default", "prompt": "a", "n": 17}
    )
    assert status == 400 and body["error"]["param"] == "n"
