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
bounded cache of compiled grammars keyed by a digest of the constraint holding
a pristine matcher that each request copies (``deep_copy`` is microseconds, a
compile milliseconds to a second), a compiler thread with a large stack
(llguidance compiles recursively, one stack frame per link of a chain of rules
or ``$ref``s; it releases the GIL, so the engine keeps stepping meanwhile), and
an ``LLExecutor`` that fills a batch's masks with the GIL released, so the
engine can compute them while ONNX Runtime runs the step.

Before a request reaches the engine the frontend has the same compile and a
few matching steps done by the constraint checker's process
(``constraint_check``), with a smaller stack and a time bound: what passes it
cannot crash the engine's compiler, and what would have failed at the first
tokens (llguidance's limits on lexer states, Earley items, forced tokens) is
``INVALID_ARGUMENT`` before any work. A limit still reached later while
matching ends only that request, ``INVALID_ARGUMENT`` (docs/design.md,
"Structured output").
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import llguidance
import numpy as np
import structlog
import tokenizers
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark
from llguidance.numpy import fill_next_token_bitmask_par

from genai_common import bounded_json
from genai_common.errors import InvalidArgument

from ..contract.request import Constraint, GenerationRequest
from . import constraint_limits

log = structlog.get_logger(__name__)


class Seq(Protocol):
    """What ``Guidance`` reads of a running sequence (the engine's ``Sequence``)."""

    @property
    def seq_id(self) -> int: ...
    @property
    def matcher(self) -> llguidance.LLMatcher | None: ...
    @property
    def request(self) -> GenerationRequest: ...
    @property
    def output_ids(self) -> list[int]: ...


KINDS = ("json_schema", "regex", "grammar", "choice", "json_object")
# Compiled grammars kept (each one pristine matcher, typically tens of KiB).
GRAMMAR_CACHE_ENTRIES = 64
# The engine's compiler thread's stack. llguidance needs about 3 KiB per link
# of a chain of rules (a 3,000-rule chain overflows the 8 MiB main thread); the
# checker compiles with a stack 8x smaller (constraint_check.CHECK_STACK_BYTES),
# so whatever it passed compiles here. Only touched pages are ever allocated.
COMPILE_STACK_BYTES = 512 * 1024 * 1024
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


def validate_shape(constraint: Constraint, max_bytes: int, field: str = "") -> None:
    """What can be checked without compiling: kind, size, choices; messages
    name ``field`` (default ``constraint.<kind>``)."""
    kind = constraint.kind
    field = field or f"constraint.{kind}"
    if kind not in KINDS:
        raise InvalidArgument(f"constraint: unknown kind {kind!r}; allowed {', '.join(KINDS)}")
    size = constraint_size(constraint)
    if size > max_bytes:
        raise InvalidArgument(f"{field}: {size} bytes; allowed at most {max_bytes}")
    if kind == "choice":
        count = len(constraint.choices)
        if count < 2:
            raise InvalidArgument(f"constraint.choice.choices: {count} given; give at least 2")
        if count > constraint_limits.MAX_CHOICES:
            raise InvalidArgument(
                f"constraint.choice.choices: {count} given; allowed at most "
                f"{constraint_limits.MAX_CHOICES}"
            )
        for i, choice in enumerate(constraint.choices):
            if not choice:
                raise InvalidArgument(f"constraint.choice.choices[{i}]: must not be empty")
    elif kind != "json_object" and not constraint.value:
        raise InvalidArgument(f"{field}: must not be empty")


def constraint_digest(constraint: Constraint) -> bytes:
    """A key for ``constraint`` (caches hold this, not the whole text)."""
    h = hashlib.blake2b(digest_size=16)
    for part in (constraint.kind, constraint.value, *constraint.choices):
        data = part.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


def grammar_text(constraint: Constraint, field: str = "") -> str:
    """The llguidance grammar (its JSON form) for a well-shaped constraint;
    ``InvalidArgument`` naming ``field`` (default ``constraint.<kind>``) for
    text that does not even parse (e.g. a schema that is not JSON, a GBNF
    syntax error) or passes a shape limit (``constraint_limits``)."""
    kind, value = constraint.kind, constraint.value
    field = field or f"constraint.{kind}"
    matcher = llguidance.LLMatcher
    if kind == "json_schema":
        schema = bounded_json.loads(value, field)
        if schema is False:
            raise InvalidArgument(f"{field}: false matches no JSON value")
        if schema is True:
            schema, value = {}, "{}"  # any JSON value
        if not isinstance(schema, dict):
            raise InvalidArgument(f"{field}: a JSON Schema is an object or a boolean")
        constraint_limits.check_schema(field, schema)
        options = schema.get("x-guidance")
        if isinstance(options, dict) and any(k.startswith("whitespace") for k in options):
            return matcher.grammar_from_json_schema(value)  # the schema says how
        return matcher.grammar_from_json_schema(value, defaults=JSON_DEFAULTS)  # type: ignore[arg-type]
    if kind == "json_object":
        return matcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_DEFAULTS)  # type: ignore[arg-type]
    if kind == "regex":
        constraint_limits.check_regex(field, value)
        return matcher.grammar_from_regex(value)
    if kind == "choice":
        # One lexeme (an upper-case Lark terminal) whose alternatives are the
        # choices: the lexer matches them as one automaton, however many there
        # are. As parser alternatives (`start: "a" | "b"`), every choice is an
        # Earley item of the first row: past 2,000 of them llguidance's row
        # limit fails the request at its first token. JSON string literals are
        # Lark string literals, escapes included.
        alternatives = " | ".join(json.dumps(c) for c in constraint.choices)
        return matcher.grammar_from_lark(f"start: CHOICE\nCHOICE: {alternatives}")
    constraint_limits.check_grammar(field, value)
    try:
        return matcher.grammar_from_lark(any_to_lark(value))  # GBNF is converted
    except GbnfToLarkError as e:
        raise InvalidArgument(f"{field}: not a valid GBNF grammar: {_short(str(e))}") from e


