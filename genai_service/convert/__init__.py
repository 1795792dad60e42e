"""GGUF → ONNX model directory conversion (``genai-convert``) and the default model.

- :func:`convert` writes a model directory (docs/design.md, "Model directory")
  from a Llama-family GGUF file.
- :func:`resolve_model` maps ``"default"`` to a cached conversion of the packaged
  SmolLM2-135M-Instruct GGUF and returns any other value as a directory path.
"""

from __future__ import annotations

from genai_service.convert.convert import CONVERTER_VERSION, ConvertOptions, convert
from genai_service.convert.default_model import DefaultModelUnavailable, resolve_model
from genai_service.convert.gguf_model import UnsupportedTensorType
from genai_service.convert.weights import DEFAULT_WEIGHTS, WEIGHT_FORMATS

__all__ = [
    "CONVERTER_VERSION",
    "DEFAULT_WEIGHTS",
    "WEIGHT_FORMATS",
    "ConvertOptions",
    "DefaultModelUnavailable",
    "UnsupportedTensorType",
    "convert",
    "resolve_model",
]
