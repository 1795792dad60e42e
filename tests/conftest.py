"""Shared fixtures: tiny models built once per test session (a few ms each)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.tiny_model import GQA_SPEC, TinyModelSpec, build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny model: plain attention, RoPE, genai_config.json, 128 context."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelSpec())


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Variants the runners must all handle: plain/GQA attention, RoPE/learned positions."""
    specs = {
        "rope": TinyModelSpec(),
        "learned": TinyModelSpec(positions="learned", config="inference_metadata"),
        "gqa": GQA_SPEC,
        "gqa-learned": dataclasses.replace(GQA_SPEC, positions="learned", config="none"),
    }
    return {name: build_tiny_model(tmp_path_factory.mktemp(name), s) for name, s in specs.items()}


@pytest.fixture(scope="session")
def static_cache_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny model's weights (so tiny_model_dir's tokens) behind
    onnx-genai's static-cache I/O (TensorScatter + Attention-24, Mobius's export)."""
    spec = TinyModelSpec(attention="static_cache", config="inference_metadata")
    return build_tiny_model(tmp_path_factory.mktemp("static-cache"), spec)


@pytest.fixture(scope="session")
def bytes_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The "bytes" tokenizer (one token per byte, which llguidance can read), 2,048
    positions (a tool preamble alone is ~700 bytes); plain attention and GQA
    (the shared-buffer runner)."""
    specs = {
        "rope": TinyModelSpec(tokenizer="bytes", max_seq_len=2048),
        "gqa": dataclasses.replace(GQA_SPEC, tokenizer="bytes", max_seq_len=2048),
    }
    return {
        name: build_tiny_model(tmp_path_factory.mktemp(f"bytes-{name}"), s)
        for name, s in specs.items()
    }


@pytest.fixture(scope="session")
def fim_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny word model with <fim_prefix>, <fim_middle>, <fim_suffix>, <fim_pad>."""
    return build_tiny_model(tmp_path_factory.mktemp("fim"), TinyModelSpec(fim=True))


@pytest.fixture(scope="session")
def short_context_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """max_sequence_length 16, declared in inference_metadata.yaml."""
    spec = TinyModelSpec(max_seq_len=16, config="inference_metadata")
    return build_tiny_model(tmp_path_factory.mktemp("short"), spec)


@pytest.fixture(scope="session")
def long_context_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4,096 positions: room for generations that outlast a deadline or a cancel."""
    return build_tiny_model(tmp_path_factory.mktemp("long"), TinyModelSpec(max_seq_len=4096))


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The real default model (SmolLM2-135M-Instruct, int8), converted once into the user cache."""
    from genai_service.convert.default_model import resolve_model

    return resolve_model("default", progress=False)


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate (openssl CLI),
    for TLS and mTLS on either plane: ca.pem, server.pem/.key, client.pem/.key."""
    d = tmp_path_factory.mktemp("pki")
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=test-ca",
        cwd=d,
    )
    for name, ext in (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
            cwd=d,
        )
        (d / f"{name}.ext").write_text(ext + "\n")
        openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "1",
            "-extfile",
            f"{name}.ext",
            cwd=d,
        )
    return d


def require_tool(name: str) -> str:
    """The path of a system tool a test needs (``make system-deps`` installs it).

    Without it the test skips on a developer machine, and fails under CI=true,
    where a missing tool is a broken set-up rather than a reason to test less.
    """
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed (make system-deps)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path
