"""CONTEXT_OVERFLOW_SLIDE over gRPC, HTTP, the Python client and the CLI (a real
server on the 16-position tiny model, whose plain-op graph recomputes the kept
tokens): exact tokens past the window, the session's setting echoed and its
dropped count, and every new field's errors with their codes and messages."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from genai_client import Client
from genai_client.cli import main as cli_main
from genai_proto.genai.v1 import (
    common_pb2,
    generate_pb2,
    generate_pb2_grpc,
    session_pb2,
    session_pb2_grpc,
)
from genai_service.config import CacheConfig, ContextConfig, EngineConfig, ServerConfig
from genai_service.engine.kv.window import SlidePolicy
from tests.engine.test_context_slide import recompute
from tests.server_harness import ServerThread, free_port
from tests.tiny_model import encode_words

PROMPT = encode_words("the cat sat on the mat")
POLICY = SlidePolicy.make(16, 4, None, 4)


@pytest.fixture(scope="module")
def server(short_context_model_dir: Path) -> Iterator[ServerThread]:
    config = ServerConfig(
        engine=EngineConfig(
            model_dir=str(short_context_model_dir),
            cache=CacheConfig(chunk_size=4),
            context=ContextConfig(),  # the default stays "error"
        ),
        port=free_port(),
        http_port=0,
        auth_tokens=(("alice-token", "alice"),),
    )
    srv = ServerThread(config).start()
    yield srv
    srv.stop()


@pytest.fixture()
def alice(server: ServerThread) -> Iterator[Client]:
    with Client(server.target, token="alice-token") as c:
        yield c


METADATA = (("authorization", "Bearer alice-token"),)


def test_grpc_a_request_slides_and_a_session_keeps_its_setting(
    server: ServerThread, short_context_model_dir: Path
) -> None:
    with grpc.insecure_channel(server.target) as channel:
        gen = generate_pb2_grpc.GenerateServiceStub(channel)
        sessions = session_pb2_grpc.SessionServiceStub(channel)
        request = generate_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(ids=PROMPT),
            stopping=generate_pb2.StoppingCriteria(max_new_tokens=40, ignore_eos=True),
            context_overflow=common_pb2.CONTEXT_OVERFLOW_SLIDE,
        )
        reply = gen.Generate(request, metadata=METADATA, timeout=60)
        assert reply.finish_reason == common_pb2.FINISH_REASON_MAX_TOKENS
        ctx = list(PROMPT)
        assert list(reply.token_ids) == recompute(short_context_model_dir, POLICY, ctx, 40)
        assert reply.usage.dropped_tokens == len(PROMPT) + 40 - len(ctx)
        # the server's default: stop at the window
        request.ClearField("context_overflow")
        reply = gen.Generate(request, metadata=METADATA, timeout=60)
        assert reply.finish_reason == common_pb2.FINISH_REASON_CONTEXT_LENGTH
        # a session's setting is its turns' default, echoed in Session
        created = sessions.CreateSession(
            session_pb2.CreateSessionRequest(context_overflow=common_pb2.CONTEXT_OVERFLOW_SLIDE),
            metadata=METADATA,
        ).session
        assert created.context_overflow == common_pb2.CONTEXT_OVERFLOW_SLIDE
        for ids in (PROMPT, PROMPT, PROMPT):
            turn = generate_pb2.GenerateRequest(
                token_ids=common_pb2.TokenIds(ids=ids),
                session_id=created.session_id,
                stopping=generate_pb2.StoppingCriteria(max_new_tokens=5, ignore_eos=True),
            )
            reply = gen.Generate(turn, metadata=METADATA, timeout=60)
            assert reply.finish_reason == common_pb2.FINISH_REASON_MAX_TOKENS
        got = sessions.GetSession(
            session_pb2.GetSessionRequest(session_id=created.session_id), metadata=METADATA
        ).session
        assert got.dropped_tokens > 0 and got.history_tokens < 16 and got.turns == 3
        plain = sessions.CreateSession(session_pb2.CreateSessionRequest(), metadata=METADATA)
        assert plain.session.context_overflow == common_pb2.CONTEXT_OVERFLOW_ERROR
        # an unknown enum value names the field
        for call, message in (
            (lambda: gen.Generate(generate_pb2.GenerateRequest(
                token_ids=common_pb2.TokenIds(ids=PROMPT), context_overflow=7  # type: ignore[arg-type]
            ), metadata=METADATA, timeout=60), None),
            (lambda: sessions.CreateSession(
                session_pb2.CreateSessionRequest(context_overflow=7),  # type: ignore[arg-type]
                metadata=METADATA,
            ), None),
        ):  # fmt: skip
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == (
                "context_overflow: 7 is not a known value; allowed CONTEXT_OVERFLOW_ERROR, "
                "CONTEXT_OVERFLOW_SLIDE (or unset)"
            ), message


def http_post(
    server: ServerThread, path: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    assert server.server is not None
    conn = http.client.HTTPConnection("127.0.0.1", server.server.http_port, timeout=60)
    try:
        conn.request(
            "POST",
            path,
            json.dumps(body).encode(),
            {
                "content-type": "application/json",
                "authorization": "Bearer alice-token",
                **(headers or {}),
            },
        )
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_http_the_header_the_body_field_and_sessions(
    server: ServerThread, short_context_model_dir: Path
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 40, "ignore_eos": True, "temperature": 0}
    status, reply = http_post(server, "/v1/completions", body, {"X-Context-Overflow": "slide"})
    assert status == 200, reply
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == 40
    ctx = list(PROMPT)
    recompute(short_context_model_dir, POLICY, ctx, 40)
    assert reply["usage"]["dropped_tokens"] == len(PROMPT) + 40 - len(ctx)
    # the body field wins over the header
    status, reply = http_post(
        server,
        "/v1/completions",
        {**body, "context_overflow": "error"},
        {"X-Context-Overflow": "slide"},
    )
    assert status == 200 and reply["usage"]["completion_tokens"] == 16 - len(PROMPT)
    for headers, extra, message in (
        ({"X-Context-Overflow": "sideways"}, {}, "X-Context-Overflow: 'sideways' is not allowed; allowed 'error', 'slide'"),
        ({}, {"context_overflow": "up"}, "context_overflow: 'up' is not allowed; allowed 'error', 'slide'"),
        ({}, {"context_overflow": 2}, "context_overflow: 2 is not a string"),
    ):  # fmt: skip
        status, reply = http_post(server, "/v1/completions", {**body, **extra}, headers)
        assert status == 400 and reply["error"]["message"] == message, reply
    status, session = http_post(server, "/v1/sessions", {"context_overflow": "slide"})
    assert status == 200 and session["context_overflow"] == "slide", session
    assert session["dropped_tokens"] == 0
    status, reply = http_post(server, "/v1/sessions", {"context_overflow": "never"})
    assert status == 400
    assert reply["error"]["message"] == (
        "context_overflow: 'never' is not allowed; allowed 'error', 'slide'"
    )


def test_the_python_client_and_the_cli(
    server: ServerThread, alice: Client, capsys: pytest.CaptureFixture[str]
) -> None:
    result = alice.generate(
        token_ids=PROMPT, max_new_tokens=30, ignore_eos=True, context_overflow="slide"
    )
    assert len(result.token_ids) == 30 and result.usage.dropped_tokens > 0
    with alice.session(context_overflow="slide") as chat:
        for _ in range(3):
            chat.generate(token_ids=PROMPT, max_new_tokens=5, ignore_eos=True)
        info = chat.info()
        assert info.context_overflow == "slide" and info.dropped_tokens > 0
    with pytest.raises(ValueError, match="context_overflow 'up' is not one of"):
        alice.generate(token_ids=PROMPT, context_overflow="up")
    base = ["--target", server.target, "--token", "alice-token"]
    assert cli_main([*base, "session", "create", "--context-overflow", "slide"]) == 0
    created = json.loads(capsys.readouterr().out)
    assert created["context_overflow"] == "slide" and created["dropped_tokens"] == 0
