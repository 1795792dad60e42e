"""``buf breaking`` of protos/ against a git commit (``make lint``, tests/unit/test_protos.py).

Two changes are allowed, each because no message on the wire changes (code
generated from the old protos may still need to be regenerated):
- setting ``go_package`` on a file that had none: protoc-gen-go refuses a file
  without it, so no Go code can depend on the old (empty) value (changing a
  ``go_package`` that was set is still breaking);
- moving ``go_package`` from ``github.com/genai-grpc/genai-grpc/gen/go/...``
  to ``github.com/genai-grpc/genai-grpc/clients/go/gen/...``: the old path
  named a Go module that never existed (no Go code could import it), the new
  one is the module in clients/go;
- ``BidiResponse.error`` becoming ``google.rpc.Status`` in place of the
  earlier ``genai.v1.ErrorStatus`` (deleted): both carry ``int32 code = 1``
  and ``string message = 2``, so the bytes on the wire are the same, and
  google.rpc.Status only adds ``details = 3``.

The commit compared against is exported with ``git archive`` and gets the
checkout's protos/google/ (google.rpc.Status, which commits before it was
committed did not track).

    python -m tests.buf_breaking [REF]     # REF defaults to HEAD~1
"""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# The one go_package move allowed (see above): same package dir, same name.
_GO_MODULE_MOVE = re.compile(
    r'changed from "github\.com/genai-grpc/genai-grpc/gen/go/(?P<dir>\w+/v\d+;\w+)"'
    r' to "github\.com/genai-grpc/genai-grpc/clients/go/gen/(?P=dir)"\.$'
)


def _buf() -> str:
    return (
        shutil.which("buf", path=str(Path(sys.executable).parent)) or shutil.which("buf") or "buf"
    )


def _allowed(violation: dict[str, Any]) -> bool:
    kind, message = violation.get("type"), violation.get("message", "")
    if kind == "FILE_SAME_GO_PACKAGE":
        return 'changed from ""' in message or _GO_MODULE_MOVE.search(message) is not None
    if kind == "MESSAGE_NO_DELETE":
        return message == 'Previously present message "ErrorStatus" was deleted from file.'
    if kind == "FIELD_SAME_TYPE":
        return message == (
            'Field "4" with name "error" on message "BidiResponse" changed type from'
            ' "genai.v1.ErrorStatus" to "google.rpc.Status".'
        )
    return False


def changes_since(ref: str) -> list[dict[str, Any]]:
    """The breaking changes of protos/ against git commit ``ref``: that
    commit's protos/ is exported to a temporary directory (with the
    checkout's protos/google/ added) and used as buf's other input."""
    with tempfile.TemporaryDirectory(prefix="buf-against-") as tmp:
        archive = subprocess.run(
            ["git", "archive", "--format=tar", ref, "protos"],
            cwd=ROOT,
            capture_output=True,
            check=True,
            timeout=60,
        )
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(tmp, filter="data")
        google = ROOT / "protos" / "google"
        if google.is_dir():
            shutil.copytree(google, Path(tmp) / "protos" / "google", dirs_exist_ok=True)
        return breaking_changes(Path(tmp) / "protos")


def breaking_changes(against: str | Path, source: str | Path = "protos") -> list[dict[str, Any]]:
    """The breaking changes of ``source`` (a buf input) against ``against`` (another)."""
    result = subprocess.run(
        [_buf(), "breaking", str(source), "--against", str(against), "--error-format", "json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if result.returncode not in (0, 100):  # 100: breaking changes found
        raise RuntimeError(f"buf breaking failed ({result.returncode}): {result.stderr.strip()}")
    found = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    return [v for v in found if not _allowed(v)]


def main(argv: list[str]) -> int:
    ref = argv[0] if argv else "HEAD~1"
    changes = changes_since(ref)
    for v in changes:
        print(f"{v.get('path')}:{v.get('start_line')}: {v.get('type')}: {v.get('message')}")
    return 1 if changes else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
