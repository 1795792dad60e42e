"""The data plane closed by default (docs/design.md, "Processes and planes"): genai-kvstore and
genai-server refuse to run without a data-plane token unless told ``--insecure`` /
``--kvstore-insecure``, and genai-stack (``make serve``) gives its pair a random one."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from genai_service.__main__ import build_parser, config_from_args
from genai_service.__main__ import main as server_main
from kvstore.client import KvStoreClient
from kvstore.protocol import AUTH_TOKEN_ENV
from kvstore.server import KvStoreConfig
from tests.server_harness import free_port

KVSTORE = (sys.executable, "-m", "kvstore")
KEY = b"\x01" * 16  # a well-formed chunk key


def _env(**extra: str) -> dict[str, str]:
    """This process's environment without a data-plane token, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != AUTH_TOKEN_ENV}
    return {**env, **extra}


def _rpcs(client: KvStoreClient) -> dict[str, Callable[[], object]]:
    return {
        "Put": lambda: client.put(KEY, b"forged"),
        "Get": lambda: client.get(KEY),
        "Lookup": lambda: client.lookup([KEY]),
        "Delete": lambda: client.delete(KEY),
        "Stats": lambda: client.stats(),
    }


def _assert_unauthenticated(target: str, token: str | None) -> None:
    with KvStoreClient(target, auth_token=token, timeout_s=10) as client:
        for name, call in _rpcs(client).items():
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, name  # type: ignore[attr-defined]


class _Kvstore:
    """``python -m kvstore --port 0 ARGS`` with its JSON log read up to "kvstore serving"."""

    def __init__(self, *args: str, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [*KVSTORE, "--port", "0", "--log-format", "json", *args],
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.events: list[dict[str, Any]] = []
        assert self.proc.stderr is not None
        for _ in range(50):  # bounded: the lines logged before "kvstore serving"
            line = self.proc.stderr.readline()
            if not line:
                break
            self.events.append(json.loads(line))
            if self.events[-1]["event"] == "kvstore serving":
                self.target = f"127.0.0.1:{self.events[-1]['port']}"
                return
        self.close()
        raise RuntimeError(f"kvstore did not start: {self.events}")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=15)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


@pytest.fixture
def kvstore_cli() -> Iterator[Callable[..., _Kvstore]]:
    started: list[_Kvstore] = []

    def _start(*args: str, env: dict[str, str]) -> _Kvstore:
        started.append(_Kvstore(*args, env=env))
        return started[-1]

    yield _start
    for kv in started:
        kv.close()


def test_kvstore_config_needs_a_token_or_insecure() -> None:
    with pytest.raises(ValueError, match=r"auth_token .*--auth-token-file.*--insecure"):
        KvStoreConfig()
    assert KvStoreConfig(insecure=True).auth_token is None
    assert KvStoreConfig(auth_token="t").insecure is False
    with pytest.raises(ValueError, match="exclude each other"):
        KvStoreConfig(auth_token="t", insecure=True)
    with pytest.raises(ValueError, match="go together"):
        KvStoreConfig(auth_token="t", tls_cert_file="cert.pem")
    with pytest.raises(ValueError, match="mTLS"):
        KvStoreConfig(auth_token="t", tls_client_ca_file="ca.pem")


def test_kvstore_cli_without_a_token_or_insecure_exits_2(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        command = [*KVSTORE, "--port", "0", "--log-format", "console", *args]
        return subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=60)

    refused = run()
    assert refused.returncode == 2
    for option in ("--auth-token-file", AUTH_TOKEN_ENV, "--auth-token", "--insecure"):
        assert option in refused.stderr, option
    (tmp_path / "blank").write_text(" \n")
    blank = run("--auth-token-file", str(tmp_path / "blank"))
    assert blank.returncode == 2 and "--auth-token-file" in blank.stderr and "empty" in blank.stderr
    missing = run("--auth-token-file", str(tmp_path / "missing"))
    assert missing.returncode == 2 and "missing" in missing.stderr
    both = run("--insecure", "--auth-token", "t")
    assert both.returncode == 2 and "not allowed with" in both.stderr


@pytest.mark.e2e
def test_kvstore_with_a_token_file_refuses_anonymous_and_wrong_tokens(
    kvstore_cli: Callable[..., _Kvstore], tmp_path: Path
) -> None:
    (tmp_path / "token").write_text("file-token\n")  # as a mounted Secret: trailing newline
    kv = kvstore_cli("--auth-token-file", str(tmp_path / "token"), env=_env())
    for token in (None, "wrong", "file-toke"):
        _assert_unauthenticated(kv.target, token)
    with KvStoreClient(kv.target, auth_token="file-token", timeout_s=10) as client:
        assert client.put(KEY, b"chunk").stored_in_memory
        assert client.get(KEY) == b"chunk"
    assert kv.stop() == 0


