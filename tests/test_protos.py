"""The protos are the product's public face: lint them, and check the names clients rely on."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from genai_proto.genai.v1 import generate_pb2, model_pb2, session_pb2
from genai_proto.kvstore.v1 import kvstore_pb2

ROOT = Path(__file__).resolve().parents[1]


def test_buf_lint_is_clean() -> None:
    buf = shutil.which("buf", path=str(Path(sys.executable).parent)) or shutil.which("buf")
    if buf is None:
        pytest.fail("buf is not installed (it comes with the dev extra: buf-bin)")
    result = subprocess.run(
        [buf, "lint"], cwd=ROOT / "protos", capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_public_names_of_the_design() -> None:
    services = {
        "GenerateService": (generate_pb2, {"Generate", "GenerateStream", "GenerateBidi"}),
        "SessionService": (
            session_pb2,
            {"CreateSession", "GetSession", "ResetSession", "CloseSession", "ListSessions"},
        ),
        "ModelService": (model_pb2, {"GetModelInfo", "Tokenize", "Detokenize"}),
    }
    for name, (module, methods) in services.items():
        service = module.DESCRIPTOR.services_by_name[name]
        assert service.full_name == f"genai.v1.{name}"
        assert {m.name for m in service.methods} == methods
    kv = kvstore_pb2.DESCRIPTOR.services_by_name["KvStore"]
    assert kv.full_name == "kvstore.v1.KvStore"
    assert {m.name for m in kv.methods} == {"Lookup", "Get", "Put", "Delete", "Stats"}
    request = generate_pb2.GenerateRequest.DESCRIPTOR.fields_by_name
    for field in (
        "request_id",
        "text",
        "token_ids",
        "messages",
        "session_id",
        "sampling",
        "stopping",
        "top_logprobs",
        "priority",
        "add_special_tokens",
    ):
        assert field in request, field
