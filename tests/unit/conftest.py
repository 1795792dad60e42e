"""The unit layer runs without ONNX Runtime (STYLE: only the model runners need
it). Blocking the import here for the whole run would break the other layers,
since pytest imports every conftest before it runs anything; so
``test_no_onnxruntime.py`` imports every unit module in a fresh interpreter with
the import blocked, and the fixture below fails a unit test that imports it
while it runs (when no other layer has loaded it already)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _no_onnxruntime_import() -> Iterator[None]:
    loaded = "onnxruntime" in sys.modules
    yield
    if not loaded:
        assert "onnxruntime" not in sys.modules, "a unit test imported onnxruntime"
