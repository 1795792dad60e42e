"""RewindSession and ForkSession over gRPC, HTTP, the Python client and the CLI
(a real server on the tiny "words" model, two principals): exact tokens after a
rewind and in a fork, the errors with their codes and messages."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from genai_client import Client, InvalidArgumentError, PermissionDeniedError
from genai_client.cli import main as cli_main
from genai_proto.genai.v1 import session_pb2, session_pb2_grpc
from genai_service.config import CacheConfig, EngineConfig, ServerConfig
from tests.server_harness import ServerThread, free_port
from tests.tiny_model import encode_words, reference_greedy

T1 = encode_words("hello , who are you ?")
T2 = encode_words("what is the time now ?")
T3 = encode_words("the cat sat on the mat")


@pytest.fixture(scope="module")
def server(long_context_model_dir: Path) -> Iterator[ServerThread]:
    config = ServerConfig(
        engine=EngineConfig(model_dir=str(long_context_model_dir), cache=CacheConfig(chunk_size=4)),
        port=free_port(),
        http_port=0,
        auth_tokens=(("alice-token", "alice"), ("bob-token", "bob")),
    )
    srv = ServerThread(config).start()
    yield srv
    srv.stop()


@pytest.fixture()
def alice(server: ServerThread) -> Iterator[Client]:
    with Client(server.target, token="alice-token") as c:
        yield c


def turn(client: Client, sid: str, ids: list[int], n: int = 5) -> list[int]:
    result = client.generate(
        token_ids=ids, session_id=sid, max_new_tokens=n, ignore_eos=True, temperature=0
    )
    return list(result.token_ids)


def test_rewind_then_a_turn_and_a_fork_answer_as_their_history_alone(
    alice: Client, long_context_model_dir: Path
) -> None:
    with alice.session() as chat:
        history1 = T1 + turn(alice, chat.id, T1)
        history2 = history1 + T2 + turn(alice, chat.id, T2)
        with chat.fork(metadata={"branch": "b"}) as fork:
            assert fork.info().history_tokens == len(history2)
            assert fork.info().metadata == {"branch": "b"}
            info = chat.rewind(turns=1)
            assert (info.turns, info.history_tokens) == (1, len(history1))
            assert turn(alice, chat.id, T3) == reference_greedy(
                long_context_model_dir, history1 + T3, 5
            )
            # the fork kept the history the parent had when it was made
            result = alice.generate(
                token_ids=T3, session_id=fork.id, max_new_tokens=5, ignore_eos=True, temperature=0
            )
            assert list(result.token_ids) == reference_greedy(
                long_context_model_dir, history2 + T3, 5
            )
            assert result.usage.cached_tokens == len(history2)  # its KV came with it
        cut = chat.rewind(history_tokens=3)
        assert (cut.history_tokens, cut.turns) == (3, 0)
        first = alice.fork_session(chat.id, turns=0)
        assert first.history_tokens == 0
        alice.close_session(first.session_id)


def test_errors_name_the_field_and_the_limit(server: ServerThread, alice: Client) -> None:
    sid = alice.create_session().session_id
    turn(alice, sid, T1)
    with pytest.raises(InvalidArgumentError) as err:
        alice.rewind_session(sid, turns=3)
    assert err.value.details == "turns: 3 is past the end; the session has 1 turns"
    with pytest.raises(InvalidArgumentError) as err:
        alice.fork_session(sid, turns=2)
    assert err.value.details == "turns: 2 is past the end; the session has 1 turns"
    with pytest.raises(InvalidArgumentError) as err:
        alice.fork_session(sid, metadata={"k" * 300: "v"})
    assert err.value.details.startswith("metadata: key ")
    stub = session_pb2_grpc.SessionServiceStub(server.channel())
    auth = (("authorization", "Bearer alice-token"),)
    with pytest.raises(grpc.RpcError) as rpc:
        stub.RewindSession(session_pb2.RewindSessionRequest(session_id=sid), metadata=auth)
    assert rpc.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert rpc.value.details() == "target: set turns or history_tokens"
    with pytest.raises(grpc.RpcError) as rpc:
        stub.ForkSession(
            session_pb2.ForkSessionRequest(session_id=sid, idle_ttl_seconds=0), metadata=auth
        )
    assert rpc.value.details() == "idle_ttl_seconds: 0 is out of range; allowed [1, 4294967295]"
    with Client(server.target, token="bob-token") as bob:
        with pytest.raises(PermissionDeniedError):
            bob.rewind_session(sid, turns=0)
        with pytest.raises(PermissionDeniedError):
            bob.fork_session(sid)
    assert alice.get_session(sid).turns == 1  # untouched


def post(server: ServerThread, path: str, body: Any, token: str = "alice-token") -> tuple[int, Any]:
    assert server.server is not None
    conn = http.client.HTTPConnection("127.0.0.1", server.server.http_port, timeout=60)
    try:
        conn.request(
            "POST",
            path,
            json.dumps(body).encode(),
            {"content-type": "application/json", "authorization": f"Bearer {token}"},
        )
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_rewind_and_fork_over_http(server: ServerThread, alice: Client) -> None:
    sid = alice.create_session().session_id
    history = len(T1) + len(turn(alice, sid, T1))
    turn(alice, sid, T2)
    status, fork = post(server, f"/v1/sessions/{sid}:fork", {"turns": 1, "metadata": {"a": "b"}})
    assert status == 200, fork
    assert (fork["history_tokens"], fork["turns"], fork["metadata"]) == (history, 1, {"a": "b"})
    status, body = post(server, f"/v1/sessions/{sid}:rewind", {"turns": 1})
    assert status == 200 and body["history_tokens"] == history and body["id"] == sid
    for payload, message in (
        ({}, "body: give one of turns and history_tokens"),
        ({"turns": 1, "history_tokens": 2}, "body: give one of turns and history_tokens"),
        ({"turns": -1}, "turns: -1 is out of range; allowed [0, 4294967295]"),
        ({"frobnicate": 1}, "frobnicate: unknown field"),
        ({"turns": None}, "turns: must be a number"),
        ({"turns": 9}, "turns: 9 is past the end; the session has 1 turns"),
    ):
        status, body = post(server, f"/v1/sessions/{sid}:rewind", payload)
        assert status == 400 and body["error"]["message"] == message, (payload, body)
    status, body = post(server, f"/v1/sessions/{sid}:fork", {}, token="bob-token")
    assert status == 403, body


def test_cli_rewind_fork_and_the_chat_commands(
    server: ServerThread,
    alice: Client,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = ["--target", server.target, "--token", "alice-token"]
    sid = alice.create_session().session_id
    turn(alice, sid, T1)
    turn(alice, sid, T2)
    assert cli_main([*base, "session", "fork", sid, "--turns", "1"]) == 0
    forked = json.loads(capsys.readouterr().out)
    assert forked["turns"] == 1 and forked["session_id"] != sid
    assert cli_main([*base, "session", "rewind", sid, "--turns", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["turns"] == 1
    # In a chat: a turn, /undo (back to where it was), /fork (a copy continues).
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("hi\n/undo\n/fork\nyo\n/exit\n"))
    assert cli_main([*base, "chat", "--session", sid, "--max-new-tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert "(back to turn 1)" in err and "(now in session " in err
    assert alice.get_session(sid).turns == 1  # the turn after /fork ran in the fork
    fork_id = err.split("(now in session ")[1].split(";")[0]
    assert alice.get_session(fork_id).turns == 2
