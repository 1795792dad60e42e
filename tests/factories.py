"""Shared builders for the engine's request state, so tests stop hand-building
``Sequence`` objects field by field: a sequence is made the way the engine
makes one (``new_sequence``), with a tiny in-memory tokenizer and no model, so
the unit layer (no ONNX Runtime) can use them."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import tokenizers
from tokenizers import decoders, pre_tokenizers
from tokenizers.models import BPE, WordLevel

from genai_service.contract.request import GenerationRequest, Priority
from genai_service.engine.sequence import Sequence, new_sequence

if TYPE_CHECKING:
    from genai_service.engine.sessions.sessions import Session


@functools.cache
def tiny_tokenizer() -> tokenizers.Tokenizer:
    """A word-level tokenizer that knows no words: every id decodes to nothing
    it could mistake for a stop string, which is all the text stage needs here."""
    return tokenizers.Tokenizer(WordLevel(vocab={"<unk>": 0}, unk_token="<unk>"))


BYTES_EOS_ID = 256  # bytes_tokenizer's one special token


@functools.cache
def bytes_tokenizer() -> tokenizers.Tokenizer:
    """One token per byte (ids 0..255, byte-level alphabet) and ``<eos>``
    (256): what llguidance needs to match constraints byte by byte, without
    the tiny models' module (which imports ONNX Runtime)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda c: _byte_of(c))
    vocab = {c: i for i, c in enumerate(byte_chars)}
    tok = tokenizers.Tokenizer(BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return tok


def _byte_of(char: str) -> int:
    """The byte GPT-2's byte-level alphabet writes as ``char``."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    if ord(char) in printable:
        return ord(char)
    others = [b for b in range(256) if b not in printable]
    return others[ord(char) - 256]


def make_request(
    request_id: str = "r",
    prompt: Iterable[int] = (),
    *,
    priority: Priority = Priority.NORMAL,
    seed: int | None = 0,
    **fields: Any,
) -> GenerationRequest:
    """A validated request: ``prompt`` token ids, a fixed ``seed`` by default
    (reproducible tests), any other ``GenerationRequest`` field by name."""
    request = GenerationRequest(request_id, tuple(prompt), priority=priority, **fields)
    return replace(request, sampling=replace(request.sampling, seed=seed))


def make_sequence(
    prompt: Iterable[int] | GenerationRequest = (),
    *,
    request_id: str = "r",
    priority: Priority = Priority.NORMAL,
    history: Seq[int] = (),
    session: Session | None = None,
    max_new_tokens: int = 4,
    eos_token_ids: Iterable[int] = (),
) -> Sequence:
    """A queued sequence as the engine builds it: ``history`` then ``prompt``
    as its context, ``session`` attached (its history is not prepended unless
    passed as ``history``)."""
    if isinstance(prompt, GenerationRequest):
        request = prompt
    else:
        request = make_request(request_id, prompt, priority=priority)
    return new_sequence(
        request,
        list(history),
        session,
        tokenizer=tiny_tokenizer(),
        eos_token_ids=eos_token_ids,
        max_new_tokens=max_new_tokens,
    )
