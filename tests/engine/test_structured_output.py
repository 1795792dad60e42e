"""Structured output through the engine on the tiny "bytes" models (one token per
byte, fp32): JSON schema, regex, choice and grammar constraints, greedy and
seeded sampling, speculation, sessions, logprobs and admission errors."""

from __future__ import annotations

import json
import re
import time
from dataclasses import replace
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from genai_common.errors import InvalidArgument
from genai_service.config import EngineConfig, SpeculationConfig
from genai_service.contract.request import (
    Constraint,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
)
from genai_service.engine.engine import LLMEngine
from tests.tiny_model import EOS_ID, encode_bytes, encode_words

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "pet": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        "home": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 5}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "pet", "home"],
    "additionalProperties": False,
}
# Compact JSON: the tiny model's random weights would otherwise wander in whitespace.
COMPACT = {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}


def engine(model_dir: Path, speculate: int = 0) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model_dir=str(model_dir), speculation=SpeculationConfig(num_tokens=speculate))
    )


def request(
    rid: str,
    constraint: Constraint | None,
    *,
    prompt: str = "Answer in JSON: ",
    max_new_tokens: int = 200,
    **fields: object,
) -> GenerationRequest:
    stopping = fields.pop("stopping", StoppingCriteria(max_new_tokens=max_new_tokens))
    return GenerationRequest(
        rid,
        tuple(encode_bytes(prompt)),
        stopping=stopping,  # type: ignore[arg-type]
        constraint=constraint,
        **fields,  # type: ignore[arg-type]
    )


SAMPLED = [SamplingParams()] + [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 3)]


@pytest.mark.parametrize("kind", ["rope", "gqa"])
def test_json_schema_answers_validate_greedy_and_sampled(
    kind: str, bytes_models: dict[str, Path]
) -> None:
    eng = engine(bytes_models[kind])
    reqs = [
        request(f"r{i}", Constraint("json_schema", json.dumps(COMPACT)), sampling=p)
        for i, p in enumerate(SAMPLED)
    ]
    results = eng.run_to_completion(reqs)
    for rid, result in results.items():
        assert result.finish_reason is FinishReason.EOS_TOKEN, (rid, result.text)
        jsonschema.validate(json.loads(result.text), SCHEMA)
    # Greedy and three seeds: not all the same answer (the masks do not fix the text).
    assert len({r.text for r in results.values()}) > 1


def test_regex_choice_grammar_and_json_object(bytes_models: dict[str, Path]) -> None:
    eng = engine(bytes_models["rope"])
    choices = ("red", "green", 'say "hi"')
    reqs = [
        request("regex", Constraint("regex", r"[a-z]{3,6}-\d{2}")),
        request("choice", Constraint("choice", choices=choices), sampling=SAMPLED[1]),
        request("gbnf", Constraint("grammar", 'root ::= "yes" | "no" | "maybe"')),
        request("lark", Constraint("grammar", 'start: "n=" /[0-9]{1,3}/')),
        request(
            "object",
            Constraint("json_schema", '{"type": "object", "maxProperties": 0}'),
        ),
    ]
    out = eng.run_to_completion(reqs)
    assert re.fullmatch(r"[a-z]{3,6}-\d{2}", out["regex"].text)
    assert out["choice"].text in choices
    assert out["gbnf"].text in ("yes", "no", "maybe")
    assert re.fullmatch(r"n=[0-9]{1,3}", out["lark"].text)
    assert json.loads(out["object"].text) == {}
    for result in out.values():
        assert result.finish_reason is FinishReason.EOS_TOKEN


def test_masks_win_over_the_model_and_the_rows_do_not_mix(bytes_models: dict[str, Path]) -> None:
    eng = engine(bytes_models["rope"])
    # Nearly greedy: the model's own first token has probability ~1.
    sharp = SamplingParams(temperature=0.01, seed=7)
    free = eng.generate(request("free", None, max_new_tokens=8, sampling=sharp))
    first = chr(free.token_ids[0] - 3)  # the "bytes" tokenizer: token 3 + b
    other = "x" if first != "x" else "y"
    forced = request("forced", Constraint("regex", f"{other}{{3}}"), sampling=sharp)
    both = eng.run_to_completion([forced, request("free2", None, max_new_tokens=8, sampling=sharp)])
    assert both["forced"].text == other * 3  # one token allowed at each step
    assert both["forced"].token_ids == tuple(encode_bytes(other * 3))  # no EOS: it ended there
    # The unconstrained row of the same batch is what it was alone.
    assert both["free2"].token_ids == free.token_ids


