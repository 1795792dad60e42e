"""Bearer tokens, session ownership and TLS/mTLS on the control plane (docs/design.md, "Security")."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from genai_client import (
    Client,
    NotFoundError,
    PermissionDeniedError,
    UnauthenticatedError,
    UnavailableError,
)
from genai_proto.genai.v1 import session_pb2
from genai_service.config import EngineConfig
from tests.server_harness import ServerThread, free_port, secure_config

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, pki: Path) -> Iterator[ServerThread]:
    config = secure_config(
        EngineConfig(model_dir=str(tiny_model_dir)),
        pki,
        (("alice-token", "alice"), ("bob-token", "bob")),
    )
    srv = ServerThread(config).start()
    yield srv
    srv.stop()


def client(
    server: ServerThread, pki: Path, token: str | None, *, client_cert: bool = True
) -> Client:
    return Client(
        server.target,
        tls=True,
        root_certificates=(pki / "ca.pem").read_bytes(),
        private_key=(pki / "client.key").read_bytes() if client_cert else None,
        certificate_chain=(pki / "client.pem").read_bytes() if client_cert else None,
        token=token,
    )


def test_tokens_are_required_and_checked(server: ServerThread, pki: Path) -> None:
    for token in (None, "wrong"):
        with client(server, pki, token) as c, pytest.raises(UnauthenticatedError, match="Bearer"):
            c.generate("hello", max_new_tokens=2)
        with client(server, pki, token) as c, pytest.raises(UnauthenticatedError):
            list(c.stream("hello", max_new_tokens=2))
    with client(server, pki, "alice-token") as c:
        assert len(c.generate("hello", max_new_tokens=2, ignore_eos=True).token_ids) == 2
    # health stays open to probes (over the same mTLS channel, without a token)
    creds = grpc.ssl_channel_credentials(
        (pki / "ca.pem").read_bytes(),
        (pki / "client.key").read_bytes(),
        (pki / "client.pem").read_bytes(),
    )
    with grpc.secure_channel(server.target, creds) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest()).status
        assert status == health_pb2.HealthCheckResponse.SERVING


def test_sessions_belong_to_their_principal(server: ServerThread, pki: Path) -> None:
    with client(server, pki, "alice-token") as alice, client(server, pki, "bob-token") as bob:
        sid = alice.create_session().session_id
        alice.generate("hello", session_id=sid, max_new_tokens=2)
        with pytest.raises(PermissionDeniedError, match="another principal"):
            bob.get_session(sid)
        with pytest.raises(PermissionDeniedError):
            bob.generate("hello", session_id=sid, max_new_tokens=2)
        with pytest.raises(PermissionDeniedError):
            bob.close_session(sid)
        assert sid in {s.session_id for s in alice.list_sessions()}
        assert sid not in {s.session_id for s in bob.list_sessions()}
        with pytest.raises(NotFoundError):
            bob.get_session("f" * 32)
        alice.close_session(sid)


def test_session_pages_list_only_the_callers_sessions(server: ServerThread, pki: Path) -> None:
    with client(server, pki, "alice-token") as alice, client(server, pki, "bob-token") as bob:
        mine = [alice.create_session(metadata={"n": str(i)}).session_id for i in range(3)]
        theirs = [bob.create_session().session_id for _ in range(2)]
        try:
            # one session a page: the client follows next_page_token to the end
            assert [s.session_id for s in alice.list_sessions(page_size=1)] == mine
            assert [s.session_id for s in bob.list_sessions(page_size=1)] == theirs
            # alice's token for the next page only moves bob's listing along:
            # a page never holds another principal's session
            first = alice._sessions.ListSessions(
                session_pb2.ListSessionsRequest(page_size=1), metadata=alice._metadata
            )
            assert [s.session_id for s in first.sessions] == mine[:1] and first.next_page_token
            page = bob._sessions.ListSessions(
                session_pb2.ListSessionsRequest(page_token=first.next_page_token),
                metadata=bob._metadata,
            )
            assert {s.session_id for s in page.sessions} <= set(theirs)
        finally:
            for sid in mine:
                alice.close_session(sid)
            for sid in theirs:
                bob.close_session(sid)


def test_mtls_requires_a_client_certificate(server: ServerThread, pki: Path) -> None:
    with (
        client(server, pki, "alice-token", client_cert=False) as c,
        pytest.raises(UnavailableError),
    ):
        c.generate("hello", max_new_tokens=2, timeout=5)


@pytest.mark.parametrize("binary", ["genai_service", "kvstore"])
def test_a_key_that_is_not_the_certificates_says_so(
    binary: str, tiny_model_dir: Path, pki: Path
) -> None:
    """Issue 31: a TLS key that does not match its certificate made both servers
    exit saying "Failed to bind to address"; now they name the two files."""
    args = [sys.executable, "-m", binary, "--port", str(free_port())]
    args += ["--tls-cert-file", str(pki / "server.pem"), "--tls-key-file", str(pki / "client.key")]
    if binary == "genai_service":
        args += ["--model", str(tiny_model_dir)]
    else:
        args += ["--insecure"]
    run = subprocess.run(args, capture_output=True, text=True, timeout=120)
    out = run.stdout + run.stderr
    assert run.returncode != 0
    assert "Failed to bind" not in out
    assert f"tls_key_file {pki / 'client.key'} is not the private key of the certificate" in out
    assert str(pki / "server.pem") in out
