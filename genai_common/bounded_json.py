"""JSON from clients, parsed with a bound on nesting (docs/design.md, "Structured output").

Python's ``json`` recurses once per nesting level and fails with
``RecursionError`` somewhere near the interpreter's recursion limit, which
depends on how deep the caller already is; what is nested that deep then goes
on to code (llguidance's compiler, a chat template) that recurses too. So every
client-supplied JSON document (a schema, a tool's parameters, a tool call's
arguments, an HTTP body) is parsed here: nested deeper than the bound, it is
``INVALID_ARGUMENT`` naming the field, its depth and the bound.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from .errors import InvalidArgument

# Levels of arrays and objects in one document: serde_json's default recursion
# limit, which llguidance's own JSON reader enforces too.
MAX_JSON_DEPTH = 128

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_OPEN = np.zeros(256, dtype=np.int8)
_OPEN[[ord("["), ord("{")]] = 1
_OPEN[[ord("]"), ord("}")]] = -1


def nesting_depth(text: str | bytes) -> int:
    """The deepest nesting of arrays and objects in JSON ``text`` (brackets
    inside strings do not count; the text need not be valid JSON)."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    brackets = np.frombuffer(_STRING.sub(b'""', data), dtype=np.uint8)
    if not brackets.size:
        return 0
    return max(0, int(np.cumsum(_OPEN[brackets], dtype=np.int64).max()))


def loads(text: str | bytes, field: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads(text)``; ``INVALID_ARGUMENT`` naming ``field`` for text
    that is not JSON or nests more than ``max_depth`` levels."""
    depth = nesting_depth(text)
    if depth > max_depth:
        raise InvalidArgument(
            f"{field}: JSON nested {depth} levels deep; allowed at most {max_depth}"
        )
    try:
        return json.loads(text)
    except RecursionError as e:  # only when the caller is itself deep in the stack
        raise InvalidArgument(
            f"{field}: JSON nested {depth} levels deep; allowed at most {max_depth}"
        ) from e
    except ValueError as e:  # also UnicodeDecodeError of bytes that are not UTF-8
        raise InvalidArgument(f"{field}: not valid JSON: {e}") from e
