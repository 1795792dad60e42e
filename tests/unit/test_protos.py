"""The protos are the product's public face: lint them, and check the names clients rely on."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from genai_proto.genai.v1 import generate_pb2, model_pb2, session_pb2
from genai_proto.kvstore.v1 import kvstore_pb2
from tests.buf_breaking import breaking_changes, changes_since

ROOT = Path(__file__).resolve().parents[2]


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
            {
                "CreateSession",
                "GetSession",
                "ResetSession",
                "RewindSession",
                "ForkSession",
                "CloseSession",
                "ListSessions",
            },
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


GO_MODULE = "github.com/genai-grpc/genai-grpc/clients/go/gen"  # the module in clients/go


def test_every_proto_has_the_go_package_of_its_directory() -> None:
    # protoc-gen-go refuses a file without go_package (protos/buf.yaml says what the path is).
    ours = [p for d in ("genai", "kvstore") for p in (ROOT / "protos" / d).rglob("*.proto")]
    for path in sorted(ours):  # (protos/google/ is google.rpc.Status, Google's names)
        package_dir = path.parent.relative_to(ROOT / "protos")  # genai/v1, kvstore/v1
        want = f"{GO_MODULE}/{package_dir};{package_dir.parts[0]}{package_dir.parts[1]}"
        assert f'option go_package = "{want}";' in path.read_text(), path


def _has_parent_commit() -> bool:
    if shutil.which("git") is None:
        return False
    probe = subprocess.run(
        ["git", "rev-parse", "--verify", "--quiet", "HEAD~1"], cwd=ROOT, capture_output=True
    )
    return probe.returncode == 0


@pytest.mark.skipif(not _has_parent_commit(), reason="not a git checkout with a parent commit")
def test_no_breaking_change_against_the_commit_before() -> None:
    assert changes_since("HEAD~1") == []


def test_buf_breaking_catches_a_changed_go_package_and_a_renumbered_field(
    tmp_path: Path,
) -> None:
    changed = tmp_path / "protos"
    shutil.copytree(ROOT / "protos", changed)
    kv = changed / "kvstore" / "v1" / "kvstore.proto"
    kv.write_text(
        kv.read_text().replace("clients/go/gen/kvstore/v1;kvstorev1", "elsewhere;kvstorev1")
    )
    common = changed / "genai" / "v1" / "common.proto"
    common.write_text(
        common.read_text().replace("uint32 prompt_tokens = 1;", "uint32 prompt_tokens = 9;")
    )
    generate = changed / "genai" / "v1" / "generate.proto"
    generate.write_text(
        generate.read_text().replace("google.rpc.Status error = 4;", "string error = 4;")
    )
    found = {v["type"] for v in breaking_changes(str(ROOT / "protos"), changed)}
    # (the one allowed FIELD_SAME_TYPE is ErrorStatus -> google.rpc.Status, not this)
    assert found == {"FILE_SAME_GO_PACKAGE", "FIELD_NO_DELETE", "FIELD_SAME_TYPE"}


def test_the_one_allowed_go_package_move() -> None:
    # gen/go/... named a Go module that never existed; clients/go/gen/... is the real one.
    from tests.buf_breaking import _allowed

    def moved(old: str, new: str) -> dict[str, str]:
        message = f'File option "go_package" changed from "{old}" to "{new}".'
        return {"type": "FILE_SAME_GO_PACKAGE", "message": message}

    base = "github.com/genai-grpc/genai-grpc"
    ok = moved(f"{base}/gen/go/genai/v1;genaiv1", f"{base}/clients/go/gen/genai/v1;genaiv1")
    assert _allowed(ok)
    assert not _allowed(
        moved(f"{base}/gen/go/genai/v1;genaiv1", f"{base}/clients/go/gen/kvstore/v1;kvstorev1")
    )
    assert not _allowed(
        moved(f"{base}/clients/go/gen/genai/v1;genaiv1", f"{base}/elsewhere/genai/v1;genaiv1")
    )


def test_protos_load_on_their_own(tmp_path: Path) -> None:
    """Issue 30: a fresh checkout's protos/ could not be loaded by protoc,
    grpcurl or proto-loader (google/rpc/status.proto was copied there by
    `make stubs` only). With protos/ alone (plus the well-known types every
    protoc ships) every file compiles."""
    from grpc_tools import protoc

    files = sorted(str(p.relative_to(ROOT / "protos")) for p in (ROOT / "protos").rglob("*.proto"))
    assert "google/rpc/status.proto" in files
    tracked = subprocess.run(
        ["git", "ls-files", "protos/google/rpc/status.proto"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    if tracked.returncode == 0:  # a git checkout: the file is committed, not build output
        assert tracked.stdout.strip() == "protos/google/rpc/status.proto"
    well_known = Path(protoc.__file__).parent / "_proto"
    out = tmp_path / "descriptors.pb"
    code = protoc.main(
        ["protoc", f"-I{ROOT / 'protos'}", f"-I{well_known}", f"--descriptor_set_out={out}", *files]
    )
    assert code == 0 and out.stat().st_size > 0
