"""``genai-convert GGUF_FILE OUT_DIR [--weights fp32|int8|int4]``: GGUF → model directory.

``GGUF_FILE`` may be a named model: ``default`` (the packaged SmolLM2-135M-Instruct
GGUF) or ``gemma3-270m`` (Gemma 3 270M, Q4_K_M).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from genai_service.convert.convert import ConvertOptions, convert
from genai_service.convert.default_model import (
    NAMED_MODELS,
    DefaultModelUnavailable,
    named_gguf,
)
from genai_service.convert.gguf_model import UnsupportedTensorType
from genai_service.convert.weights import DEFAULT_WEIGHTS, WEIGHT_FORMATS


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="genai-convert",
        description="Convert a GGUF file (Llama, Qwen2/3, Gemma 3) into an ONNX Runtime model "
        "directory (model.onnx, tokenizer.json, tokenizer_config.json, genai_config.json).",
    )
    parser.add_argument(
        "gguf",
        metavar="GGUF_FILE",
        help=f"the GGUF file, or a named model: {', '.join(NAMED_MODELS)}",
    )
    parser.add_argument("out_dir", metavar="OUT_DIR", help="output directory (new or empty)")
    parser.add_argument(
        "--weights",
        choices=WEIGHT_FORMATS,
        default=DEFAULT_WEIGHTS,
        help=f"weight format (default: {DEFAULT_WEIGHTS}; see docs/models.md)",
    )
    parser.add_argument(
        "--all-logits",
        action="store_true",
        help="output logits for every position ([batch, seq, vocab]) instead of the last one",
    )
    parser.add_argument(
        "--accuracy-level",
        type=int,
        choices=(1, 4),
        default=4,
        help="MatMulNBits activations: 4 = int8 (fast, default), 1 = float32 (slow, exact)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        source = named_gguf(args.gguf).path if args.gguf in NAMED_MODELS else args.gguf
        options = ConvertOptions(
            weights=args.weights, all_logits=args.all_logits, accuracy_level=args.accuracy_level
        )
        out = convert(source, args.out_dir, options, progress=not args.quiet)
    except (
        DefaultModelUnavailable,
        UnsupportedTensorType,
        FileNotFoundError,
        FileExistsError,
        ValueError,
    ) as exc:
        sys.stderr.write(f"genai-convert: error: {exc}\n")
        return 2
    sys.stdout.write(f"{out}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
