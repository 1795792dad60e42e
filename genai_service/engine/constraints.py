"""Structured output with llguidance (docs/design.md, "Structured output").

A request's ``Constraint`` (JSON schema, regex, Lark/GBNF grammar, a list of
choices, or any JSON object) becomes an llguidance grammar; each constrained
sequence owns an ``llguidance.LLMatcher`` that has consumed exactly the tokens
it generated (never the prompt, a session's history or a reused prefix).
Before a token is chosen, the matcher's mask of allowed next tokens is applied
to the logits (``sampler.SamplingRow.allowed``); the chosen token is then
consumed. A matcher that has stopped (the grammar is complete and allows
nothing more) ends the request.

``Guidance`` is the per-model part, built once at engine start: the
``LLTokenizer`` (the model's tokenizer.json, its logits width and EOS ids), a
bounded cache of compiled grammars keyed by (kind, text) holding a pristine
matcher that each request copies (``deep_copy`` is microseconds, a compile
milliseconds), and an ``LLExecutor`` that fills a batch's masks with the GIL
released, so the engine can compute them while ONNX Runtime runs the step.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import llguidance
import numpy as np
import structlog
import tokenizers
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark
from llguidance.numpy import fill_next_token_bitmask_par

from genai_common.errors import Internal, InvalidArgument

from .request import Constraint

if TYPE_CHECKING:
    from .sequence import Sequence as Seq

log = structlog.get_logger(__name__)

KINDS = ("json_schema", "regex", "grammar", "choice", "json_object")
# Compiled grammars kept (each one pristine matcher, typically tens of KiB).
GRAMMAR_CACHE_ENTRIES = 64
# JSON output may put whitespace between tokens, at most this much per run: a
# small model sampling freely otherwise wanders into endless newlines before
# the next key. A schema's own "x-guidance" options take precedence.
JSON_DEFAULTS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,12}"}


# A parser's message quotes the input (often several times); this much is kept.
MAX_PARSER_MESSAGE_CHARS = 1024


def _short(message: str) -> str:
    message = message.strip()
    if len(message) <= MAX_PARSER_MESSAGE_CHARS:
        return message
    return message[: MAX_PARSER_MESSAGE_CHARS - 1] + "\u2026"


def constraint_size(constraint: Constraint) -> int:
    """Bytes of the constraint's text, as the size limit counts them."""
    return len(constraint.value.encode()) + sum(len(c.encode()) for c in constraint.choices)


