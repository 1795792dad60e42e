"""Build a Hugging Face ``tokenizer.json`` and ``tokenizer_config.json`` from GGUF metadata.

Two vocabulary kinds (``tokenizer.ggml.model``):

- ``gpt2``: byte-level BPE with the file's merges. The pre-tokenizer follows
  ``tokenizer.ggml.pre`` the way llama.cpp does: for "smollm" (and the
  StarCoder family) every digit is split off on its own first, then the GPT-2
  regex applies.
- ``llama``: SentencePiece BPE (Llama 2, Gemma). The file has scores instead of
  merges; a pair merges when the piece it makes is in the vocabulary, and the
  higher that piece's score, the earlier (as SentencePiece and llama.cpp
  encode). Spaces become ``▁``, a ``▁`` is prepended when
  ``tokenizer.ggml.add_space_prefix`` says so (its default is true), and
  characters outside the vocabulary fall back to the ``<0xNN>`` byte tokens.

Control and user-defined tokens become added tokens so that chat markup such
as ``<|im_start|>`` is one id.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

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
TOKENIZER_MODELS = ("gpt2", "llama")
SPM_SPACE = "\u2581"  # ▁


@dataclass(frozen=True)
class VocabSpec:
    """The tokenizer part of GGUF metadata."""

    tokens: Sequence[str]
    merges: Sequence[str]  # "left right" pairs in priority order (gpt2)
    token_types: Sequence[int]
    pre: str = "default"
    bos_id: int | None = None
    eos_id: int | None = None
    unk_id: int | None = None
    pad_id: int | None = None
    add_bos: bool = False
    chat_template: str | None = None
    model: str = "gpt2"  # gpt2 | llama (SentencePiece)
    scores: Sequence[float] = ()  # llama: each piece's score
    add_space_prefix: bool = True  # llama: "▁" before the text

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> VocabSpec:
        model = meta.get("tokenizer.ggml.model")
        if model not in TOKENIZER_MODELS:
            raise ValueError(
                f"tokenizer.ggml.model is {model!r}; supported: 'gpt2' (byte-level BPE) and "
                "'llama' (SentencePiece BPE)"
            )
        tokens = list(meta["tokenizer.ggml.tokens"])
        scores = list(meta.get("tokenizer.ggml.scores", []))
        if model == "llama" and len(scores) != len(tokens):
            raise ValueError(
                f"tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens"
            )
        return cls(
            tokens=tokens,
            merges=list(meta.get("tokenizer.ggml.merges", [])),
            token_types=list(meta.get("tokenizer.ggml.token_type", [TOKEN_NORMAL] * len(tokens))),
            pre=str(meta.get("tokenizer.ggml.pre", "default")),
            bos_id=_opt_int(meta.get("tokenizer.ggml.bos_token_id")),
            eos_id=_opt_int(meta.get("tokenizer.ggml.eos_token_id")),
            unk_id=_opt_int(meta.get("tokenizer.ggml.unknown_token_id")),
            pad_id=_opt_int(meta.get("tokenizer.ggml.padding_token_id")),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama")),
            chat_template=meta.get("tokenizer.chat_template"),
            model=str(model),
            scores=[float(x) for x in scores],
            add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
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


def spm_merges(spec: VocabSpec) -> list[tuple[str, str]]:
    """SentencePiece's merge order as BPE merges: every split of a mergeable
    piece into two pieces of the vocabulary, the higher-scoring result first
    (ties: the lower id first, as a vocabulary lists its pieces by score)."""
    vocab = {tok: i for i, tok in enumerate(spec.tokens)}
    mergeable = {TOKEN_NORMAL, TOKEN_USER_DEFINED, TOKEN_UNUSED}
    found: list[tuple[float, int, int, int, str, str]] = []
    for merged, i in vocab.items():
        if spec.token_types[i] not in mergeable or len(merged) < 2:
            continue
        for cut in range(1, len(merged)):
            left, right = merged[:cut], merged[cut:]
            li, ri = vocab.get(left), vocab.get(right)
            if li is not None and ri is not None:
                found.append((-spec.scores[i], i, li, ri, left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def build_tokenizer(spec: VocabSpec) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` equivalent to the GGUF vocabulary."""
    vocab = {tok: i for i, tok in enumerate(spec.tokens)}
    if len(vocab) != len(spec.tokens):
        raise ValueError("the GGUF vocabulary has duplicate tokens")
    if spec.model == "llama":
        unk = spec.token(spec.unk_id)
        tok = Tokenizer(
            models.BPE(
                vocab=vocab,
                merges=spm_merges(spec),
                unk_token=unk,
                fuse_unk=True,
                byte_fallback=True,
            )
        )
        steps: list[normalizers.Normalizer] = [normalizers.Replace(" ", SPM_SPACE)]
        if spec.add_space_prefix:
            steps.insert(0, normalizers.Prepend(SPM_SPACE))
        tok.normalizer = normalizers.Sequence(steps)
        parts: list[decoders.Decoder] = [
            decoders.Replace(SPM_SPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
        ]
        if spec.add_space_prefix:
            parts.append(decoders.Strip(" ", 1, 0))
        tok.decoder = decoders.Sequence(parts)
    else:
        merges = []
        for line in spec.merges:
            left, sep, right = line.partition(" ")
            if not sep:
                raise ValueError(f"malformed merge {line!r}")
            merges.append((left, right))
        tok = Tokenizer(
            models.BPE(
                vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False
            )
        )
        tok.pre_tokenizer = _pre_tokenizer(spec.pre)
        tok.decoder = decoders.ByteLevel()
    if spec.add_bos and spec.bos_id is not None:
        bos = spec.tokens[spec.bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, spec.bos_id)]
        )
    elif spec.model == "gpt2":
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
        "add_prefix_space": spec.model == "llama" and spec.add_space_prefix,
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
        "tokenizer_class": "GPT2Tokenizer" if spec.model == "gpt2" else "LlamaTokenizer",
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
