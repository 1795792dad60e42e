"""The shape limits of constraints (guidance/constraint_limits.py), client JSON
parsed with a nesting bound (genai_common/bounded_json.py), and what the
checker's ``Guidance.check`` refuses before admission, on a byte tokenizer."""

from __future__ import annotations

import json

import pytest

from genai_common import bounded_json
from genai_common.errors import InvalidArgument
from genai_service.contract.request import Constraint
from genai_service.guidance import constraint_limits as limits
from genai_service.guidance.constraints import Guidance, constraint_digest, grammar_text
from tests.factories import BYTES_EOS_ID, bytes_tokenizer


@pytest.fixture(scope="module")
def guidance() -> Guidance:
    return Guidance(bytes_tokenizer(), 257, [BYTES_EOS_ID], max_constraint_bytes=1 << 20)


@pytest.mark.parametrize(
    ("pattern", "bound"),
    [
        ("a{1000000}", 1_000_000),
        ("(a{1000}){1000}", 1_000_000),
        ("a(a{1000}){1000}(z1)?", 1_000_000),
        ("(?:ab{10}){10,}", 100),  # {m,} counts m
        ("a{1,100000}", 100_000),
        ("(a|aa)*b{1000}", 1000),
        ("(a+)+$", 1),
        (r"\d{3}-\d{4}", 4),
        (r"\{9999999\}", 1),  # escaped braces are literals
        ("[{]{5}", 5),  # a brace in a class is a literal
        ("[]a{]{3}", 3),  # ']' first in a class is a literal
        ("[[:alpha:]]{7}", 7),
        (r"\p{L}{7}", 7),
        ("x{a}", 1),  # not a quantifier
        ("(a{10}|b{20}){30}", 600),
    ],
)
def test_regex_repetition_is_the_largest_nested_product(pattern: str, bound: int) -> None:
    assert limits.regex_repetition(pattern) == bound


def test_a_regex_past_the_repetition_limit_is_refused_with_the_limit() -> None:
    with pytest.raises(InvalidArgument) as err:
        grammar_text(Constraint("regex", "(a{1000}){1000}"))
    assert err.value.message == (
        "constraint.regex: its counted repetitions (nested ones multiplied) expand to 1000000 copies; "
        "allowed at most 100000"
    )
    schema = {"type": "string", "pattern": "a{1000000}"}
    with pytest.raises(InvalidArgument) as err:
        grammar_text(Constraint("json_schema", json.dumps(schema)))
    assert err.value.message.startswith("constraint.json_schema: a pattern's counted")
    assert err.value.field_violation()[0] == "constraint.json_schema"  # a path, for BadRequest


def chain(n: int) -> dict:
    defs = {
        f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
        for i in range(n)
    }
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def test_ref_chains_count_hops_and_cycles_once() -> None:
    assert limits.ref_chain(chain(950)) == 951
    assert limits.ref_chain({"type": "integer"}) == 0
    assert limits.ref_chain({"$ref": "#"}) == 1
    tree = {
        "properties": {"a": {"$ref": "#/$defs/t"}, "b": {"$ref": "#/$defs/t"}},
        "$defs": {"t": {"type": "array", "items": {"$ref": "#/$defs/t"}}},
    }
    assert limits.ref_chain(tree) == 2  # root -> t -> t (the cycle, once)
    with pytest.raises(InvalidArgument) as err:
        grammar_text(Constraint("json_schema", json.dumps(chain(950))))
    assert err.value.message == (
        "constraint.json_schema: a chain of 951 $refs, each leading to the next; "
        "allowed at most 256"
    )


def test_client_json_is_parsed_with_a_nesting_bound() -> None:
    assert bounded_json.nesting_depth('{"a": [1, {"b": "[[[[{{"}]}') == 3
    assert bounded_json.loads("[" * 128 + "]" * 128, "f") == json.loads("[" * 128 + "]" * 128)
    for depth in (129, 2_000, 100_000):
        with pytest.raises(InvalidArgument) as err:
            bounded_json.loads("[" * depth + "]" * depth, "tools[0].parameters_json_schema")
        assert err.value.message == (
            f"tools[0].parameters_json_schema: JSON nested {depth} levels deep; allowed at most 128"
        )
    with pytest.raises(InvalidArgument, match=r"^body: not valid JSON: "):
        bounded_json.loads(b"{\xff}", "body")
    schema = '{"type":"array","items":' * 2000 + '{"type":"integer"}' + "}" * 2000
    with pytest.raises(InvalidArgument, match=r"^constraint\.json_schema: JSON nested 2001 levels"):
        grammar_text(Constraint("json_schema", schema))


def test_choices_and_rules_have_limits(guidance: Guidance) -> None:
    many = Constraint("choice", choices=tuple(f"c{i}" for i in range(100_001)))
    with pytest.raises(InvalidArgument) as err:
        guidance.check(many)
    assert err.value.message == "constraint.choice.choices: 100001 given; allowed at most 100000"
    rules = "\n".join(["start: r0", *(f"r{i}: r{i + 1}" for i in range(10_001)), 'r10001: "a"'])
    with pytest.raises(InvalidArgument) as err:
        guidance.check(Constraint("grammar", rules))
    assert err.value.message == "constraint.grammar: 10003 rules; allowed at most 10000"


def test_thousands_of_choices_are_one_lexeme_and_match(guidance: Guidance) -> None:
    # As parser alternatives, 5,000 choices broke llguidance's 2,000 items per row.
    choices = tuple(f"c{i}" for i in range(5000))
    constraint = Constraint("choice", choices=choices)
    guidance.check(constraint)
    matcher = guidance.matcher(constraint)
    assert matcher.consume_tokens(list(b"c4321"))
    assert matcher.is_accepting()
    assert not matcher.try_consume_tokens(list(b"9"))  # c43219 is no choice


def test_the_checker_refuses_what_fails_at_the_first_tokens(guidance: Guidance) -> None:
    cases = {
        # A $ref cycle that never reaches a value.
        "json_schema": (json.dumps({"$ref": "#"}), "the grammar allows no text at all"),
        # Forced tokens without end.
        "grammar": ('start: "a" start', "Too many items"),
    }
    for kind, (text, part) in cases.items():
        with pytest.raises(InvalidArgument) as err:
            guidance.check(Constraint(kind, text))
        assert err.value.message.startswith(f"constraint.{kind}: llguidance stopped matching it")
        assert part in err.value.message
    cycle = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    with pytest.raises(InvalidArgument, match="allows no text at all"):
        guidance.check(Constraint("json_schema", json.dumps(cycle)))
    # What used to overflow the engine's 8 MiB stack compiles on the compiler thread.
    rules = "\n".join(["start: r0", *(f"r{i}: r{i + 1}" for i in range(3000)), 'r3000: "a"'])
    guidance.check(Constraint("grammar", rules))


def test_the_digest_tells_constraints_apart() -> None:
    a = constraint_digest(Constraint("choice", choices=("ab", "c")))
    b = constraint_digest(Constraint("choice", choices=("a", "bc")))
    assert a != b and len(a) == 16
    assert constraint_digest(Constraint("regex", "x")) != constraint_digest(
        Constraint("grammar", "x")
    )
