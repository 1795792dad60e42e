"""The shape limits of a structured-output constraint, checked in plain Python
before anything compiles it (docs/design.md, "Structured output").

llguidance compiles a grammar recursively (a chain of rules or of ``$ref``s
nests its stack once per link) and expands counted repetitions of regexes into
lexer states (``(a{1000}){1000}`` is a million of them: hundreds of MB, then
"too many expressions constructed" at the first token). These limits refuse
such shapes at once with a message naming the limit; whatever else a compiler
might still choke on is caught by the constraint checker's process
(``constraint_check``), where a crash costs only the one request.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from genai_common.errors import InvalidArgument

MAX_CHOICES = 100_000  # choices in one Constraint.choice
# The largest product of counted repetitions nested in one another in a regex
# (``a{1,100000}``: 100,000; ``(a{100}){1000}``: 100,000).
MAX_REGEX_REPETITION = 100_000
MAX_REF_CHAIN = 256  # $ref hops one after another in a JSON Schema
MAX_GRAMMAR_RULES = 10_000  # rule definitions in a Lark or GBNF grammar

_QUANTIFIER = re.compile(r"\{(\d+)(,(\d*))?\}")
_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w.-]*[ \t]*(?::|::=)", re.MULTILINE)


def regex_repetition(pattern: str) -> int:
    """The largest product of counted repetitions (``{m}``, ``{m,}``, ``{m,n}``)
    nested in one another in ``pattern``; 1 without any. ``{m,}`` counts ``m``
    (its tail is a star). Escapes and character classes are skipped; a brace
    that is not a quantifier is a literal, as in Rust's regex syntax."""
    frames = [1]  # per open group: the largest product inside it so far
    last = 1  # the weight of the atom just read (what a quantifier multiplies)
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            # \x{..}, \u{..}, \p{..}, \P{..} carry a braced part.
            if i + 2 < n and pattern[i + 1] in "xupP" and pattern[i + 2] == "{":
                close = pattern.find("}", i + 3)
                i = n if close < 0 else close + 1
            else:
                i += 2
            last = 1
        elif c == "[":
            i = _class_end(pattern, i)
            last = 1
        elif c == "(":
            frames.append(1)
            i += 1
            last = 1
        elif c == ")":
            last = frames.pop() if len(frames) > 1 else 1
            frames[-1] = max(frames[-1], last)
            i += 1
        elif c == "{" and (m := _QUANTIFIER.match(pattern, i)):
            upper = m.group(3)
            count = int(upper) if upper else int(m.group(1))
            last *= max(count, 1)
            frames[-1] = max(frames[-1], last)
            i = m.end()
        else:
            if c not in "*+?":  # a literal, '|', '^', '$', '.': a new atom of weight 1
                last = 1
            i += 1
    return max(frames)


def _class_end(pattern: str, i: int) -> int:
    """The index after the character class that opens at ``pattern[i]`` ('['),
    nested classes (``[a-z&&[^aeiou]]``, ``[[:alpha:]]``) included."""
    depth, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "[":
            depth += 1
            i += 1
            if i < n and pattern[i] == "^":
                i += 1
            if i < n and pattern[i] == "]":
                i += 1  # a ']' first in a class is a literal
        elif c == "\\":
            i += 2
        elif c == "]":
            depth -= 1
            i += 1
            if depth == 0:
                return i
        else:
            i += 1
    return n


def check_regex(field: str, pattern: str, what: str = "its") -> None:
    """``what``: whose repetitions the message names ("its", "a pattern's")."""
    bound = regex_repetition(pattern)
    if bound > MAX_REGEX_REPETITION:
        raise InvalidArgument(
            f"{field}: {what} counted repetitions (nested ones multiplied) expand to {bound} "
            f"copies; allowed at most {MAX_REGEX_REPETITION}"
        )


def check_grammar(field: str, grammar: str) -> None:
    rules = len(_RULE.findall(grammar))
    if rules > MAX_GRAMMAR_RULES:
        raise InvalidArgument(f"{field}: {rules} rules; allowed at most {MAX_GRAMMAR_RULES}")


def check_schema(field: str, schema: Any) -> None:
    """The regexes of a parsed JSON Schema (``pattern``, ``patternProperties``)
    and the length of its longest chain of local ``$ref``s."""
    for node in _nodes(schema):
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            check_regex(field, pattern, "a pattern's")
        props = node.get("patternProperties")
        if isinstance(props, dict):
            for key in props:
                check_regex(field, key, "a patternProperties key's")
    chain = ref_chain(schema)
    if chain > MAX_REF_CHAIN:
        raise InvalidArgument(
            f"{field}: a chain of {chain} $refs, each leading to the next; "
            f"allowed at most {MAX_REF_CHAIN}"
        )


def _nodes(root: Any) -> Iterator[dict[str, Any]]:
    """Every object in ``root``, depth first, without recursion."""
    stack = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            yield node
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _resolve(root: Any, ref: str) -> Any:
    """The node a local ``$ref`` (``#``, ``#/$defs/a``, ...) points at; None if none."""
    if not ref.startswith("#"):
        return None  # remote references are not followed (llguidance refuses them)
    node = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def ref_chain(schema: Any) -> int:
    """The most local ``$ref`` hops one after another from the schema's root
    (a ref inside what another ref points at is the next hop). A cycle (a
    recursive schema, which llguidance expands lazily) counts each link once."""
    refs_in: dict[str, list[str]] = {}

    def refs(ref: str) -> list[str]:
        if ref not in refs_in:
            node = schema if ref == "#" else _resolve(schema, ref)
            found = {n["$ref"] for n in _nodes(node) if isinstance(n.get("$ref"), str)}
            refs_in[ref] = sorted(found)
        return refs_in[ref]

    # Longest path from "#" over the ref graph, iteratively; an edge back into
    # a ref still being explored (a cycle) ends that path.
    longest: dict[str, int] = {}
    open_refs: set[str] = {"#"}
    stack: list[tuple[str, Iterator[str]]] = [("#", iter(refs("#")))]
    best: dict[str, int] = {"#": 0}
    while stack:
        ref, children = stack[-1]
        child = next(children, None)
        if child is None:
            stack.pop()
            open_refs.discard(ref)
            longest[ref] = best[ref]
            if stack:
                parent = stack[-1][0]
                best[parent] = max(best[parent], 1 + longest[ref])
            continue
        if child in longest:
            best[ref] = max(best[ref], 1 + longest[child])
        elif child in open_refs:
            best[ref] = max(best[ref], 1)
        else:
            open_refs.add(child)
            best[child] = 0
            stack.append((child, iter(refs(child))))
    return longest["#"]
