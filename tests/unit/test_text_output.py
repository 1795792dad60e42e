"""TextOutput (detokenizer + stop strings, one object per sequence) and
merge_outputs (the one place deltas are joined). No model, no ORT."""

from __future__ import annotations

import functools

import pytest
from tokenizers import Tokenizer, decoders, models

from genai_service.contract.request import (
    FinishReason,
    RequestOutput,
    TokenLogprob,
    Usage,
    collect,
    merge_outputs,
)
from genai_service.engine.text.text_output import TextOutput

CHARS = " abcdefghijklmnopqrstuvwxyz."


@functools.cache
def char_tokenizer() -> Tokenizer:
    """One token per character; decoding concatenates them."""
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(CHARS)}, merges=[]))
    tok.decoder = decoders.Fuse()
    return tok


def ids(text: str) -> list[int]:
    return [CHARS.index(c) for c in text]


def stream(out: TextOutput, text: str) -> list[str]:
    return [out.add(t) for t in ids(text)]


def test_text_streams_as_decoded_and_finish_releases_nothing_more() -> None:
    out = TextOutput(char_tokenizer())
    assert "".join(stream(out, "hello world.")) == "hello world."
    assert out.finish() == "" and not out.stopped and out.stop_sequence == ""


def test_a_stop_string_across_tokens_is_held_back_then_ends_the_text() -> None:
    out = TextOutput(char_tokenizer(), stop_sequences=("wor",))
    assert stream(out, "hello wor") == ["h", "e", "l", "l", "o", " ", "", "", ""]
    assert out.stopped and out.stop_sequence == "wor"


def test_include_stop_sequence_streams_the_stop_itself() -> None:
    out = TextOutput(char_tokenizer(), stop_sequences=("wor",), include_stop_sequence=True)
    assert "".join(stream(out, "hello wor")) == "hello wor"
    assert out.stopped and out.stop_sequence == "wor"


def test_finish_releases_a_held_back_prefix_of_a_stop() -> None:
    out = TextOutput(char_tokenizer(), stop_sequences=("world",))
    assert "".join(stream(out, "hello wo")) == "hello "  # "wo" may still grow into the stop
    assert out.finish() == "wo"
    assert not out.stopped and out.stop_sequence == ""


def test_a_stop_token_releases_held_text_and_its_own_text_only_when_included() -> None:
    for include, want in ((False, "wo"), (True, "wo<eot>")):
        out = TextOutput(char_tokenizer(), stop_sequences=("world",), include_stop_sequence=include)
        assert "".join(stream(out, "hello wo")) == "hello "
        assert out.finish_at_stop_token("<eot>") == want
        assert out.stop_sequence == "<eot>"


def test_context_ids_are_not_output() -> None:
    out = TextOutput(char_tokenizer(), ids("the prompt "))
    assert "".join(stream(out, "answer")) + out.finish() == "answer"


def test_an_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        TextOutput(char_tokenizer(), stop_sequences=("",))


# -- merge_outputs ----------------------------------------------------------------

LP = TokenLogprob(6, "b", -0.5)


def outputs() -> list[RequestOutput]:
    return [
        RequestOutput("r", (5,), "a"),
        RequestOutput("r", (6,), "b", (LP,)),
        RequestOutput("r", (), "c"),
        RequestOutput(
            "r",
            (7,),
            "d",
            finished=True,
            finish_reason=FinishReason.MAX_TOKENS,
            usage=Usage(3, 3, 1),
            seed=9,
            session_id="s",
            session_tokens=6,
        ),
    ]


def test_merge_joins_tokens_text_and_logprobs_and_keeps_the_last_end_fields() -> None:
    merged = merge_outputs(*outputs())
    assert merged.token_ids == (5, 6, 7) and merged.text == "abcd" and merged.logprobs == (LP,)
    assert merged.finished and merged.finish_reason is FinishReason.MAX_TOKENS
    assert (merged.usage, merged.seed, merged.session_id, merged.session_tokens) == (
        Usage(3, 3, 1),
        9,
        "s",
        6,
    )


def test_merge_is_associative_and_one_output_is_itself() -> None:
    outs = outputs()
    assert merge_outputs(outs[0]) is outs[0]
    assert merge_outputs(merge_outputs(*outs[:2]), merge_outputs(*outs[2:])) == merge_outputs(*outs)
    with pytest.raises(ValueError):
        merge_outputs()


def test_collect_is_the_merge_as_a_result() -> None:
    result, merged = collect(outputs()), merge_outputs(*outputs())
    assert (result.token_ids, result.text, result.logprobs) == (
        merged.token_ids,
        merged.text,
        merged.logprobs,
    )
    assert result.finish_reason is FinishReason.MAX_TOKENS and result.seed == 9