def _big_stack_executor(stack_bytes: int, name: str) -> ThreadPoolExecutor:
    """A one-thread executor whose thread has a ``stack_bytes`` stack (the
    thread is started here, while the process-wide setting is changed)."""
    with _STACK_LOCK:
        old = threading.stack_size(stack_bytes)
        try:
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
            pool.submit(lambda: None).result()
        finally:
            threading.stack_size(old)
    return pool


_STACK_LOCK = threading.Lock()
# llguidance's limits, its defaults but two: an Earley row may hold 10,000
# items (2,000 by default: an object schema of ~500 optional properties, or a
# few hundred grammar alternatives, failed at its first token; the work of one
# mask stays bounded by ``step_max_items``, 50,000), and errors leave out the
# parser's state and the whole grammar (which would echo one tenant's schema
# into logs and error messages).
MAX_ITEMS_IN_ROW = 10_000
PARSER_LIMITS = llguidance.LLParserLimits(max_items_in_row=MAX_ITEMS_IN_ROW, verbose_errors=False)
# Where a matcher fails, in the words a client can act on: llguidance's
# "NoExtensionBias" is a grammar that cannot produce its next byte (a $ref
# cycle that never reaches a value, say).
_HINTS = {"NoExtensionBias": "the grammar allows no text at all (e.g. a $ref cycle)"}


def matcher_error(field: str, error: str, at: int | None = None) -> InvalidArgument:
    """The error of a matcher that failed: INVALID_ARGUMENT naming ``field``
    (a constraint the client sent is what broke one of llguidance's limits)."""
    where = f" at generated token {at}" if at is not None else ""
    # llguidance appends its state and the whole grammar after the first line.
    first = error.strip().split("\n", 1)[0].strip()
    text = _HINTS.get(first, _short(first))
    return InvalidArgument(f"{field}: llguidance stopped matching it{where}: {text}")


