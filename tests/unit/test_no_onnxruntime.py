"""Every unit test module (and the shared factories) imports with
``onnxruntime`` unimportable: the unit layer needs no model runtime."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

BLOCKED = """
import importlib, sys
sys.modules["onnxruntime"] = None  # `import onnxruntime` now raises ImportError
for name in sys.argv[1:]:
    importlib.import_module(name)
print("ok")
"""


def test_unit_modules_import_without_onnxruntime() -> None:
    modules = ["tests.factories"] + [f"tests.unit.{p.stem}" for p in sorted(HERE.glob("test_*.py"))]
    assert len(modules) > 10
    out = subprocess.run(
        [sys.executable, "-c", BLOCKED, *modules],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
