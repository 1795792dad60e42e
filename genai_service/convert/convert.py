"""GGUF file → model directory: orchestration and the small config files.

The directory contract is docs/design.md, "Model directory".

The directory holds ``model.onnx`` + ``model.onnx.data``, ``tokenizer.json``,
``tokenizer_config.json``, ``genai_config.json`` (onnxruntime-genai format) and
``conversion.json`` (provenance: source hash, weight format, converter version).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import onnx
import structlog
from tqdm import tqdm

from genai_service.convert.gguf_model import DecoderParams, GGUFModel
from genai_service.convert.graph_build import GraphOptions, build_decoder
from genai_service.convert.tokenizer_build import VocabSpec, write_tokenizer
from genai_service.convert.weights import DEFAULT_WEIGHTS

# Bump whenever the produced directory changes; cached conversions are keyed by it.
CONVERTER_VERSION = "3"

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class ConvertOptions:
    """What to produce. ``weights``: fp32 | int8 | int4 (see ``weights.py``)."""

    weights: str = DEFAULT_WEIGHTS
    all_logits: bool = False
    accuracy_level: int = 4
    lm_head_accuracy_level: int | None = None

    def graph_options(self) -> GraphOptions:
        return GraphOptions(
            weights=self.weights,
            all_logits=self.all_logits,
            accuracy_level=self.accuracy_level,
            lm_head_accuracy_level=self.lm_head_accuracy_level,
        )


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def genai_config(params: DecoderParams, vocab: VocabSpec) -> dict[str, Any]:
    """``genai_config.json`` as onnxruntime-genai reads it (shared past/present buffer)."""
    eos = vocab.eos_id if vocab.eos_id is not None else 0
    return {
        "model": {
            "bos_token_id": vocab.bos_id if vocab.bos_id is not None else eos,
            "context_length": params.context_length,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": MODEL_FILE,
                "head_size": params.head_dim,
                "hidden_size": params.hidden,
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
                "num_attention_heads": params.n_heads,
                "num_hidden_layers": params.n_layers,
                "num_key_value_heads": params.n_kv_heads,
            },
            "eos_token_id": eos,
            "pad_token_id": vocab.pad_id if vocab.pad_id is not None else eos,
            "type": params.arch,
            "vocab_size": params.vocab_size,
        },
        "search": {
            "diversity_penalty": 0.0,
            "do_sample": False,
            "early_stopping": True,
            "length_penalty": 1.0,
            "max_length": params.context_length,
            "min_length": 0,
            "no_repeat_ngram_size": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": True,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
        },
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert(
    gguf_path: str | Path,
    out_dir: str | Path,
    options: ConvertOptions | None = None,
    *,
    progress: bool = True,
    source_sha256: str | None = None,
) -> Path:
    """Convert ``gguf_path`` into the model directory ``out_dir`` (created; must be empty).

    ``source_sha256`` skips re-hashing when the caller has already verified the file.
    """
    options = options or ConvertOptions()
    graph_options = options.graph_options()  # validates before any work
    src, out = Path(gguf_path), Path(out_dir)
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file not found: {src}")
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise FileExistsError(f"output directory {out} is not empty")
    started = time.monotonic()

    digest = source_sha256 or sha256_file(src)
    gguf = GGUFModel(src)
    gguf.check_types()
    params = gguf.decoder_params()
    vocab = VocabSpec.from_metadata(gguf.metadata)
    log.info("converting", source=src.name, weights=options.weights, layers=params.n_layers)

    with tqdm(
        total=params.n_layers + 3,
        desc=f"convert {options.weights}",
        unit="step",
        disable=not progress,
        leave=False,
    ) as bar:

        def step(msg: str) -> None:
            bar.set_postfix_str(msg)
            bar.update(1)

        model = build_decoder(gguf, graph_options, progress=step)
        bar.set_postfix_str("save")
        onnx.save_model(
            model,
            str(out / MODEL_FILE),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=DATA_FILE,
            size_threshold=1024,
        )
        del model
        bar.update(1)
        bar.set_postfix_str("tokenizer")
        write_tokenizer(vocab, out, params.context_length)
        bar.update(1)

    _write_json(out / "genai_config.json", genai_config(params, vocab))
    _write_json(
        out / "conversion.json",
        {
            "source": src.name,
            "source_sha256": digest,
            "converter_version": CONVERTER_VERSION,
            "options": asdict(options),
            "architecture": asdict(params),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
    )
    log.info("converted", out=str(out), seconds=round(time.monotonic() - started, 1))
    return out
