"""Structured-output grammars (guidance/constraints.py) on the tiny "bytes" tokenizer.

No model here: "logits" come from a seeded generator, so every test walks the
masks the way the engine does (mask → pick → consume) without ONNX Runtime.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import jsonschema
import numpy as np
import pytest
import tokenizers

from genai_common.errors import InvalidArgument
from genai_service.contract.request import Constraint
from genai_service.guidance.constraints import Guidance
from tests.tiny_model import BYTE_VOCAB_SIZE, EOS_ID, _tokenizer_json, encode_bytes

TOKENIZER = tokenizers.Tokenizer.from_str(_tokenizer_json(False, "bytes"))


@pytest.fixture(scope="module")
def guidance() -> Guidance:
    return Guidance(TOKENIZER, BYTE_VOCAB_SIZE, [EOS_ID], max_constraint_bytes=4096)


def walk(guidance: Guidance, constraint: Constraint, seed: int, max_tokens: int = 400) -> str:
    """Generate under ``constraint`` from random logits: mask, argmax, consume."""
    rng = np.random.default_rng(seed)
    matcher = guidance.matcher(constraint)
    out: list[int] = []
    for _ in range(max_tokens):
        allowed = guidance.masks([matcher])[0]
        logits = rng.standard_normal(BYTE_VOCAB_SIZE).astype(np.float32)
        token = int(np.argmax(np.where(allowed, logits, -np.inf)))
        assert allowed[token]
        assert matcher.consume_token(token), matcher.get_error()
        if token == EOS_ID:
            break
        out.append(token)
        if matcher.is_stopped():
            break
    assert matcher.is_accepting() or matcher.is_stopped()
    return TOKENIZER.decode(out)


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("seed", range(6))
def test_json_schema_output_validates(guidance: Guidance, seed: int) -> None:
    text = walk(guidance, Constraint("json_schema", json.dumps(PERSON)), seed)
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("seed", range(3))
def test_json_object_regex_and_choice(guidance: Guidance, seed: int) -> None:
    text = walk(guidance, Constraint("regex", r"[a-z]{2,5}-\d{3}"), seed)
    assert re.fullmatch(r"[a-z]{2,5}-\d{3}", text), text
    # Choices are JSON-quoted into the grammar: quotes, backslashes, newlines survive.
    choices = ('say "hi"', "back\\slash", "new\nline", "ünï ✓")
    assert walk(guidance, Constraint("choice", choices=choices), seed) in choices


def test_json_object_is_any_object_and_nothing_else(guidance: Guidance) -> None:
    matcher = guidance.matcher(Constraint("json_object"))
    assert matcher.validate_tokens(encode_bytes("[1]")) == 0
    assert matcher.consume_tokens(encode_bytes('{"a": [1, {"b": null}], "c": "d"}'))
    assert matcher.is_accepting()


def test_lark_and_gbnf_grammars(guidance: Guidance) -> None:
    lark = 'start: "yes" | "no"'
    gbnf = 'root ::= "yes" | "no"'
    for grammar in (lark, gbnf):
        assert walk(guidance, Constraint("grammar", grammar), 0) in ("yes", "no")


def test_a_forced_token_and_the_end(guidance: Guidance) -> None:
    matcher = guidance.matcher(Constraint("regex", "ok"))
    (allowed,) = guidance.masks([matcher])
    assert np.flatnonzero(allowed).tolist() == encode_bytes("o")  # exactly one token
    assert matcher.consume_tokens(encode_bytes("ok"))
    (allowed,) = guidance.masks([matcher])
    assert np.flatnonzero(allowed).tolist() == [EOS_ID]  # complete: only EOS
    assert matcher.is_stopped()


def test_masks_of_several_matchers_off_the_calling_thread(guidance: Guidance) -> None:
    a = SimpleNamespace(seq_id=7, matcher=guidance.matcher(Constraint("regex", "a+")))
    free = SimpleNamespace(seq_id=8, matcher=None)
    b = SimpleNamespace(seq_id=9, matcher=guidance.matcher(Constraint("regex", "b+")))
    assert guidance.start_step([free]) is None  # nothing constrained: no work
    future = guidance.start_step([a, free, b])  # type: ignore[list-item]
    assert future is not None
    masks = future.result(timeout=10)
    assert sorted(masks) == [7, 9]
    assert masks[7].shape == (BYTE_VOCAB_SIZE,) and masks[7].dtype == bool
    assert np.flatnonzero(masks[7]).tolist() == encode_bytes("a")
    assert np.flatnonzero(masks[9]).tolist() == encode_bytes("b")


def test_compiled_grammars_are_cached_and_each_request_gets_its_own_matcher() -> None:
    g = Guidance(TOKENIZER, BYTE_VOCAB_SIZE, [EOS_ID], max_constraint_bytes=4096, cache_entries=2)
    first = g.matcher(Constraint("regex", "ab"))
    second = g.matcher(Constraint("regex", "ab"))
    assert g.counters == {"grammars_compiled": 1, "grammar_cache_hits": 1}
    assert first.consume_tokens(encode_bytes("a"))
    # The second copy has not seen the first one's token.
    assert np.flatnonzero(g.masks([second])[0]).tolist() == encode_bytes("a")
    g.matcher(Constraint("regex", "c"))
    g.matcher(Constraint("regex", "d"))  # evicts "ab", the least recently used
    g.matcher(Constraint("regex", "ab"))
    assert g.counters["grammars_compiled"] == 4


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (Constraint("regex", "a(b"), "constraint.regex: at 1(8): invalid regex"),
        (Constraint("grammar", "start: foo"), 'constraint.grammar: at 1(8): unknown name: "foo"'),
        (
            Constraint("grammar", 'root ::= ( "a" '),
            "constraint.grammar: not a valid GBNF grammar: Expected ')' at line 1",
        ),
        (
            Constraint("json_schema", "{not json"),
            "constraint.json_schema: not valid JSON: Expecting property name enclosed in "
            "double quotes: line 1 column 2 (char 1)",
        ),
        (Constraint("json_schema", '{"type": "objectx"}'), "constraint.json_schema: Invalid type"),
        (
            Constraint("json_schema", "[1]"),
            "constraint.json_schema: a JSON Schema is an object or a boolean",
        ),
        (
            Constraint("json_schema", '{"properties": {"a": {"$ref": "#/nope"}}}'),
            "constraint.json_schema: Pointer '/nope' does not exist",
        ),
        (Constraint("regex", "x" * 4097), "constraint.regex: 4097 bytes; allowed at most 4096"),
        (
            Constraint("choice", choices=("é" * 2049, "b")),
            "constraint.choice: 4099 bytes; allowed at most 4096",
        ),
        (
            Constraint("choice", choices=("a",)),
            "constraint.choice.choices: 1 given; give at least 2",
        ),
        (
            Constraint("choice", choices=("a", "")),
            "constraint.choice.choices[1]: must not be empty",
        ),
        (Constraint("regex", ""), "constraint.regex: must not be empty"),
        (
            Constraint("xml", "<a/>"),
            "constraint: unknown kind 'xml'; allowed json_schema, regex, grammar, choice, "
            "json_object",
        ),
    ],
)
def test_invalid_constraints(guidance: Guidance, constraint: Constraint, message: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        guidance.matcher(constraint)
    assert err.value.message.startswith(message), err.value.message
    assert err.value.field_violation()[0].startswith("constraint")


def test_json_whitespace_runs_are_bounded_unless_the_schema_says_otherwise(
    guidance: Guidance,
) -> None:
    bounded = guidance.matcher(Constraint("json_object"))
    assert bounded.consume_tokens(encode_bytes("{" + " " * 12))
    assert bounded.validate_tokens(encode_bytes(" ")) == 0  # a 13th is not allowed
    assert bounded.validate_tokens(encode_bytes('"')) == 1
    compact = guidance.matcher(
        Constraint(
            "json_schema", '{"type": "object", "x-guidance": {"whitespace_flexible": false}}'
        )
    )
    assert compact.consume_tokens(encode_bytes("{"))
    assert compact.validate_tokens(encode_bytes(" ")) == 0
    free = guidance.matcher(
        Constraint(
            "json_schema", '{"type": "object", "x-guidance": {"whitespace_pattern": "[ ]{0,40}"}}'
        )
    )
    assert free.consume_tokens(encode_bytes("{" + " " * 40))


def test_boolean_schemas(guidance: Guidance) -> None:
    anything = guidance.matcher(Constraint("json_schema", "true"))
    assert anything.consume_tokens(encode_bytes("[1, 2]"))
    with pytest.raises(InvalidArgument) as err:
        guidance.matcher(Constraint("json_schema", "false"))
    assert err.value.message == "constraint.json_schema: false matches no JSON value"


def test_parser_messages_are_cut(guidance: Guidance) -> None:
    with pytest.raises(InvalidArgument) as err:
        guidance.matcher(Constraint("regex", "(" * 2000))
    assert len(err.value.message) <= len("constraint.regex: ") + 1024
    assert err.value.message.endswith("\u2026")