def test_a_complete_constraint_ends_even_with_ignore_eos_or_min_new_tokens(
    bytes_models: dict[str, Path],
) -> None:
    eng = engine(bytes_models["rope"])
    for stopping in (
        StoppingCriteria(max_new_tokens=50, ignore_eos=True),
        StoppingCriteria(max_new_tokens=50, min_new_tokens=20),
    ):
        result = eng.generate(
            request("r", Constraint("json_schema", '{"type": "boolean"}'), stopping=stopping)
        )
        assert result.text in ("true", "false")
        assert result.finish_reason is FinishReason.EOS_TOKEN
    # A grammar that may go on ends where the model picks EOS, the only
    # other allowed token; with ignore_eos that EOS is the last token.
    result = eng.generate(
        request(
            "digits",
            Constraint("regex", r"[0-9]{1,4}"),
            stopping=StoppingCriteria(max_new_tokens=50, ignore_eos=True),
        )
    )
    assert re.fullmatch(r"[0-9]{1,4}", result.text)
    assert result.finish_reason is FinishReason.EOS_TOKEN
    if len(result.text) < 4:
        assert result.token_ids[-1] == EOS_ID


def test_cut_short_it_is_a_prefix_and_says_why(bytes_models: dict[str, Path]) -> None:
    result = engine(bytes_models["rope"]).generate(
        request("r", Constraint("json_schema", json.dumps(COMPACT)), max_new_tokens=5)
    )
    assert result.finish_reason is FinishReason.MAX_TOKENS
    assert len(result.token_ids) == 5 and result.text.startswith('{"')


def test_logprobs_are_those_of_the_raw_distribution(bytes_models: dict[str, Path]) -> None:
    eng = engine(bytes_models["rope"])
    free = eng.generate(request("free", None, max_new_tokens=1, top_logprobs=5))
    forced = eng.generate(
        request("json", Constraint("json_object"), max_new_tokens=1, top_logprobs=5)
    )
    assert forced.text == "{"
    # Same step, same raw distribution: the same alternatives and values.
    assert forced.logprobs[0].top == free.logprobs[0].top
    raw = {t.token_id: t.logprob for t in free.logprobs[0].top}
    if forced.token_ids[0] in raw:
        assert forced.logprobs[0].logprob == pytest.approx(raw[forced.token_ids[0]])
    assert forced.logprobs[0].logprob <= free.logprobs[0].logprob


@pytest.mark.parametrize("kind", ["rope", "gqa"])
def test_the_same_tokens_with_speculation(kind: str, bytes_models: dict[str, Path]) -> None:
    # The prompt holds the kind of text the answer is, so prompt lookup drafts.
    prompt = '{"name":"bob","age":7,"pet":"cat","home":{"city":"rome"}} again: '
    reqs = [
        request("json", Constraint("json_schema", json.dumps(COMPACT)), prompt=prompt),
        request(
            "json-sampled",
            Constraint("json_schema", json.dumps(COMPACT)),
            prompt=prompt,
            sampling=SAMPLED[2],
        ),
        request("choice", Constraint("choice", choices=("rome", "romeo")), prompt=prompt),
    ]
    plain = engine(bytes_models[kind]).run_to_completion(reqs)
    spec_engine = engine(bytes_models[kind], speculate=4)
    spec = {r.request_id: spec_engine.generate(r) for r in reqs}  # one at a time: drafts
    for rid in plain:
        assert spec[rid].token_ids == plain[rid].token_ids, rid
    assert spec_engine.counters["spec_draft_tokens"] > 0


def test_a_constraint_applies_to_its_own_session_turn(bytes_models: dict[str, Path]) -> None:
    eng = engine(bytes_models["rope"])
    sid = eng.create_session().session_id
    t1 = eng.generate(request("t1", None, max_new_tokens=6, session_id=sid))
    t2 = eng.generate(
        request("t2", Constraint("choice", choices=("up", "down")), prompt=" Dir? ", session_id=sid)
    )
    assert t2.text in ("up", "down")
    assert t2.usage.cached_tokens > 0  # the history was reused, not matched
    t3 = eng.generate(request("t3", None, prompt=" More: ", max_new_tokens=6, session_id=sid))
    assert t3.finish_reason is FinishReason.MAX_TOKENS  # free text again
    history = (
        len(encode_bytes("Answer in JSON: "))
        + len(t1.token_ids)
        + len(encode_bytes(" Dir? "))
        + len(t2.token_ids)
        + len(encode_bytes(" More: "))
        + len(t3.token_ids)
    )
    assert t3.session_tokens == history


