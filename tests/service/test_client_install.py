"""The Python client installs without the server's dependencies and streams from a live server.

``pip install <checkout>`` (no extra) into a fresh venv must bring grpcio and
protobuf only: no onnxruntime, onnx or gguf (the servers' ``server`` extra).
The generated stubs (``genai_proto``, git-ignored build output of ``make
stubs``) go into the wheel because they are on disk and listed in the
packages. Then that venv's ``genai`` CLI streams from a real server on the
tiny model (README, "Python client only").
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from genai_service.config import EngineConfig, ServerConfig
from tests.server_harness import ServerThread, free_port

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
# Left out of the copy: build output and caches, not sources (genai_proto stays).
IGNORED = shutil.ignore_patterns(
    ".git",
    ".venv",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".*_cache",
    ".hypothesis",
    "results",
    "node_modules",
)
SERVER_ONLY = ("onnxruntime", "onnx", "gguf", "numpy", "tokenizers", "structlog")


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding ``pip install <a copy of the checkout>``."""
    assert (ROOT / "genai_proto" / "genai" / "v1" / "generate_pb2.py").is_file(), "make stubs"
    tmp = tmp_path_factory.mktemp("client-install")
    source = tmp / "src"
    # A copy, so the build's build/ and *.egg-info never land in the checkout.
    shutil.copytree(ROOT, source, ignore=IGNORED)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "--quiet", str(source)],
        check=True,
        timeout=600,
    )
    return venv


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerThread]:
    srv = ServerThread(
        ServerConfig(engine=EngineConfig(model_dir=str(tiny_model_dir)), port=free_port())
    ).start()
    yield srv
    srv.stop()


def test_the_client_install_has_no_server_dependencies(client_venv: Path) -> None:
    python = str(client_venv / "bin" / "python")
    installed = subprocess.run(
        [python, "-m", "pip", "list", "--format=freeze"],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout.lower()
    names = {line.split("==")[0].replace("_", "-") for line in installed.splitlines()}
    assert {"grpcio", "protobuf", "genai-grpc"} <= names
    assert not names & set(SERVER_ONLY), names
    for module in ("onnxruntime", "onnx", "gguf"):
        probe = subprocess.run([python, "-c", f"import {module}"], capture_output=True, timeout=60)
        assert probe.returncode != 0, module
    # The client, its stubs and the shared module import in it.
    subprocess.run(
        [
            python,
            "-c",
            "import genai_client, genai_common.errors, genai_proto.kvstore.v1.kvstore_pb2",
        ],
        check=True,
        timeout=60,
        cwd=client_venv,  # not the checkout: only what was installed
    )


def test_the_installed_cli_streams_from_a_live_server(
    client_venv: Path, server: ServerThread
) -> None:
    done = subprocess.run(
        [
            str(client_venv / "bin" / "genai"),
            "--target",
            server.target,
            "--timeout",
            "60",
            "generate",
            "the cat",
            "--max-new-tokens",
            "4",
            "--ignore-eos",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=client_venv,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), done.stderr