def validate_shape(constraint: Constraint, max_bytes: int) -> None:
    """What can be checked without compiling: kind, size, choices."""
    kind = constraint.kind
    field = f"constraint.{kind}"
    if kind not in KINDS:
        raise InvalidArgument(f"constraint: unknown kind {kind!r}; allowed {', '.join(KINDS)}")
    size = constraint_size(constraint)
    if size > max_bytes:
        raise InvalidArgument(f"{field}: {size} bytes; allowed at most {max_bytes}")
    if kind == "choice":
        if len(constraint.choices) < 2:
            raise InvalidArgument(
                f"constraint.choice.choices: {len(constraint.choices)} given; give at least 2"
            )
        for i, choice in enumerate(constraint.choices):
            if not choice:
                raise InvalidArgument(f"constraint.choice.choices[{i}]: must not be empty")
    elif kind != "json_object" and not constraint.value:
        raise InvalidArgument(f"{field}: must not be empty")


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar (its JSON form) for a well-shaped constraint;
    ``InvalidArgument`` for text that does not even parse (e.g. a schema that
    is not JSON, a GBNF syntax error)."""
    kind, value = constraint.kind, constraint.value
    field = f"constraint.{kind}"
    matcher = llguidance.LLMatcher
    if kind == "json_schema":
        try:
            schema = json.loads(value)
        except ValueError as e:
            raise InvalidArgument(f"{field}: not valid JSON: {e}") from e
        if schema is False:
            raise InvalidArgument(f"{field}: false matches no JSON value")
        if schema is True:
            schema, value = {}, "{}"  # any JSON value
        if not isinstance(schema, dict):
            raise InvalidArgument(f"{field}: a JSON Schema is an object or a boolean")
        options = schema.get("x-guidance")
        if isinstance(options, dict) and any(k.startswith("whitespace") for k in options):
            return matcher.grammar_from_json_schema(value)  # the schema says how
        return matcher.grammar_from_json_schema(value, defaults=JSON_DEFAULTS)  # type: ignore[arg-type]
    if kind == "json_object":
        return matcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_DEFAULTS)  # type: ignore[arg-type]
    if kind == "regex":
        return matcher.grammar_from_regex(value)
    if kind == "choice":
        # JSON string literals are Lark string literals, escapes included.
        return matcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in constraint.choices)
        )
    try:
        return matcher.grammar_from_lark(any_to_lark(value))  # GBNF is converted
    except GbnfToLarkError as e:
        raise InvalidArgument(f"{field}: not a valid GBNF grammar: {_short(str(e))}") from e


class Guidance:
    """llguidance for one model: compile, validate and cache grammars, hand
    out matchers, fill masks. Used only on the engine's thread, except the
    mask filling it starts on its own worker."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        max_constraint_bytes: int,
        cache_entries: int = GRAMMAR_CACHE_ENTRIES,
    ) -> None:
        # vocab_size is the logits width: ids the tokenizer lacks are never allowed.
        # A tokenizer llguidance cannot read (e.g. WordLevel without a decoder:
        # the bytes of its tokens are unknown) serves free text only.
        self.tokenizer: llguidance.LLTokenizer | None = None
        self.unsupported = ""
        try:
            self.tokenizer = llguidance.LLTokenizer(
                tokenizer.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids)
            )
        except ValueError as e:
            self.unsupported = str(e)
            log.warning("structured_output_unavailable", reason=self.unsupported)
        self.vocab_size = vocab_size
        self.max_constraint_bytes = max_constraint_bytes
        self._cache_entries = cache_entries
        self._compiled: OrderedDict[tuple[str, str, tuple[str, ...]], llguidance.LLMatcher] = (
            OrderedDict()
        )
        self._executor = llguidance.LLExecutor(num_threads=1)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="guidance")
        self.counters = {"grammars_compiled": 0, "grammar_cache_hits": 0}

    def matcher(self, constraint: Constraint) -> llguidance.LLMatcher:
        """A fresh matcher for ``constraint``; ``InvalidArgument`` with the
        parser's message if it is invalid or over the limits."""
        key = (constraint.kind, constraint.value, constraint.choices)
        template = self._compiled.get(key)
        if template is not None:
            self._compiled.move_to_end(key)
            self.counters["grammar_cache_hits"] += 1
            return template.deep_copy()
        validate_shape(constraint, self.max_constraint_bytes)
        if self.tokenizer is None:
            raise InvalidArgument(
                f"constraint: this model's tokenizer cannot be used for structured output "
                f"(llguidance: {self.unsupported})"
            )
        field = f"constraint.{constraint.kind}"
        try:
            grammar = grammar_text(constraint)
        except ValueError as e:  # llguidance refusing the text before compiling it
            raise InvalidArgument(f"{field}: {_short(str(e))}") from e
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer
        )
        if is_error:
            raise InvalidArgument(f"{field}: {_short(messages[0])}")
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise InvalidArgument(f"{field}: {_short(template.get_error())}")
        self.counters["grammars_compiled"] += 1
        self._compiled[key] = template
        while len(self._compiled) > self._cache_entries:
            self._compiled.popitem(last=False)
        return template.deep_copy()

    def start_step(self, seqs: Sequence[Seq]) -> Future[dict[int, np.ndarray]] | None:
        """The next-token masks, by seq_id, of the constrained ones of ``seqs``
        (those about to pick a token), filled on the worker (llguidance
        releases the GIL) while the caller runs the model step: [vocab] bool
        arrays, True where a token is allowed. None when none is constrained."""
        constrained = [s for s in seqs if s.matcher is not None]
        if not constrained:
            return None
        ids = [s.seq_id for s in constrained]
        matchers = [s.matcher for s in constrained]
        return self._worker.submit(lambda: dict(zip(ids, self.masks(matchers), strict=True)))

    @staticmethod
    def consume(seq: Seq, token: int) -> bool:
        """Feed the picked ``token`` to ``seq``'s matcher; True when the
        constraint is now complete and allows nothing more, which ends the
        request; ``Internal`` when the matcher is in its error state."""
        matcher = seq.matcher
        if matcher is None:
            return False
        # A masked pick never fails; a matcher that broke (llguidance's limits,
        # a bug) fails its own request, never the engine.
        if not matcher.consume_token(token) or matcher.is_error():
            raise Internal(
                f"constraint: the matcher failed at token {token}: {_short(matcher.get_error())}"
            )
        return bool(matcher.is_stopped())

    def masks(self, matchers: Sequence[llguidance.LLMatcher]) -> np.ndarray:
        """The next-token masks of ``matchers``, [n, vocab] bool, on the calling thread."""
        words = (self.vocab_size + 31) // 32
        bits = np.full((len(matchers), words), -1, dtype=np.int32)
        if matchers:
            fill_next_token_bitmask_par(
                self._executor, [(m, i) for i, m in enumerate(matchers)], bits
            )
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")
        return allowed[:, : self.vocab_size].view(bool)

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