@pytest.mark.e2e
def test_insecure_kvstore_serves_anonymous_clients_and_says_so(
    kvstore_cli: Callable[..., _Kvstore],
) -> None:
    kv = kvstore_cli("--insecure", env=_env(**{AUTH_TOKEN_ENV: "ignored-with-insecure"}))
    warnings = [e for e in kv.events if e["level"] == "warning"]
    assert [e["event"] for e in warnings] == [
        "kvstore is insecure: KvStore RPCs need no token, so any client that can "
        "connect may read and overwrite KV chunks and session records"
    ]
    assert kv.events[-1]["auth"] is False
    with KvStoreClient(kv.target, timeout_s=10) as client:
        assert client.put(KEY, b"chunk").stored_in_memory
        assert client.get(KEY) == b"chunk"
        assert client.delete(KEY)
    assert kv.stop() == 0


def test_server_needs_a_kvstore_token_or_kvstore_insecure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)
    base = ["--model", str(tmp_path), "--kvstore", "127.0.0.1:50052"]

    def kvstore(*flags: str) -> Any:
        return config_from_args(build_parser().parse_args([*base, *flags])).engine.kvstore

    with pytest.raises(ValueError, match=r"--kvstore-auth-token-file.*--kvstore-insecure"):
        kvstore()
    assert server_main(base) == 2
    insecure = kvstore("--kvstore-insecure")
    assert (insecure.auth_token, insecure.insecure) == (None, True)
    (tmp_path / "token").write_text("  file-token\n")
    assert kvstore("--kvstore-auth-token-file", str(tmp_path / "token")).auth_token == "file-token"
    with pytest.raises(ValueError, match="exclude each other"):
        kvstore("--kvstore-auth-token-file", str(tmp_path / "token"), "--kvstore-insecure")
    monkeypatch.setenv(AUTH_TOKEN_ENV, "env-token")
    assert kvstore().auth_token == "env-token"
    tls = kvstore(
        "--kvstore-tls-ca", "ca.pem", "--kvstore-tls-cert", "c.pem", "--kvstore-tls-key", "k"
    )
    assert (tls.tls_ca_file, tls.tls_cert_file, tls.tls_key_file) == ("ca.pem", "c.pem", "k")
    with pytest.raises(ValueError, match="needs tls_ca_file"):
        kvstore("--kvstore-tls-cert", "c.pem", "--kvstore-tls-key", "k")
    monkeypatch.delenv(AUTH_TOKEN_ENV)
    no_kvstore = build_parser().parse_args(["--model", str(tmp_path)])
    assert config_from_args(no_kvstore).engine.kvstore is None


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


@pytest.mark.e2e
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc (Linux)")
def test_genai_stack_kvstore_refuses_anonymous_puts(
    long_context_model_dir: Path, tmp_path: Path
) -> None:
    """What ``make serve`` starts: the kvstore answers UNAUTHENTICATED to a client
    without the pair's token, which is random and never on a command line."""
    port, kv_port = free_port(), free_port()
    command = [
        sys.executable, "-m", "genai_service.launcher",
        "--model", str(long_context_model_dir),
        "--port", str(port),
        "--kvstore-port", str(kv_port),
        "--prompt", "hello",
        "--start-timeout", "120",
    ]  # fmt: skip
    log = (tmp_path / "stack.log").open("wb")
    stack = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, env=_env())
    children: list[int] = []
    try:
        assert stack.stdout is not None
        for _ in range(20):  # bounded: the launcher prints two lines before this one
            line = stack.stdout.readline()
            assert line, f"genai-stack exited: {(tmp_path / 'stack.log').read_text()[-2000:]}"
            if line.startswith("serving on"):
                break
        children = _children(stack.pid)
        assert len(children) == 2
        target = f"127.0.0.1:{kv_port}"
        _assert_unauthenticated(target, None)
        _assert_unauthenticated(target, "guessed-token")
        tokens = {_environ(pid)[AUTH_TOKEN_ENV] for pid in children}
        assert len(tokens) == 1, "both children get the same token"
        (token,) = tokens
        assert len(token) >= 43  # secrets.token_urlsafe(32)
        for pid in children:
            assert token not in Path(f"/proc/{pid}/cmdline").read_text(), "token in argv"
        with KvStoreClient(target, auth_token=token, timeout_s=10) as client:
            assert client.stats().memory.capacity_bytes == 1 << 30
        stack.send_signal(signal.SIGTERM)
        assert stack.wait(timeout=60) == 0  # after stopping (and reaping) both children
    finally:
        if stack.poll() is None:
            stack.kill()
            stack.wait(timeout=10)
            for pid in children:  # orphaned by the kill: never leave one behind
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if stack.stdout is not None:
            stack.stdout.close()
        log.close()