class Guidance:
    """llguidance for one model: compile, validate and cache grammars, hand
    out matchers, fill masks. Used on the engine's thread; compiles run on
    the compiler thread, mask filling on its own worker."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        max_constraint_bytes: int,
        cache_entries: int = GRAMMAR_CACHE_ENTRIES,
        compile_stack_bytes: int = COMPILE_STACK_BYTES,
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
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_constraint_bytes = max_constraint_bytes
        self._cache_entries = cache_entries
        self._compiled: OrderedDict[bytes, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # the cache: the compiler thread fills it
        # Compiles submitted and not done, by key: requests with one new
        # constraint share one compile and are admitted in the same step.
        self._inflight: dict[bytes, Future[llguidance.LLMatcher]] = {}
        self._compiler = _big_stack_executor(compile_stack_bytes, "guidance-compile")
        self._executor = llguidance.LLExecutor(num_threads=1)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="guidance")
        self.counters = {"grammars_compiled": 0, "grammar_cache_hits": 0}

    def compile(self, constraint: Constraint, field: str = "") -> Future[llguidance.LLMatcher]:
        """The pristine matcher of ``constraint``, compiled on the compiler
        thread (the engine steps meanwhile: llguidance releases the GIL) or
        taken from the cache (then the future is done already). Its error is
        ``InvalidArgument`` with the parser's message, naming ``field``
        (default ``constraint.<kind>``). Give each request ``take(future)``."""
        key = constraint_digest(constraint)
        with self._lock:
            template = self._compiled.get(key)
            if template is not None:
                self._compiled.move_to_end(key)
                self.counters["grammar_cache_hits"] += 1
        if template is not None:
            done: Future[llguidance.LLMatcher] = Future()
            done.set_result(template)
            return done
        # What needs no compiling is refused at once, on the caller's thread.
        validate_shape(constraint, self.max_constraint_bytes, field)
        if self.tokenizer is None:
            raise InvalidArgument(
                f"constraint: this model's tokenizer cannot be used for structured output "
                f"(llguidance: {self.unsupported})"
            )
        with self._lock:
            pending = self._inflight.get(key)
            new = pending is None
            if pending is None:
                pending = self._compiler.submit(self._compile, key, constraint, field)
                self._inflight[key] = pending
        if new:  # outside the lock: a done future runs the callback at once
            pending.add_done_callback(lambda _: self._forget(key))
        return pending

    def _forget(self, key: bytes) -> None:
        with self._lock:
            self._inflight.pop(key, None)

    @staticmethod
    def take(compiled: Future[llguidance.LLMatcher]) -> llguidance.LLMatcher:
        """A request's own matcher from a finished ``compile``; raises its error."""
        return compiled.result().deep_copy()

    def matcher(self, constraint: Constraint, field: str = "") -> llguidance.LLMatcher:
        """A fresh matcher for ``constraint``, waiting for its compile;
        ``InvalidArgument`` with the parser's message if it is invalid or over
        the limits."""
        return self.take(self.compile(constraint, field))

    def _compile(self, key: bytes, constraint: Constraint, field: str) -> llguidance.LLMatcher:
        assert self.tokenizer is not None  # compile() refuses the request otherwise
        with self._lock:
            template = self._compiled.get(key)  # compiled meanwhile for another request
        if template is not None:
            return template
        field = field or f"constraint.{constraint.kind}"
        try:
            grammar = grammar_text(constraint, field)
        except ValueError as e:  # llguidance refusing the text before compiling it
            raise InvalidArgument(f"{field}: {_short(str(e))}") from e
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer, limits=PARSER_LIMITS
        )
        if is_error:
            raise InvalidArgument(f"{field}: {_short(messages[0])}")
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=PARSER_LIMITS)
        if template.is_error():
            raise InvalidArgument(f"{field}: {_short(template.get_error())}")
        with self._lock:
            self.counters["grammars_compiled"] += 1
            self._compiled[key] = template
            while len(self._compiled) > self._cache_entries:
                self._compiled.popitem(last=False)
        return template

    def check(self, constraint: Constraint, field: str = "", steps: int = 4) -> None:
        """Compile ``constraint`` and match its first ``steps`` tokens (each
        time the lowest allowed id other than EOS), as the engine would: a
        matcher that fails this early (llguidance's limits on lexer states,
        Earley items per row, forced tokens) is ``InvalidArgument`` here, before
        the request is admitted. What the constraint checker's process runs."""
        field = field or f"constraint.{constraint.kind}"
        matcher = self.matcher(constraint, field)
        eos = self.eos_token_ids
        for step in range(steps):
            if matcher.is_stopped():
                return
            allowed = np.flatnonzero(self.masks([matcher])[0])
            if matcher.is_error():
                raise matcher_error(field, matcher.get_error(), step)
            if not allowed.size:
                raise matcher_error(field, "no token is allowed", step)
            others = [int(t) for t in allowed[:2] if int(t) not in eos]
            token = others[0] if others else int(allowed[0])
            if not matcher.consume_token(token) or matcher.is_error():
                raise matcher_error(field, matcher.get_error(), step)

    def start_step(self, seqs: Sequence[Seq]) -> Future[dict[int, np.ndarray]] | None:
        """The next-token masks, by seq_id, of the constrained ones of ``seqs``
        (those about to pick a token), filled on the worker (llguidance
        releases the GIL) while the caller runs the model step: [vocab] bool
        arrays, True where a token is allowed. None when none is constrained."""
        ids = [s.seq_id for s in seqs if s.matcher is not None]
        matchers = [s.matcher for s in seqs if s.matcher is not None]
        if not matchers:
            return None
        return self._worker.submit(lambda: dict(zip(ids, self.masks(matchers), strict=True)))

    @staticmethod
    def consume(seq: Seq, token: int) -> bool:
        """Feed the picked ``token`` to ``seq``'s matcher; True when the
        constraint is now complete and allows nothing more, which ends the
        request; ``InvalidArgument`` when the matcher is in its error state."""
        matcher = seq.matcher
        if matcher is None:
            return False
        # A masked pick never fails; a matcher that broke (llguidance's limits
        # reached past the checker's first steps) fails its own request, never
        # the engine.
        if not matcher.consume_token(token) or matcher.is_error():
            kind = seq.request.constraint.kind if seq.request.constraint else ""
            field = f"constraint.{kind}" if kind else "constraint"
            raise matcher_error(field, matcher.get_error(), len(seq.output_ids))
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
        self._compiler.shutdown(wait=False, cancel_futures=True)
