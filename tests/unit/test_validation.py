"""Every invalid parameter gets INVALID_ARGUMENT with a message naming field, value, range."""

from __future__ import annotations

import pytest

from genai_common.errors import InvalidArgument
from genai_service.config import LimitsConfig
from genai_service.contract.request import GenerationRequest, SamplingParams, StoppingCriteria
from genai_service.engine.validation import validate_request

LIMITS = LimitsConfig(max_new_tokens_limit=100, default_max_new_tokens=10)


def check(request: GenerationRequest, history_len: int = 0) -> None:
    validate_request(
        request, vocab_size=50, context_length=16, history_len=history_len, limits=LIMITS
    )


def req(**kw) -> GenerationRequest:
    sampling = kw.pop("sampling", {})
    stopping = kw.pop("stopping", {})
    return GenerationRequest(
        kw.pop("request_id", "r"),
        kw.pop("prompt", (3, 4, 5)),
        sampling=SamplingParams(**sampling),
        stopping=StoppingCriteria(**stopping),
        **kw,
    )


def test_valid_request_passes() -> None:
    check(req(sampling=dict(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=2**64 - 1)))


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(prompt=()), "input: is empty; give text, token_ids or messages"),
        (dict(request_id=""), "request_id: must not be empty"),
        (dict(prompt=(1, 50)), "token_ids[1]: 50 is out of range; allowed [0, 49]"),
        (dict(prompt=(1, -1)), "token_ids[1]: -1 is out of range; allowed [0, 49]"),
        (
            dict(prompt=tuple(range(16))),
            "input: the prompt has 16 tokens; the context window is 16 tokens, so a prompt may "
            "have at most 15",
        ),
        (
            dict(sampling=dict(temperature=-0.5)),
            "sampling.temperature: -0.5 is out of range; allowed [0, 100]",
        ),
        (
            dict(sampling=dict(temperature=float("nan"))),
            "sampling.temperature: nan is not a finite number",
        ),
        (dict(sampling=dict(top_k=-1)), "sampling.top_k: -1 is out of range; allowed [0, 50]"),
        (dict(sampling=dict(top_k=51)), "sampling.top_k: 51 is out of range; allowed [0, 50]"),
        (dict(sampling=dict(top_p=0.0)), "sampling.top_p: 0.0 is out of range; allowed (0, 1]"),
        (dict(sampling=dict(top_p=1.5)), "sampling.top_p: 1.5 is out of range; allowed (0, 1]"),
        (dict(sampling=dict(min_p=1.1)), "sampling.min_p: 1.1 is out of range; allowed [0, 1]"),
        (
            dict(sampling=dict(repetition_penalty=0.0)),
            "sampling.repetition_penalty: 0.0 is out of range; allowed (0, 10]",
        ),
        (
            dict(sampling=dict(frequency_penalty=2.5)),
            "sampling.frequency_penalty: 2.5 is out of range; allowed [-2, 2]",
        ),
        (
            dict(sampling=dict(presence_penalty=-3.0)),
            "sampling.presence_penalty: -3.0 is out of range; allowed [-2, 2]",
        ),
        (
            dict(sampling=dict(seed=-1)),
            "sampling.seed: -1 is out of range; allowed [0, 18446744073709551615]",
        ),
        (
            dict(stopping=dict(max_new_tokens=0)),
            "stopping.max_new_tokens: 0 is out of range; allowed [1, 100]",
        ),
        (
            dict(stopping=dict(max_new_tokens=101)),
            "stopping.max_new_tokens: 101 is out of range; allowed [1, 100]",
        ),
        (
            dict(stopping=dict(min_new_tokens=11)),
            "stopping.min_new_tokens: 11 is out of range; allowed [0, 10]",
        ),
        (
            dict(stopping=dict(stop_sequences=("",))),
            "stopping.stop_sequences[0]: must not be empty",
        ),
        (
            dict(stopping=dict(stop_sequences=("x",) * 17)),
            "stopping.stop_sequences: 17 given; allowed at most 16",
        ),
        (
            dict(stopping=dict(stop_sequences=("x" * 257,))),
            "stopping.stop_sequences[0]: 257 characters; allowed at most 256",
        ),
        (
            dict(stopping=dict(stop_token_ids=(0, 50))),
            "stopping.stop_token_ids[1]: 50 is out of range; allowed [0, 49]",
        ),
        (
            dict(stopping=dict(stop_token_ids=(1,) * 65)),
            "stopping.stop_token_ids: 65 given; allowed at most 64",
        ),
        (
            dict(stopping=dict(time_limit_ms=0)),
            "stopping.time_limit_ms: 0 is out of range; allowed [1, 3600000]",
        ),
        (dict(top_logprobs=21), "top_logprobs: 21 is out of range; allowed [0, 20]"),
        (dict(top_logprobs=-1), "top_logprobs: -1 is out of range; allowed [0, 20]"),
        (dict(cache_salt="s" * 257), "cache_salt: 257 characters; allowed 1 to 256"),
        (dict(cache_salt=""), "cache_salt: 0 characters; allowed 1 to 256"),
    ],
)
def test_invalid_parameters(kw: dict, message: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        check(req(**kw))
    assert err.value.message == message
    assert err.value.code == "INVALID_ARGUMENT"


def test_session_history_counts_toward_the_context_window() -> None:
    with pytest.raises(InvalidArgument) as err:
        check(req(prompt=(1, 2, 3)), history_len=13)
    assert err.value.message == (
        "input: the prompt has 16 tokens (13 in the session history + 3 new); "
        "the context window is 16 tokens, so a prompt may have at most 15"
    )
