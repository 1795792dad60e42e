"""StopStringMatcher: no partial stop string is ever streamed, however text is split."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from genai_service.engine.text.stops import StopStringMatcher


def partial_stop_suffix(text: str, stops: Sequence[str]) -> str:
    """The longest suffix of ``text`` that is a proper prefix of some stop."""
    for k in range(min(len(text), max(map(len, stops), default=1) - 1), 0, -1):
        if any(len(s) > k and s.startswith(text[-k:]) for s in stops):
            return text[-k:]
    return ""


def run(
    stops: Sequence[str], chunks: Sequence[str], include: bool = False
) -> tuple[list[str], str | None]:
    """Feed ``chunks`` until a match; return the streamed pieces (flush included) and the stop.

    Checks after every feed that exactly the partial-stop tail is held back:
    streamed text never ends with something a later chunk could complete.
    """
    matcher = StopStringMatcher(stops, include_stop_sequence=include)
    out: list[str] = []
    fed = ""
    for chunk in chunks:
        fed += chunk
        text, matched = matcher.feed(chunk)
        out.append(text)
        if matched is not None:
            assert matcher.matched == matched
            return out, matched
        streamed = "".join(out)
        assert fed.startswith(streamed)
        assert fed[len(streamed) :] == partial_stop_suffix(fed, stops)
    out.append(matcher.flush())
    assert "".join(out) == fed
    return out, None


def splits(text: str, cuts: Sequence[int]) -> list[str]:
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def reference(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """Text before the first stop to complete (ties: the longest), reading char by char."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            stop = max(ending, key=len)
            return text[: end - len(stop)], stop
    return text, None


def test_no_stops_passes_text_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("hello ") == ("hello ", None)
    assert matcher.feed("wor") == ("wor", None)
    assert matcher.flush() == ""


@pytest.mark.parametrize("include", [False, True])
def test_stop_split_at_every_boundary(include: bool) -> None:
    text, stop = "The answer is 42.\nUser: hi", "\nUser:"
    before = text[: text.index(stop)]
    expected = before + stop if include else before
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            pieces, matched = run([stop], [text[:i], text[i:j], text[j:]], include)
            assert matched == stop
            assert "".join(pieces) == expected
            # Before the match, nothing of the stop was streamed.
            assert before.startswith("".join(pieces[:-1]))


def test_holdback_is_released_when_it_stops_matching() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("go ST") == ("go ", None)
    assert matcher.feed("O") == ("", None)
    assert matcher.feed("P") == ("", "STOP")
    with pytest.raises(RuntimeError):
        matcher.feed("more")
    assert matcher.flush() == ""

    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("go STO") == ("go ", None)
    assert matcher.feed("RM") == ("STORM", None)


def test_flush_releases_held_tail_without_match() -> None:
    matcher = StopStringMatcher(["</s>", "###"])
    assert matcher.feed("a <") == ("a ", None)
    assert matcher.feed("/") == ("", None)
    assert matcher.flush() == "</"
    assert matcher.flush() == ""
    assert matcher.matched is None


def test_overlapping_prefixes() -> None:
    # A held "ab" that turns out not to start the stop is released, while its
    # own tail may start it again ("aba" releases "ab", holds "a").
    assert run(["abc"], ["ab", "abc", "def"]) == (["", "ab"], "abc")
    assert run(["abc"], list("ababc")) == (["", "", "ab", "", ""], "abc")
    assert run(["aab"], list("aaab")) == (["", "", "a", ""], "aab")
    assert run(["abab"], ["aba", "bab"]) == (["", ""], "abab")


def test_earliest_stop_wins_across_chunks() -> None:
    # "END" completes first even though "STOP" is earlier in the list.
    assert run(["STOP", "END"], ["x EN", "D y STOP"]) == (["x ", ""], "END")
    assert run(["STOP", "END"], ["x STOP END"]) == (["x "], "STOP")


def test_same_end_prefers_longest() -> None:
    assert run(["c", "abc", "bc"], ["xab", "c"]) == (["x", ""], "abc")
    assert run(["c", "abc", "bc"], ["xabc"], include=True) == (["xabc"], "abc")


def test_first_completed_stop_wins() -> None:
    # "bc" is complete before "abcd" could be: the engine stops right there,
    # whether the text came in one chunk or many.
    assert run(["abcd", "bc"], ["xabcd"]) == (["xa"], "bc")
    assert run(["abcd", "bc"], list("xabcd")) == (["x", "", "", "a"], "bc")


def test_include_stop_sequence() -> None:
    assert run(["\n\n"], ["para one\n", "\npara two"], include=True) == (
        ["para one", "\n\n"],
        "\n\n",
    )


def test_rejects_empty_stop() -> None:
    with pytest.raises(ValueError, match="empty"):
        StopStringMatcher(["ok", ""])


def test_only_a_short_tail_is_held() -> None:
    matcher = StopStringMatcher(["<|im_end|>"])
    assert matcher.feed("<|im_e") == ("", None)
    for _ in range(1000):
        # Each chunk releases the previous one: it was not followed by "nd|>".
        assert matcher.feed("<|im_e") == ("<|im_e", None)
    assert matcher.flush() == "<|im_e"


alphabet = st.sampled_from(list("abc xy\n😀é"))
stop_strategy = st.text(alphabet, min_size=1, max_size=4)


@settings(max_examples=50, deadline=None)
@given(
    head=st.text(alphabet, max_size=20),
    stop=stop_strategy,
    tail=st.text(alphabet, max_size=10),
    cuts=st.lists(st.integers(0, 40), max_size=8),
    include=st.booleans(),
)
def test_inserted_stop_property(
    head: str, stop: str, tail: str, cuts: list[int], include: bool
) -> None:
    text = head + stop + tail
    expected, matched = reference(text, [stop])
    assert matched == stop  # the inserted stop, or an earlier occurrence of it
    pieces, got = run([stop], splits(text, cuts), include)
    assert got == stop
    assert "".join(pieces) == (expected + stop if include else expected)
    assert expected.startswith("".join(pieces[:-1]))


@settings(max_examples=50, deadline=None)
@given(
    text=st.text(alphabet, max_size=30),
    stops=st.lists(stop_strategy, min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 40), max_size=8),
)
def test_split_invariance_with_several_stops(text: str, stops: list[str], cuts: list[int]) -> None:
    expected, matched = reference(text, stops)
    pieces, got = run(stops, splits(text, cuts))
    assert (("".join(pieces)), got) == (expected, matched)
    # One chunk per character gives the same answer.
    pieces, got = run(stops, list(text))
    assert ("".join(pieces), got) == (expected, matched)
