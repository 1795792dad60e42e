"""truncate_prompt_tokens (docs/design.md, "Context window"): a prompt longer than
it keeps its first --sink-tokens tokens and its last ones; the answer is the
model's answer to exactly the kept tokens; on the tiny "words" model."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from genai_common.errors import InvalidArgument
from genai_service.config import ContextConfig, EngineConfig
from genai_service.contract.request import GenerationRequest, StoppingCriteria
from genai_service.engine.engine import LLMEngine
from tests.tiny_model import encode_words, reference_greedy

PROMPT = encode_words(
    "the cat sat on the mat and the dog saw the big red box under the old tree by the house"
)


def request(rid: str, keep: int | None, ids: list[int] = PROMPT) -> GenerationRequest:
    return GenerationRequest(
        rid,
        tuple(ids),
        stopping=StoppingCriteria(max_new_tokens=6, ignore_eos=True),
        truncate_prompt_tokens=keep,
    )


@pytest.mark.parametrize("sinks", [0, 4])
def test_a_long_prompt_keeps_its_sinks_and_its_end(tiny_model_dir: Path, sinks: int) -> None:
    eng = LLMEngine(
        EngineConfig(model_dir=str(tiny_model_dir), context=ContextConfig(sink_tokens=sinks))
    )
    keep = 10
    assert len(PROMPT) > keep
    kept = PROMPT[:sinks] + PROMPT[len(PROMPT) - (keep - sinks) :]
    out = eng.generate(request("cut", keep))
    assert list(out.token_ids) == reference_greedy(tiny_model_dir, kept, 6)
    assert out.usage.prompt_tokens == keep
    assert out.usage.dropped_tokens == len(PROMPT) - keep
    # a prompt that fits is left as it is
    whole = eng.generate(request("whole", len(PROMPT)))
    assert whole.usage.dropped_tokens == 0
    assert list(whole.token_ids) == reference_greedy(tiny_model_dir, PROMPT, 6)
    # fewer tokens kept than sinks: all but one kept token are sinks
    tiny = eng.generate(request("tiny", 2))
    expected = PROMPT[: min(sinks, 1)] + PROMPT[len(PROMPT) - (2 - min(sinks, 1)) :]
    assert list(tiny.token_ids) == reference_greedy(tiny_model_dir, expected, 6)


def test_truncation_errors(tiny_model_dir: Path) -> None:
    eng = LLMEngine(EngineConfig(model_dir=str(tiny_model_dir)))
    with pytest.raises(InvalidArgument) as err:
        eng.add_request(request("zero", 0))
    assert err.value.message == "truncate_prompt_tokens: 0 is out of range; allowed >= 1"
    sid = eng.create_session().session_id
    with pytest.raises(InvalidArgument) as err:
        eng.add_request(replace(request("turn", 5), session_id=sid))
    assert err.value.message.startswith("truncate_prompt_tokens: not allowed on a session turn")
    # a prompt past the window stays INVALID_ARGUMENT without it, and fits with it
    long = PROMPT * 10
    assert len(long) >= eng.context_length
    with pytest.raises(InvalidArgument):
        eng.add_request(request("long", None, long))
    assert eng.generate(request("fits", 64, long)).usage.dropped_tokens == len(long) - 64
