"""The Node/TypeScript client (clients/node/) against a live server on a tiny model.

Builds the package as a user would (``npm ci``, types generated from protos/ by
``npm run generate`` with Debian's ``protoc``, ``tsc``), then runs its
``node --test`` suite: the unit tests (field and enum round-trip, metadata,
error details) and the live tests, which reach the server started here through
``GENAI_TARGET`` (streaming, a two-turn session reusing KV, cancellation through
an AbortSignal, a bad request as a typed error naming the field, bidi), and a
second server with mutual TLS and a bearer token through ``GENAI_SECURE_TARGET``.
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

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "clients" / "node"


def run(args: list[str], timeout_s: float, env: dict[str, str] | None = None) -> str:
    """Run a step in clients/node; a failure shows its whole output."""
    done = subprocess.run(
        args,
        cwd=PACKAGE,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{' '.join(args)} exited {done.returncode}:\n{output}"
    return output


@pytest.fixture(scope="module")
def built() -> None:
    for tool in ("node", "npm", "protoc"):
        require_tool(tool)
    assert (ROOT / "protos/google/rpc/status.proto").is_file(), "committed: google.rpc.Status"
    run(["npm", "ci", "--no-audit", "--no-fund"], timeout_s=300)
    run(["npm", "run", "build"], timeout_s=180)


@pytest.fixture(scope="module")
def server(long_context_model_dir: Path) -> Iterator[ServerThread]:
    # 4,096 positions: a stream long enough to be cancelled mid-way; 4-token
    # chunks so that a short session turn is reused from the prefix cache.
    engine = EngineConfig(
        model_dir=str(long_context_model_dir),
        cache=CacheConfig(chunk_size=4),
        scheduler=SchedulerConfig(max_num_seqs=4, max_queue=8),
    )
    srv = ServerThread(ServerConfig(engine=engine, port=free_port())).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def secure_server(tiny_model_dir: Path, pki: Path) -> Iterator[ServerThread]:
    config = secure_config(
        EngineConfig(model_dir=str(tiny_model_dir)), pki, (("node-token", "ada"),)
    )
    srv = ServerThread(config).start()
    yield srv
    srv.stop()


def test_node_client_against_a_live_server(
    built: None, server: ServerThread, secure_server: ServerThread, pki: Path
) -> None:
    env = {
        "GENAI_TARGET": server.target,
        "GENAI_SECURE_TARGET": secure_server.target,
        "GENAI_PKI_DIR": str(pki),
        "GENAI_TOKEN": "node-token",
    }
    output = run(["npm", "test"], timeout_s=180, env=env)
    # every test ran (none skipped for a missing target) and passed
    assert "# fail 0" in output and "# skipped 0" in output, output
    assert "# pass 11" in output, output
    # The aborted stream, the aborted unary call and the bidi request cancelled
    # mid-way each aborted their engine request (docs/design.md, "Status codes").
    assert server.server is not None
    for _ in range(100):
        stats = server.run(server.server.engine.stats())
        if stats.get("requests_aborted", 0) >= 3 and stats["running"] == 0:
            break
        time.sleep(0.05)
    assert stats.get("requests_aborted", 0) >= 3 and stats["running"] == 0, stats


def test_the_readmes_quick_start_runs_as_written(
    built: None, server: ServerThread, tmp_path: Path
) -> None:
    """Issue 30: the README's quick start, as written (its target swapped for
    this server's), compiled by the package's own tsc and run by node in a
    project that depends on the package as the README says (by path)."""
    import re

    readme = (PACKAGE / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1]
    code = re.search(r"```ts\n(.*?)```", quick, re.S)
    assert code, "no ts block under Quick start"
    source = code.group(1).replace('"127.0.0.1:50051"', f'"{server.target}"')
    project = tmp_path / "app"
    (project / "node_modules" / "@genai-grpc").mkdir(parents=True)
    (project / "node_modules" / "@genai-grpc" / "client").symlink_to(PACKAGE)
    (project / "package.json").write_text('{"name": "app", "type": "module", "private": true}\n')
    (project / "quickstart.mts").write_text(source)
    tsc = PACKAGE / "node_modules" / ".bin" / "tsc"
    compile_args = [str(tsc), "--module", "nodenext", "--moduleResolution", "nodenext"]
    compile_args += ["--target", "es2022", "--skipLibCheck", "--types", "node"]
    compile_args += ["--typeRoots", str(PACKAGE / "node_modules" / "@types"), "quickstart.mts"]
    env = {**os.environ, "NODE_PATH": str(PACKAGE / "node_modules")}
    for args in (compile_args, ["node", "quickstart.mjs"]):
        done = subprocess.run(
            args, cwd=project, env=env, capture_output=True, text=True, timeout=180
        )
        assert done.returncode == 0, f"{args[0]}: {done.stdout}{done.stderr}"
    out = done.stdout
    assert "MAX_TOKENS" in out or "EOS_TOKEN" in out, out  # the first answer's finish reason
    assert "sampling.temperature" in out, out  # the typed error's field violation
