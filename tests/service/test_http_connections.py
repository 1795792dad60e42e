"""What a slow, silent or greedy HTTP client may hold on ``--http-port``
(issue 31, item 5): headers, body and idle keep-alive each have a deadline,
and the number of open connections is bounded, while other clients are served."""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from genai_service.config import EngineConfig, ServerConfig
from tests.server_harness import ServerThread, free_port

HEADER_S, BODY_S, IDLE_S, MAX_CONNECTIONS = 1.0, 1.0, 0.5, 12


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerThread]:
    config = ServerConfig(
        engine=EngineConfig(model_dir=str(tiny_model_dir)),
        port=free_port(),
        http_port=0,
        http_header_timeout_s=HEADER_S,
        http_body_timeout_s=BODY_S,
        http_idle_timeout_s=IDLE_S,
        http_max_connections=MAX_CONNECTIONS,
    )
    srv = ServerThread(config).start()
    yield srv
    srv.stop()


def port(server: ServerThread) -> int:
    assert server.server is not None and server.server.http_port is not None
    return server.server.http_port


def connect(server: ServerThread) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port(server)), timeout=10)
    s.settimeout(10)
    return s


def read_until_closed(s: socket.socket, limit_s: float = 10.0) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and when it closed."""
    started, data = time.monotonic(), b""
    while time.monotonic() - started < limit_s:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data, time.monotonic() - started


def status_and_error(data: bytes) -> tuple[int, dict]:
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def health(server: ServerThread) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port(server), timeout=10)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    finally:
        conn.close()


def refused(server: ServerThread, reason: str) -> float:
    assert server.server is not None
    counter = server.server.frontend.metrics.http_refused.labels(reason)
    return counter._value.get()


def test_a_silent_connection_is_closed_at_the_header_deadline(server: ServerThread) -> None:
    before = refused(server, "header_timeout")
    with connect(server) as s:
        data, took = read_until_closed(s)
    status, error = status_and_error(data)
    assert status == 408 and "--http-header-timeout-s" in error["message"]
    assert HEADER_S * 0.9 <= took < HEADER_S + 5
    assert refused(server, "header_timeout") == before + 1


def test_headers_sent_a_byte_at_a_time_do_not_extend_the_deadline(server: ServerThread) -> None:
    request = b"GET /health HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 200
    with connect(server) as s:
        s.settimeout(0.2)
        started, closed = time.monotonic(), False
        for byte in request:  # 0.1 s apart: 20 s in all if the server waited
            try:
                s.sendall(bytes([byte]))
                if s.recv(65536) == b"":
                    closed = True
                    break
            except TimeoutError:
                pass
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            time.sleep(0.1)
        took = time.monotonic() - started
    assert closed and took < HEADER_S + 5


def test_a_body_that_stalls_is_408_and_others_are_served_meanwhile(server: ServerThread) -> None:
    body = json.dumps({"prompt": "a", "max_tokens": 2}).encode()
    with connect(server) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body[:5]
        )
        assert health(server) == 200  # the stalled body holds nothing up
        data, took = read_until_closed(s)
    status, error = status_and_error(data)
    assert status == 408 and error["code"] == "deadline_exceeded"
    assert "--http-body-timeout-s" in error["message"] and error["message"].startswith(
        "body: 5 bytes"
    )
    assert took < BODY_S + 5


def test_an_idle_keep_alive_connection_is_closed(server: ServerThread) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port(server), timeout=10)
    try:
        conn.request("GET", "/health")
        response = conn.getresponse()
        assert response.status == 200 and response.read() == b'{"status":"ok"}'
        assert conn.sock is not None  # kept alive
        data, took = read_until_closed(conn.sock)
    finally:
        conn.close()
    assert data == b"" and took < IDLE_S + 5


def test_connections_beyond_the_bound_are_503_and_the_slot_comes_back(
    server: ServerThread,
) -> None:
    held = [connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)  # all accepted
        with connect(server) as extra:
            data, _ = read_until_closed(extra)
        status, error = status_and_error(data)
        assert status == 503 and "--http-max-connections" in error["message"]
        held.pop().close()
        time.sleep(0.2)
        assert health(server) == 200
    finally:
        for s in held:
            s.close()


def test_a_hundred_slow_clients_are_all_closed_while_one_is_served(server: ServerThread) -> None:
    """The issue's attack, scaled to the bound: more dribbling and silent
    connections than it allows; within the header deadline every one is closed
    and the port serves a normal client again."""
    opened = []
    for i in range(100):
        try:
            s = connect(server)
            if i % 2:
                s.sendall(b"GET / HTTP/1.1\r\n")
            opened.append(s)
        except OSError:
            pass
    try:
        deadline = time.monotonic() + HEADER_S + 10
        open_ones = list(opened)
        while open_ones and time.monotonic() < deadline:
            for s in list(open_ones):
                s.settimeout(0.05)
                try:
                    if s.recv(65536) == b"":
                        open_ones.remove(s)
                except TimeoutError:
                    pass
                except OSError:
                    open_ones.remove(s)
        assert open_ones == []
        assert health(server) == 200
    finally:
        for s in opened:
            s.close()


def test_a_body_sent_after_an_early_answer_leaves_no_stray_408(server: ServerThread) -> None:
    """A response that goes out before the request's body is all in (a 404
    here; a 401 or an oversized body alike): the rest of the body must not
    start a header deadline that later writes a 408 nobody asked for. The
    connection, idle again, closes with nothing more sent."""
    with connect(server) as s:
        s.sendall(b"POST /nowhere HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n12345")
        head = s.recv(65536)
        assert head.startswith(b"HTTP/1.1 404"), head
        time.sleep(0.2)
        s.sendall(b"67890")  # the body's last bytes, after the answer
        data, took = read_until_closed(s)
    assert b"408" not in data, data
    assert took < HEADER_S + 5
