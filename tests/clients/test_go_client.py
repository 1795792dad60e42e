"""The Go client (clients/go) against a live server on the tiny model.

``make go-client`` generates the Go stubs and builds, vets and gofmt-checks
the module in GOPATH mode; then ``go test`` runs clients/go/genai's tests
with GENAI_TARGET naming a server started here, over mTLS with a bearer
token (so the client's TLS, client-certificate and token options are all
used). Go's output is shown on failure.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from genai_service.config import CacheConfig, EngineConfig, SchedulerConfig, ServerConfig
from tests.conftest import require_tool
from tests.server_harness import ServerThread, free_port, secure_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
GO_MODULE = "github.com/genai-grpc/genai-grpc/clients/go"
TOKEN = "go-client-token"


@pytest.fixture(scope="module")
def server(long_context_model_dir: Path, pki: Path) -> Iterator[ServerThread]:
    engine = EngineConfig(
        model_dir=str(long_context_model_dir),
        cache=CacheConfig(chunk_size=4),
        scheduler=SchedulerConfig(max_num_seqs=4, max_queue=8),
    )
    srv = ServerThread(secure_config(engine, pki, ((TOKEN, "go-tests"),))).start()
    yield srv
    srv.stop()


def _run(
    args: list[str], env: dict[str, str], cwd: Path, timeout: float
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"{' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    )
    return result


def test_go_client_against_a_live_server(server: ServerThread, pki: Path) -> None:
    for tool in ("go", "gofmt", "protoc", "protoc-gen-go", "protoc-gen-go-grpc", "make"):
        require_tool(tool)
    env = dict(os.environ)
    _run(["make", "go-client"], env, ROOT, timeout=300)
    assert server.server is not None
    before = server.run(server.server.engine.stats()).get("requests_aborted", 0)
    env.update(
        GO111MODULE="off",
        GOFLAGS="",
        GOPATH=f"{ROOT / 'build' / 'gopath'}:/usr/share/gocode",
        GENAI_TARGET=server.target,
        GENAI_CA=str(pki / "ca.pem"),
        GENAI_CERT=str(pki / "client.pem"),
        GENAI_KEY=str(pki / "client.key"),
        GENAI_TOKEN=TOKEN,
    )
    package_dir = ROOT / "build" / "gopath" / "src" / GO_MODULE  # the module path's link
    env["PWD"] = str(package_dir)  # so that go sees the import path, not the link's target
    _run(["go", "test", "-count=1", "-v", "./..."], env, package_dir, timeout=300)
    # The example CLI streams a prompt to stdout.
    token_file = pki / "go-token"
    token_file.write_text(TOKEN + "\n")
    cli = ["go", "run", "./cmd/genai-go", "-target", server.target, "-ca", env["GENAI_CA"]]
    cli += ["-cert", env["GENAI_CERT"], "-key", env["GENAI_KEY"], "-token-file", str(token_file)]
    out = _run([*cli, "-max-new-tokens", "5", "the", "cat"], env, package_dir, timeout=300)
    assert out.stdout.strip() and "finish_reason=MAX_TOKENS" in out.stderr, out
    # The cancelled stream (and the cancelled bidi request) were aborted on the
    # server and freed what they held.
    for _ in range(100):
        stats = server.run(server.server.engine.stats())
        if stats["running"] == 0 and stats["waiting"] == 0:
            break
        time.sleep(0.05)
    assert stats["running"] == 0 and stats["waiting"] == 0, stats
    assert stats.get("requests_aborted", 0) - before >= 1, stats


def test_the_readmes_quick_start_runs_as_written(long_context_model_dir: Path) -> None:
    """Issue 30: clients/go/README.md's quick start, as written (its target
    swapped for a plaintext server's), as the body of a main package that
    imports the client the way another GOPATH project does."""
    import re
    import shutil

    for tool in ("go", "protoc", "protoc-gen-go", "protoc-gen-go-grpc", "make"):
        require_tool(tool)
    readme = (ROOT / "clients" / "go" / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1]
    block = re.search(r"```go\n(.*?)```", quick, re.S)
    assert block, "no go block under Quick start"
    engine = EngineConfig(model_dir=str(long_context_model_dir))
    srv = ServerThread(ServerConfig(engine=engine, port=free_port())).start()
    app = ROOT / "build" / "gopath" / "src" / "genai-readme-quickstart"
    try:
        env = dict(os.environ)
        _run(["make", "go-client"], env, ROOT, timeout=300)
        body = block.group(1).replace('"localhost:50051"', f'"{srv.target}"')
        app.mkdir(parents=True, exist_ok=True)
        (app / "main.go").write_text(
            'package main\n\nimport (\n\t"context"\n\t"fmt"\n\t"log"\n\n'
            f'\t"{GO_MODULE}/genai"\n)\n\nfunc main() {{\n\tctx := context.Background()\n'
            + "".join(f"\t{line}\n" if line else "\n" for line in body.splitlines())
            + "}\n"
        )
        env.update(
            GO111MODULE="off", GOFLAGS="", GOPATH=f"{ROOT / 'build' / 'gopath'}:/usr/share/gocode"
        )
        env["PWD"] = str(app)
        out = _run(["go", "run", "."], env, app, timeout=300)
        assert "MAX_TOKENS" in out.stdout or "EOS_TOKEN" in out.stdout, out.stdout
    finally:
        srv.stop()
        shutil.rmtree(app, ignore_errors=True)
