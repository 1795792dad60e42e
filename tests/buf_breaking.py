"""``buf breaking`` of protos/ against a git commit (``make lint``, tests/unit/test_protos.py).

One kind of change is allowed: setting ``go_package`` on a file that had none.
protoc-gen-go refuses a file without it, so no Go code can depend on the
old (empty) value. Changing a ``go_package`` that was set is still breaking.

    python -m tests.buf_breaking [REF]     # REF defaults to HEAD~1
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _buf() -> str:
    return (
        shutil.which("buf", path=str(Path(sys.executable).parent)) or shutil.which("buf") or "buf"
    )


def _allowed(violation: dict[str, Any]) -> bool:
    return violation.get("type") == "FILE_SAME_GO_PACKAGE" and 'changed from ""' in violation.get(
        "message", ""
    )


def git_ref(ref: str) -> str:
    """The buf input for protos/ at git commit ``ref``."""
    return f".git#ref={ref},subdir=protos"


def breaking_changes(against: str, source: str | Path = "protos") -> list[dict[str, Any]]:
    """The breaking changes of ``source`` (a buf input) against ``against`` (another)."""
    result = subprocess.run(
        [_buf(), "breaking", str(source), "--against", against, "--error-format", "json"],
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
    changes = breaking_changes(git_ref(ref))
    for v in changes:
        print(f"{v.get('path')}:{v.get('start_line')}: {v.get('type')}: {v.get('message')}")
    return 1 if changes else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
