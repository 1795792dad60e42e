"""Model directory config files: what they say, parsed and checked.

Readers for genai_config.json (onnxruntime-genai), inference_metadata.yaml
(onnx-genai), generation_config.json, tokenizer_config.json and
chat_template.jinja, plus the values resolved from them: EOS/BOS/PAD token
ids, the model author's sampling defaults and the chat template.
``model_dir.load_model_spec`` applies the precedence between them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from genai_common.errors import ModelLoadError

GENAI_CONFIG_FILE = "genai_config.json"
INFERENCE_METADATA_FILE = "inference_metadata.yaml"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

# Tried, in this order, when no config names the EOS token(s); every one found counts.
EOS_TOKEN_CANDIDATES = (
    "</s>",
    "<|im_end|>",
    "<|endoftext|>",
    "<eos>",
    "<|end_of_text|>",
    "<|eot_id|>",
    "<end_of_turn>",
)
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "repetition_penalty")


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path.name}: cannot read ({e})") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path.name}: expected a JSON object at the top level")
    return data


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ModelLoadError(f"{path.name}: cannot read ({e})") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path.name}: expected a mapping at the top level")
    return data


def _get(data: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(data, Mapping):
            return None
        data = data.get(key)
    return data


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _opt_int(value: Any, key: str) -> int | None:
    if value is None:
        return None
    if not _is_int(value):
        raise ModelLoadError(f"{key}: expected an integer in the model config, got {value!r}")
    return int(value)


def _as_ids(value: Any, key: str) -> tuple[int, ...]:
    """A token id given as an int or a list of ints (genai_config allows both)."""
    if _is_int(value):
        return (int(value),)
    if isinstance(value, list) and all(_is_int(v) for v in value):
        return tuple(int(v) for v in value)
    raise ModelLoadError(
        f"{key}: expected an integer or a list of integers in the model config, got {value!r}"
    )


def special_token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    content = _get(value, "content")
    return content if isinstance(content, str) else None


class _LazyTokenizer:
    """Loads tokenizer.json only if a value must come from it (it can take 100s of ms)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._inner: Any = None

    def get(self) -> Any:
        if self._inner is None:
            import tokenizers

            try:
                self._inner = tokenizers.Tokenizer.from_file(str(self._path))
            except Exception as e:  # tokenizers raises a bare Exception on bad files
                raise ModelLoadError(f"{self._path.name}: cannot load tokenizer ({e})") from e
        return self._inner

    def token_id(self, text: str | None) -> int | None:
        if text is None:
            return None
        token_id = self.get().token_to_id(text)
        return None if token_id is None else int(token_id)


def _eos_ids(
    genai: Mapping[str, Any],
    meta: Mapping[str, Any],
    gen_cfg: Mapping[str, Any],
    tok_cfg: Mapping[str, Any],
    tokenizer: _LazyTokenizer,
) -> tuple[int, ...]:
    value = _first(
        _get(genai, "model", "eos_token_id"),
        _get(meta, "tokens", "eos_token_id"),
        _get(meta, "model", "eos_token_id"),
        _get(gen_cfg, "eos_token_id"),
    )
    if value is not None:
        return tuple(dict.fromkeys(_as_ids(value, "eos_token_id")))
    configured = tokenizer.token_id(special_token_text(_get(tok_cfg, "eos_token")))
    if configured is not None:
        return (configured,)
    found = (tokenizer.token_id(text) for text in EOS_TOKEN_CANDIDATES)
    return tuple(dict.fromkeys(i for i in found if i is not None))


def _sampling_defaults(genai: Mapping[str, Any], meta: Mapping[str, Any]) -> dict[str, float | int]:
    """Model-author defaults; applying them (or not, for greedy requests) is the engine's call."""
    defaults: dict[str, float | int] = {}
    for key in SAMPLING_KEYS:
        value = _first(_get(genai, "search", key), _get(meta, "generation", key))
        if value is None:
            continue
        if key == "top_k":
            ok = _is_int(value)
        else:
            ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok:
            raise ModelLoadError(
                f"search.{key}: expected a number in the model config, got {value!r}"
            )
        defaults[key] = int(value) if key == "top_k" else float(value)
    do_sample = _first(_get(genai, "search", "do_sample"), _get(meta, "generation", "do_sample"))
    if isinstance(do_sample, bool):
        # Author defaults are meant for sampling only when the config says it samples.
        defaults["do_sample"] = int(do_sample)
    return defaults


def find_chat_template(root: Path, tok_cfg: Mapping[str, Any]) -> str | None:
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):
        # Multi-template form: [{"name": "default", "template": "..."}, ...]
        by_name = {_get(t, "name"): _get(t, "template") for t in template}
        template = by_name.get("default")
    if isinstance(template, str) and template:
        return template
    file = root / CHAT_TEMPLATE_FILE
    if file.is_file():
        try:
            return file.read_text(encoding="utf-8") or None
        except (OSError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{CHAT_TEMPLATE_FILE}: cannot read ({e})") from e
    return None
