"""IncrementalDetokenizer: streamed deltas join to the full decode, never broken UTF-8.

Three tokenizer families are built here from a tiny in-memory corpus (no
downloads): byte-level BPE (GPT-2/SmolLM2 style), WordLevel with whitespace
(decode joins words with spaces) and Metaspace BPE (SentencePiece style, with
a plain Metaspace decoder and with Llama's byte-fallback decoder chain).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from genai_service.engine.text.detokenizer import IncrementalDetokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you doing today? Hello there.",
    "Café, naïve, façade, résumé, Zürich, Ærø, São Paulo, Kraków.",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "I love pizza 🍕 and sushi 🍣! 😀😃😄 Party 🎉🎉 👍🏽 🇫🇷",
    "Numbers: 12345 67890, symbols: #@$%^&*() [] {} <>",
    "  indented\tline\nnew line\n\nparagraph",
] * 3

EOS = "<|endoftext|>"
# Largest decode window expected: up to 9 held tokens as context plus 9 more
# held before the window is re-anchored.
MAX_WINDOW = 18


@functools.cache
def byte_level_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


@functools.cache
def word_level() -> Tokenizer:
    words = sorted({w for line in CORPUS for w in line.split()})
    vocab = {"[UNK]": 0, "<eos>": 1} | {w: i + 2 for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["[UNK]", "<eos>"])
    return tok


def _metaspace_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


@functools.cache
def metaspace_bpe() -> Tokenizer:
    """Unknown characters become <unk>; Metaspace decoder drops the first space."""
    tok = _metaspace_bpe()
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    return tok


@functools.cache
def metaspace_byte_fallback() -> Tokenizer:
    """Llama style: <0xNN> byte tokens for unknown characters, Strip decoder chain."""
    spec = json.loads(_metaspace_bpe().to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return tok


TEXT_TOKENIZERS = {
    "byte_level": byte_level_bpe,
    "metaspace": metaspace_bpe,
    "byte_fallback": metaspace_byte_fallback,
}

EMOJI = list("😀🦀🍕🎉🇫🇷👍🏽🧑‍🚀東京é")
texts = st.text(
    st.one_of(st.characters(codec="utf-8"), st.sampled_from(EMOJI), st.sampled_from(" \n")),
    max_size=40,
)
group_sizes = st.lists(st.integers(1, 6), min_size=1, max_size=8)


def stream(
    detok: IncrementalDetokenizer, ids: Sequence[int], sizes: Sequence[int] = (1,)
) -> list[str]:
    """Feed ``ids`` in groups of ``sizes`` (cycled); return every delta, flush included."""
    chunks, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        chunks.append(detok.add(ids[i : i + n]))
        i, k = i + n, k + 1
    chunks.append(detok.flush())
    return chunks


def check_stream(tok: Tokenizer, ids: list[int], sizes: Sequence[int] = (1,)) -> list[str]:
    detok = IncrementalDetokenizer(tok)
    chunks = stream(detok, ids, sizes)
    full = tok.decode(ids, skip_special_tokens=True)
    assert "".join(chunks) == full
    assert detok.text == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in c for c in chunks)
    return chunks


@pytest.mark.parametrize("name", sorted(TEXT_TOKENIZERS))
@settings(max_examples=50, deadline=None)
@given(text=texts, sizes=group_sizes)
def test_deltas_join_to_full_decode(name: str, text: str, sizes: list[int]) -> None:
    tok = TEXT_TOKENIZERS[name]()
    ids = tok.encode(text).ids
    check_stream(tok, ids)  # one token at a time
    check_stream(tok, ids, sizes)


@pytest.mark.parametrize("name", sorted(TEXT_TOKENIZERS))
@settings(max_examples=50, deadline=None)
@given(text=texts, cut=st.integers(0, 60), sizes=group_sizes)
def test_prompt_context_matches_decode_in_context(
    name: str, text: str, cut: int, sizes: list[int]
) -> None:
    tok = TEXT_TOKENIZERS[name]()
    ids = tok.encode(text).ids
    cut = min(cut, len(ids))
    prompt, generated = ids[:cut], ids[cut:]
    full, before = tok.decode(ids), tok.decode(prompt)
    if not full.startswith(before):
        return  # the prompt ends inside a character: no clean "generated part"
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    assert "".join(stream(detok, generated, sizes)) == full[len(before) :]


@settings(max_examples=50, deadline=None)
@given(ids=st.lists(st.integers(0, 60), max_size=30), sizes=group_sizes)
def test_word_level_random_ids(ids: list[int], sizes: list[int]) -> None:
    tok = word_level()
    check_stream(tok, ids)
    check_stream(tok, ids, sizes)
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(stream(detok, ids, sizes)) == tok.decode(ids, skip_special_tokens=False)


def test_word_level_joins_words_with_spaces() -> None:
    tok = word_level()
    ids = tok.encode("Hello, world! How are you").ids
    assert check_stream(tok, ids) == ["Hello,", " world!", " How", " are", " you", ""]
    # With prompt context the first word gets its leading space.
    prompt = tok.encode("Hello, world!").ids
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    assert detok.add(tok.encode("How are").ids) == " How are"


@pytest.mark.parametrize("name", ["byte_level", "byte_fallback"])
def test_emoji_split_across_tokens_comes_out_whole(name: str) -> None:
    tok = TEXT_TOKENIZERS[name]()
    ids = tok.encode("I like 🦀 crabs").ids
    assert tok.decode(ids) == "I like 🦀 crabs"
    # 🦀 is not in the corpus: it is spelled in several byte tokens.
    assert sum("\ufffd" in tok.decode([i]) for i in ids) >= 2
    chunks = check_stream(tok, ids)
    assert any("🦀" in c for c in chunks)


def test_text_before_a_partial_character_is_not_delayed() -> None:
    tok = byte_level_bpe()
    ids = tok.encode("I like 🦀").ids
    # The trained vocabulary merges " " with the emoji's first bytes ("ĠðŁ").
    split = next(i for i, t in enumerate(ids) if tok.decode([t]) == " \ufffd")
    detok = IncrementalDetokenizer(tok)
    assert detok.add(ids[:split]) == "I like"
    assert detok.add(ids[split : split + 1]) == " "
    assert detok.add(ids[split + 1 :]) == "🦀"
    assert detok.flush() == ""


@pytest.mark.parametrize("name", ["byte_level", "byte_fallback"])
def test_flush_emits_incomplete_character_as_replacement(name: str) -> None:
    tok = TEXT_TOKENIZERS[name]()
    ids = tok.encode("ok 🦀").ids[:-1]  # generation stopped inside the emoji
    full = tok.decode(ids)
    assert full.endswith("\ufffd")
    detok = IncrementalDetokenizer(tok)
    added = "".join(detok.add([i]) for i in ids)
    assert "\ufffd" not in added
    assert added + detok.flush() == full
    assert detok.flush() == ""
    with pytest.raises(RuntimeError):
        detok.add(ids)


def test_special_tokens_skipped_or_kept() -> None:
    tok = byte_level_bpe()
    eos = tok.token_to_id(EOS)
    assert eos is not None
    ids = tok.encode("Hello").ids + [eos] + tok.encode(" world").ids + [eos]
    skipped = "".join(stream(IncrementalDetokenizer(tok), ids))
    assert skipped == "Hello world" == tok.decode(ids)
    kept = "".join(stream(IncrementalDetokenizer(tok, skip_special_tokens=False), ids))
    assert kept == f"Hello{EOS} world{EOS}" == tok.decode(ids, skip_special_tokens=False)
    # Special tokens in the prompt are not used as context when skipped.
    detok = IncrementalDetokenizer(tok, prompt_token_ids=[eos, eos])
    assert detok.add(tok.encode("Hi").ids) == "Hi"


def test_metaspace_leading_space_from_prompt_context() -> None:
    tok = metaspace_bpe()
    prompt, gen = tok.encode("Hello world").ids, tok.encode("Hello there").ids
    # Alone, the first "▁Hello" decodes without its space; after a prompt it has one.
    assert "".join(stream(IncrementalDetokenizer(tok), gen)) == "Hello there"
    in_context = "".join(stream(IncrementalDetokenizer(tok, prompt_token_ids=prompt), gen))
    assert in_context == " Hello there"


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call gets."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.window_sizes: list[int] = []

    def get_added_tokens_decoder(self) -> dict:
        return self.inner.get_added_tokens_decoder()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.window_sizes.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("name", sorted(TEXT_TOKENIZERS))
def test_decode_window_does_not_grow_with_sequence_length(name: str) -> None:
    inner = TEXT_TOKENIZERS[name]()
    ids = inner.encode(" ".join(CORPUS)).ids * 4
    tok = CountingTokenizer(inner)
    prompt, generated = ids[:50], ids[50:]
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt)  # type: ignore[arg-type]
    chunks = [detok.add([i]) for i in generated] + [detok.flush()]
    full, before = inner.decode(ids), inner.decode(prompt)
    assert full.startswith(before)
    assert "".join(chunks) == full[len(before) :]
    assert len(generated) > 1000
    assert max(tok.window_sizes) <= MAX_WINDOW


def test_model_emitting_replacement_characters_keeps_window_bounded() -> None:
    # U+FFFD itself is valid text; a long run of it must neither stall the
    # stream forever nor make each step decode the whole run.
    inner = byte_level_bpe()
    ids = inner.encode("a" + "\ufffd" * 200 + "b").ids
    tok = CountingTokenizer(inner)
    detok = IncrementalDetokenizer(tok)  # type: ignore[arg-type]
    chunks = [detok.add([i]) for i in ids[:-1]]
    assert "".join(chunks).count("\ufffd") > 150  # streamed, not all held to the end
    chunks += [detok.add(ids[-1:]), detok.flush()]
    assert "".join(chunks) == inner.decode(ids)
    assert max(tok.window_sizes) <= MAX_WINDOW


def straddling_byte_level(text: str, cuts: Sequence[int]) -> tuple[Tokenizer, list[int]]:
    """A byte-level tokenizer whose tokens are ``text``'s bytes cut at ``cuts``.

    Real byte-level vocabularies have tokens that end inside one character
    and begin inside the next (CJK runs); this makes every boundary such.
    """
    mapped = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    byte_chars = mapped.pre_tokenize_str(text)[0][0] if text else ""  # one char per byte
    bounds = sorted({0, len(byte_chars), *(c for c in cuts if 0 < c < len(byte_chars))})
    pieces = [byte_chars[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.ByteLevel()
    return tok, [vocab[p] for p in pieces]


def test_tokens_never_ending_on_a_character_boundary() -> None:
    # 3-byte characters cut at byte 1, 4, 7, ...: no token ends a character.
    text = "東京大学日本語の首都" * 30
    tok, ids = straddling_byte_level(text, range(1, 3 * len(text), 3))
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting)  # type: ignore[arg-type]
    chunks = [detok.add([i]) for i in ids]
    # Each character is streamed as soon as its last byte arrives.
    assert chunks[:4] == ["", "東", "京", "大"]
    assert "".join(chunks) + detok.flush() == text
    assert max(counting.window_sizes) <= MAX_WINDOW


@settings(max_examples=50, deadline=None)
@given(
    text=st.text(st.sampled_from(EMOJI + list("日本語 ab\u00e9\u4e2d")), max_size=40),
    cut_sizes=st.lists(st.integers(1, 5), min_size=1, max_size=6),
    sizes=group_sizes,
)
def test_tokens_cut_anywhere_in_the_bytes(
    text: str, cut_sizes: list[int], sizes: list[int]
) -> None:
    n, cuts = len(text.encode()), [0]
    while cuts[-1] < n:
        cuts.append(cuts[-1] + cut_sizes[len(cuts) % len(cut_sizes)])
    tok, ids = straddling_byte_level(text, cuts)
    assert tok.decode(ids) == text
    check_stream(tok, ids)
    check_stream(tok, ids, sizes)


def decode_stream_text(tok: Tokenizer, ids: Sequence[int]) -> list[str | None]:
    """What ``tokenizers.decoders.DecodeStream`` gives for ``ids``, token by token."""
    ds = decoders.DecodeStream(skip_special_tokens=True)
    return [ds.step(tok, i) for i in ids]


def test_decode_stream_holds_unfinished_runs() -> None:
    # Why the engine keeps its own detokenizer:
    # docs/design.md, "Engine modules". The library's DecodeStream gives the
    # same text on ordinary output, but a run of tokens none of which ends a
    # character comes out of it only when the run ends, each step decoding the
    # whole run so far; ours streams each character as its last byte arrives.
    tok = byte_level_bpe()
    ids = tok.encode(CORPUS[0] + " " + CORPUS[2]).ids
    assert "".join(c for c in decode_stream_text(tok, ids) if c) == "".join(
        stream(IncrementalDetokenizer(tok), ids)
    )
    text = "東京大学日本語の首都" * 3
    tok, ids = straddling_byte_level(text, range(1, 3 * len(text), 3))
    held = decode_stream_text(tok, ids)
    assert held[:-1] == [None] * (len(ids) - 1) and held[-1] == text  # all at the very end
    detok = IncrementalDetokenizer(tok)
    chunks = [detok.add([i]) for i in ids]
    assert chunks[:4] == ["", "東", "京", "大"] and "".join(chunks) == text