def test_invalid_constraints_are_refused_before_any_token(
    bytes_models: dict[str, Path], tiny_model_dir: Path
) -> None:
    eng = engine(bytes_models["rope"])
    # A grammar compiles on the compiler thread: its error is the request's one output.
    eng.add_request(request("bad", Constraint("regex", "a(b")))
    outputs = []
    while eng.has_unfinished():
        outputs.extend(eng.step())
    (out,) = outputs
    assert out.finished and not out.token_ids
    assert isinstance(out.error, InvalidArgument)
    assert re.match(r"(?s)^constraint\.regex: .*unclosed group", out.error.message)
    config = EngineConfig(model_dir=str(bytes_models["rope"]))
    small = LLMEngine(replace(config, limits=replace(config.limits, max_constraint_bytes=10)))
    with pytest.raises(InvalidArgument) as err:
        small.add_request(request("big", Constraint("regex", "a" * 11)))
    assert err.value.message == "constraint.regex: 11 bytes; allowed at most 10"
    # The "words" tiny model's tokenizer has no decoder: llguidance cannot read it.
    words = LLMEngine(EngineConfig(model_dir=str(tiny_model_dir)))
    with pytest.raises(InvalidArgument) as err:
        words.add_request(
            GenerationRequest(
                "w", tuple(encode_words("the cat")), constraint=Constraint("regex", "a")
            )
        )
    assert err.value.message.startswith(
        "constraint: this model's tokenizer cannot be used for structured output (llguidance:"
    )
    free = words.generate(GenerationRequest("ok", tuple(encode_words("the cat"))))
    assert free.token_ids and np.all(np.asarray(free.token_ids) >= 0)


@pytest.mark.parametrize("kind", ["rope", "gqa"])
def test_the_greedy_masked_argmax_picks_what_the_sampler_picks(
    kind: str, bytes_models: dict[str, Path]
) -> None:
    # top_logprobs sends a greedy constrained row through the sampler; without it the
    # engine takes a masked argmax. Both must choose the same tokens.
    eng = engine(bytes_models[kind])
    schema = Constraint("json_schema", json.dumps(COMPACT))
    fast = eng.generate(request("fast", schema))
    full = eng.generate(request("full", schema, top_logprobs=1))
    assert fast.token_ids == full.token_ids
    spec = engine(bytes_models[kind], speculate=4)
    assert spec.generate(request("spec", schema)).token_ids == fast.token_ids


def test_a_matcher_that_fails_mid_generation_ends_only_its_request(
    bytes_models: dict[str, Path],
) -> None:
    # After one free byte the grammar forces "a" without end: llguidance gives up
    # (its forced-token limit) at the second token, inside the batch's step.
    eng = engine(bytes_models["rope"])
    endless = Constraint("grammar", 'start: /[bc]/ rest\nrest: "a" rest')
    eng.add_request(request("endless", endless))
    eng.add_request(
        request("free", None, stopping=StoppingCriteria(max_new_tokens=12, ignore_eos=True))
    )
    outputs: dict[str, list] = {"endless": [], "free": []}
    # The grammar compiles on the compiler thread: bound the wait by time, not by
    # steps alone (idle steps spin past in microseconds on a slow machine).
    deadline = time.monotonic() + 30.0
    for _ in range(20_000):
        if not eng.has_unfinished() or time.monotonic() > deadline:
            break
        for out in eng.step():
            outputs[out.request_id].append(out)
        if eng.last_step_idle:
            time.sleep(0.01)
    bad = outputs["endless"][-1]
    assert bad.finished and isinstance(bad.error, InvalidArgument)
    assert bad.error.message.startswith(
        "constraint.grammar: llguidance stopped matching it at generated token "
    )
    assert "Too many items" in bad.error.message
    emitted = [t for out in outputs["endless"] for t in out.token_ids]
    assert emitted and all(t in encode_bytes("bc") for t in emitted[:1])
    free = [t for out in outputs["free"] for t in out.token_ids]
    assert outputs["free"][-1].finished and outputs["free"][-1].error is None
    assert len(free) == 12
