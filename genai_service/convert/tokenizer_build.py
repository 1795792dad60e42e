"""Build a Hugging Face ``tokenizer.json`` and ``tokenizer_config.json`` from GGUF metadata.

Only byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``) are
supported. The pre-tokenizer follows ``tokenizer.ggml.pre`` the way llama.cpp
does: for "smollm" (and the StarCoder family) every digit is split off on its
own first, then the GPT-2 regex applies. Control and user-defined tokens become
added tokens so that chat markup such as ``<|im_start|>`` is one id.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp token types (tokenizer.ggml.token_type)
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

# Llama-3 style splitting: case-insensitive contractions, digits in groups of 1..3.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")

# tokenizer.ggml.pre values and how they split text before BPE.
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact")
_GPT2 = ("gpt-2", "gpt2", "default")
_REGEX_THEN_BYTES = {"llama-bpe": _LLAMA3_REGEX, "llama3": _LLAMA3_REGEX, "qwen2": _QWEN2_REGEX}
SUPPORTED_PRE = (*_DIGITS_THEN_GPT2, *_GPT2, *_REGEX_THEN_BYTES)


@dataclass(frozen=True)
class VocabSpec:
    """The tokenizer part of GGUF metadata."""

    tokens: Sequence[str]
    merges: Sequence[str]  # "left right" pairs in priority order
    token_types: Sequence[int]
    pre: str = "default"
    bos_id: int | None = None
    eos_id: int | None = None
    unk_id: int | None = None
    pad_id: int | None = None
    add_bos: bool = False
    chat_template: str | None = None

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> VocabSpec:
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(
                f"tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') vocabularies "
                "are supported"
            )
        tokens = list(meta["tokenizer.ggml.tokens"])
        return cls(
            tokens=tokens,
            merges=list(meta.get("tokenizer.ggml.merges", [])),
            token_types=list(meta.get("tokenizer.ggml.token_type", [TOKEN_NORMAL] * len(tokens))),
            pre=str(meta.get("tokenizer.ggml.pre", "default")),
            bos_id=_opt_int(meta.get("tokenizer.ggml.bos_token_id")),
            eos_id=_opt_int(meta.get("tokenizer.ggml.eos_token_id")),
            unk_id=_opt_int(meta.get("tokenizer.ggml.unknown_token_id")),
            pad_id=_opt_int(meta.get("tokenizer.ggml.padding_token_id")),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    def token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokens[token_id]


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _REGEX_THEN_BYTES:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_REGEX_THEN_BYTES[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise ValueError(
        f"tokenizer.ggml.pre {pre!r} is not supported (supported: {', '.join(SUPPORTED_PRE)})"
    )


def build_tokenizer(spec: VocabSpec) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` equivalent to the GGUF vocabulary."""
    vocab = {tok: i for i, tok in enumerate(spec.tokens)}
    if len(vocab) != len(spec.tokens):
        raise ValueError("the GGUF vocabulary has duplicate tokens")
    merges = []
    for line in spec.merges:
        left, sep, right = line.partition(" ")
        if not sep:
            raise ValueError(f"malformed merge {line!r}")
        merges.append((left, right))
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False)
    )
    tok.pre_tokenizer = _pre_tokenizer(spec.pre)
    tok.decoder = decoders.ByteLevel()
    if spec.add_bos and spec.bos_id is not None:
        bos = spec.tokens[spec.bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, spec.bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    special, user = [], []
    for i, (text, kind) in enumerate(zip(spec.tokens, spec.token_types, strict=True)):
        if kind == TOKEN_CONTROL or i in (spec.bos_id, spec.eos_id):
            special.append(AddedToken(text, special=True, normalized=False))
        elif kind == TOKEN_USER_DEFINED:
            user.append(AddedToken(text, special=False, normalized=False))
    # Ids come from the vocabulary: every added token is already in it.
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    return tok


def tokenizer_config(spec: VocabSpec, context_length: int) -> dict[str, Any]:
    """``tokenizer_config.json`` in the transformers format (chat template, special tokens)."""
    added = {
        str(i): {
            "content": text,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": kind == TOKEN_CONTROL,
        }
        for i, (text, kind) in enumerate(zip(spec.tokens, spec.token_types, strict=True))
        if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED)
    }
    config: dict[str, Any] = {
        "add_bos_token": spec.add_bos,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [
            text
            for i, (text, kind) in enumerate(zip(spec.tokens, spec.token_types, strict=True))
            if kind == TOKEN_CONTROL and i not in (spec.bos_id, spec.eos_id, spec.unk_id)
        ],
        "bos_token": spec.token(spec.bos_id),
        "eos_token": spec.token(spec.eos_id),
        "pad_token": spec.token(spec.pad_id),
        "unk_token": spec.token(spec.unk_id),
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
        "tokenizer_class": "GPT2Tokenizer",
    }
    if spec.chat_template:
        config["chat_template"] = spec.chat_template
    return config


def write_tokenizer(spec: VocabSpec, out_dir: Path, context_length: int) -> Tokenizer:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out_dir``."""
    tok = build_tokenizer(spec)
    tok.save(str(out_dir / "tokenizer.json"))
    config = tokenizer_config(spec, context_length)
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    return tok
