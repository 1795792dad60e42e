"""Configuration: frozen dataclasses, validated on construction.

A field that a ``genai-server`` flag sets declares the flag beside it
(``genai_common.flags.flag``: help, aliases, metavar, choices); the parser is
generated from these fields. Environment variables and command-line flags are
read in exactly one place (the ``__main__`` of each entry point); nothing here
reads them.
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass, field

from genai_common.credentials import MIN_SECRET_BYTES
from genai_common.flags import flag, tls_server_fields


def _positive(name: str, value: int | float) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")


RUNNERS = ("auto", "past_present", "shared_buffer", "static_cache")
HUGE_PAGES = ("on", "off")


@dataclass(frozen=True)
class RunnerConfig:
    """How ONNX Runtime runs the model."""

    intra_op_threads: int = flag(
        0,
        help="ONNX Runtime intra-op threads (0: one per core)",
        aliases=["--threads"],
        metavar="N",
    )
    runner: str = flag("auto", help="how the model runs", choices=RUNNERS)
    # Each session's weights, read whole at every decode step, collapsed onto
    # 2 MiB pages once loaded, so a step misses the TLB far less
    # (engine/runner/huge_pages.py; docs/design.md, "Processes and planes").
    huge_pages: str = flag(
        "on",
        help="put ONNX Runtime's weights on transparent huge pages once a model loads; "
        "off: the system's default pages",
        choices=HUGE_PAGES,
    )
    # One intra-op thread pool for every session of the process (set by the
    # engine process when a draft model runs beside the target: per-session
    # pools spin-wait after each call and take the cores from the other
    # model's threads; docs/design.md, "Speculative decoding"). Process-wide
    # and for good once set, so in-process engines (tests) leave it off.
    shared_thread_pool: bool = False

    def __post_init__(self) -> None:
        if self.intra_op_threads < 0:
            raise ValueError(f"intra_op_threads must be >= 0, got {self.intra_op_threads}")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}; got {self.runner!r}")
        if self.huge_pages not in HUGE_PAGES:
            raise ValueError(
                f"huge_pages must be one of {', '.join(HUGE_PAGES)}; got {self.huge_pages!r}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = flag(8, help="sequences decoded together", metavar="N")
    max_num_batched_tokens: int = flag(  # the chunked-prefill budget
        512, help="prefill tokens per step", aliases=["--max-batched-tokens"], metavar="N"
    )
    max_queue: int = flag(256, help="waiting requests before RESOURCE_EXHAUSTED", metavar="N")

    def __post_init__(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_queue", self.max_queue)


MAX_DRAFT_TOKENS = 32  # a check of that many tokens costs several plain steps
# A draft's greedy guess ends after a token it gives less probability
# (docs/design.md, "Speculative decoding": measured on the default model's fp32
# + int4 and int8 pairs; sampled guesses are never cut, see there).
DRAFT_MIN_CONFIDENCE = 0.2
SPECULATIVE_MODES = ("auto", "prompt-lookup", "draft")
SPECULATION_BATCH_RULES = ("measured", "always")


def check_batch_rule(rule: str) -> None:
    """ValueError unless ``rule`` is a ``--speculate-batch-rule``."""
    if rule not in SPECULATION_BATCH_RULES:
        raise ValueError(
            f"--speculate-batch-rule must be one of {', '.join(SPECULATION_BATCH_RULES)}; "
            f"got {rule!r}"
        )


@dataclass(frozen=True)
class SpeculationConfig:
    """Speculative decoding (off unless ``num_tokens`` > 0).

    While at most ``max_batch`` sequences are decoding, each one's next
    ``num_tokens`` tokens are guessed, by prompt lookup (an earlier occurrence
    of its last ``ngram_max``..``ngram_min`` tokens in its own context) or by
    a draft model (``draft_model``; ``mode`` says which; its greedy guess ends
    early after a token to which it gives less than ``min_confidence``), and one step
    checks the guess: every guessed token the model agrees with comes out of that
    step too. From two sequences up, ``batch_rule`` "measured" guesses at a
    batch size only while guessing steps there are measured to give tokens
    faster than plain ones ("always": at every step). Tokens are chosen as
    without speculation; graphs whose matmuls round a several-token step
    differently (int8 activations) may break near-ties the other way
    (docs/design.md, "Speculative decoding").
    """

    num_tokens: int = flag(  # 0..MAX_DRAFT_TOKENS
        0,
        name="speculate",
        help="speculative decoding: guess N tokens per step (0: off; prompt lookup, or the "
        "--draft-model)",
        metavar="N",
    )
    max_batch: int = flag(
        1,
        name="speculate-max-batch",
        help="speculate only while at most N sequences decode",
        metavar="N",
    )
    draft_model: str | None = flag(
        None,
        help="a second, cheaper model (directory or named model) that drafts the tokens; "
        "its vocabulary must equal the target's",
        metavar="DIR",
    )
    mode: str = flag(
        "auto",
        name="speculative-mode",
        help="who drafts: prompt lookup, the draft model, or auto (the draft model, prompt "
        "lookup where its guess is longer; prompt lookup alone without --draft-model)",
        choices=SPECULATIVE_MODES,
    )
    min_confidence: float = flag(
        DRAFT_MIN_CONFIDENCE,
        name="draft-min-confidence",
        help="a draft model's guess for a greedy request ends after a token to which the "
        "draft gives less than P probability (0: never; sampled requests' guesses are never "
        "cut by it)",
        metavar="P",
    )
    batch_rule: str = flag(
        "measured",
        name="speculate-batch-rule",
        help="at 2 to --speculate-max-batch sequences: speculate while steps that do are "
        "measured to give tokens faster than plain steps (measured), or at every step (always)",
        choices=SPECULATION_BATCH_RULES,
    )
    ngram_max: int = 3
    ngram_min: int = 1

    @property
    def checks_several(self) -> bool:
        """Whether one step may check several sequences' guesses (the runners
        then prepare ``verify_batch`` for it: on GroupQueryAttention graphs a
        second ORT session, the graph's twin)."""
        return bool(self.num_tokens) and self.max_batch > 1

    @property
    def resolved_mode(self) -> str:
        """ "" (off), "prompt-lookup", "draft" or "auto" (both)."""
        if not self.num_tokens:
            return ""
        if self.mode == "auto" and self.draft_model is None:
            return "prompt-lookup"
        return self.mode

    def __post_init__(self) -> None:
        if not 0 <= self.num_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(
                f"speculation num_tokens must be in [0, {MAX_DRAFT_TOKENS}], got {self.num_tokens}"
            )
        check_batch_rule(self.batch_rule)
        if self.mode not in SPECULATIVE_MODES:
            raise ValueError(
                f"--speculative-mode must be one of {', '.join(SPECULATIVE_MODES)}; "
                f"got {self.mode!r}"
            )
        if self.draft_model is not None and not self.num_tokens:
            raise ValueError("draft_model: --draft-model needs --speculate N (draft tokens, N > 0)")
        if self.mode == "draft" and self.draft_model is None:
            raise ValueError("--speculative-mode draft needs --draft-model DIR")
        if self.mode == "prompt-lookup" and self.draft_model is not None:
            raise ValueError(
                "--speculative-mode prompt-lookup never uses --draft-model (use draft or auto)"
            )
        if not 0.0 <= self.min_confidence < 1.0:
            raise ValueError(f"--draft-min-confidence must be in [0, 1), got {self.min_confidence}")
        _positive("speculation max_batch", self.max_batch)
        _positive("speculation ngram_min", self.ngram_min)
        if self.ngram_max < self.ngram_min:
            raise ValueError(
                f"speculation ngram_max ({self.ngram_max}) must be >= ngram_min ({self.ngram_min})"
            )


PREFIX_CACHE_SCOPES = ("global", "principal")


@dataclass(frozen=True)
class CacheConfig:
    """In-process prefix reuse (docs/design.md, "KV chunk contract")."""

    chunk_size: int = flag(
        256, name="kv-chunk-size", help="tokens per KV chunk (prefix reuse)", metavar="N"
    )
    prefix_cache_bytes: int = flag(
        256 * 1024 * 1024, help="in-process prefix cache (LRU by bytes; 0: off)", metavar="N"
    )
    # Who shares reused prefixes (genai-server --prefix-cache-scope): "global",
    # every request; "principal", only requests of the same caller (reuse is
    # a timing side channel: one tenant could probe another's prompts). None:
    # "principal" when the server has auth tokens (ServerConfig resolves it),
    # else "global".
    prefix_cache_scope: str | None = flag(
        None,
        help="who shares reused prompt KV: every request, or only one principal's "
        "(default: principal when --auth-token-file/GENAI_AUTH_TOKEN is set, else global)",
        choices=PREFIX_CACHE_SCOPES,
    )

    def __post_init__(self) -> None:
        _positive("chunk_size", self.chunk_size)
        if (
            self.prefix_cache_scope is not None
            and self.prefix_cache_scope not in PREFIX_CACHE_SCOPES
        ):
            raise ValueError(
                f"prefix_cache_scope must be one of {', '.join(PREFIX_CACHE_SCOPES)}; "
                f"got {self.prefix_cache_scope!r}"
            )
        if self.prefix_cache_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be >= 0, got {self.prefix_cache_bytes}")


# A ListSessions page holds at most this many bytes of sessions (and at least
# one session), so every response stays well under a client's default 4 MiB
# receive limit whatever the metadata limits below are set to.
SESSION_LIST_PAGE_BYTES = 1024 * 1024


@dataclass(frozen=True)
class SessionConfig:
    max_sessions: int = flag(64, help="sessions held in memory", metavar="N")
    idle_ttl_s: float = flag(
        900.0, help="a session idle this long is closed", aliases=["--session-ttl"], metavar="S"
    )
    # Host memory for the KV of sessions parked between turns; past it the least
    # recently used parked KV is dropped (that session's next turn recomputes
    # its history, or fetches it from the kvstore).
    max_parked_kv_bytes: int = flag(
        1024**3,
        help="host memory for parked sessions' KV (LRU beyond it is recomputed)",
        aliases=["--session-kv-bytes"],
        metavar="N",
    )
    # CreateSession metadata limits (docs/design.md, "Sessions"). Metadata are
    # labels (a user id, a conversation id), not documents: a few dozen short
    # entries. Every session's metadata is held in the engine, written into
    # its kvstore record on every turn and returned by GetSession and
    # ListSessions, so the total is what bounds memory per session and the
    # size of a record and of a listing page.
    max_metadata_entries: int = flag(
        64,
        help="most metadata entries a CreateSession may carry",
        aliases=["--session-metadata-entries"],
        metavar="N",
    )
    max_metadata_key_bytes: int = flag(
        256,
        help="largest session metadata key (UTF-8 bytes)",
        aliases=["--session-metadata-key-bytes"],
        metavar="N",
    )
    max_metadata_value_bytes: int = flag(
        4096,
        help="largest session metadata value (UTF-8 bytes)",
        aliases=["--session-metadata-value-bytes"],
        metavar="N",
    )
    max_metadata_bytes: int = flag(
        16 * 1024,
        help="largest session metadata in all, keys and values (UTF-8 bytes)",
        aliases=["--session-metadata-bytes"],
        metavar="N",
    )
    # Session records being fetched from the kvstore at once (one per session
    # id, however many calls wait on it); past it a call for another session
    # not in memory is RESOURCE_EXHAUSTED, so lookups of made-up ids against a
    # stalled kvstore cannot pile up without bound.
    max_record_fetches: int = flag(
        64,
        help="session records fetched from the kvstore at once; more is RESOURCE_EXHAUSTED",
        aliases=["--session-max-record-fetches"],
        metavar="N",
    )

    def __post_init__(self) -> None:
        _positive("max_sessions", self.max_sessions)
        _positive("max_record_fetches", self.max_record_fetches)
        _positive("idle_ttl_s", self.idle_ttl_s)
        if self.max_parked_kv_bytes < 0:
            raise ValueError(f"max_parked_kv_bytes must be >= 0, got {self.max_parked_kv_bytes}")
        for name in (
            "max_metadata_entries",
            "max_metadata_key_bytes",
            "max_metadata_value_bytes",
            "max_metadata_bytes",
        ):
            _positive(name, getattr(self, name))
        # Half a page: a session with the most metadata still fits a listing page.
        if self.max_metadata_bytes > SESSION_LIST_PAGE_BYTES // 2:
            raise ValueError(
                f"max_metadata_bytes must be <= {SESSION_LIST_PAGE_BYTES // 2}, "
                f"got {self.max_metadata_bytes}"
            )


@dataclass(frozen=True)
class LimitsConfig:
    """Request size limits, enforced before any work (docs/design.md, "Security")."""

    max_new_tokens_limit: int = flag(
        4096, help="largest max_new_tokens a request may ask for", metavar="N"
    )
    default_max_new_tokens: int = flag(
        256, help="max_new_tokens of a request that sets none", metavar="N"
    )
    max_stop_sequences: int = 16
    max_stop_sequence_chars: int = 256
    max_stop_token_ids: int = 64
    max_top_logprobs: int = 20
    max_time_limit_ms: int = 3_600_000
    max_cache_salt_chars: int = 256
    max_logit_bias: int = flag(1024, help="most logit_bias entries a request may give", metavar="N")
    max_bad_words: int = 128
    max_completions: int = flag(
        16, help="largest n (and best_of) a request may ask for", metavar="N"
    )
    max_constraint_bytes: int = flag(
        65_536,
        help="largest structured-output constraint (schema, regex, grammar or choices), "
        "in UTF-8 bytes; also the most the tools' parameter schemas of one request may hold",
        metavar="N",
    )

    def __post_init__(self) -> None:
        for name in (
            "max_new_tokens_limit",
            "default_max_new_tokens",
            "max_stop_sequences",
            "max_stop_sequence_chars",
            "max_stop_token_ids",
            "max_time_limit_ms",
            "max_cache_salt_chars",
            "max_constraint_bytes",
            "max_logit_bias",
            "max_bad_words",
            "max_completions",
        ):
            _positive(name, getattr(self, name))
        if self.max_top_logprobs < 0:
            raise ValueError(f"max_top_logprobs must be >= 0, got {self.max_top_logprobs}")
        if self.default_max_new_tokens > self.max_new_tokens_limit:
            raise ValueError(
                f"default_max_new_tokens ({self.default_max_new_tokens}) must be <= "
                f"max_new_tokens_limit ({self.max_new_tokens_limit})"
            )


CONTEXT_OVERFLOWS = ("error", "slide")  # ContextOverflow ERROR, SLIDE


@dataclass(frozen=True)
class ContextConfig:
    """What happens at the context window (docs/design.md, "Context window")."""

    overflow: str = flag(
        "error",
        name="context-overflow",
        help="at the context window: stop (error), or drop the oldest tokens after the "
        "sinks and go on (slide); a request or session may choose",
        choices=CONTEXT_OVERFLOWS,
    )
    sink_tokens: int = flag(
        4,
        help="the first N tokens of a sequence, never dropped by a slide or by "
        "truncate_prompt_tokens",
        metavar="N",
    )
    slide_tokens: int | None = flag(
        None,
        name="context-slide-tokens",
        help="tokens one slide drops (default: a quarter of the window; rounded up so "
        "that what is kept ends on a KV chunk boundary)",
        metavar="N",
    )
    # How a slide repositions the kept KV: rotate the cached keys by the
    # shift (graphs whose GroupQueryAttention applies RoPE from its own
    # tables), or recompute the kept tokens; auto: rotate where the graph allows.
    slide_kv: str = flag(
        "auto",
        name="context-slide-kv",
        help="how a slide repositions the kept KV",
        choices=("auto", "rotate", "recompute"),
    )

    def __post_init__(self) -> None:
        if self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be >= 0, got {self.sink_tokens}")
        if self.overflow not in CONTEXT_OVERFLOWS:
            raise ValueError(f"overflow must be one of {CONTEXT_OVERFLOWS}, got {self.overflow!r}")
        if self.slide_tokens is not None:
            _positive("slide_tokens", self.slide_tokens)


@dataclass(frozen=True)
class KvStoreConfig:
    """The kvstore sidecar the engine shares KV chunks and session records through."""

    target: str  # HOST:PORT of genai-kvstore
    timeout_s: float = flag(  # a lookup+fetch slower than this is a miss
        2.0,
        help="a kvstore fetch slower than this is a cache miss",
        aliases=["--kvstore-timeout"],
        metavar="S",
    )
    # Bearer token sent on every kvstore RPC; None only with insecure=True
    # (genai-server --kvstore-insecure), for a kvstore started --insecure.
    auth_token: str | None = field(default=None, repr=False)  # a secret: never logged
    insecure: bool = flag(
        False, help="send no data-plane token (for a genai-kvstore started with --insecure)"
    )
    record_wait_s: float = 1.0  # longest a turn's final answer waits for its session record
    tls_ca_file: str | None = flag(  # PEM; dial the kvstore over TLS, trusting this CA
        None, help="kvstore over TLS", aliases=["--kvstore-tls-ca"], metavar="PEM"
    )
    tls_cert_file: str | None = flag(  # PEM client certificate, for a kvstore requiring mTLS
        None, help="client certificate", aliases=["--kvstore-tls-cert"], metavar="PEM"
    )
    tls_key_file: str | None = flag(None, help=None, aliases=["--kvstore-tls-key"], metavar="PEM")
    # The secret that seals what the engine stores (genai-server
    # --kv-integrity-key-file): replicas share KV chunks and sessions only
    # when theirs are equal. Default: random, made once per configuration (so
    # per server process: the engine keeps it across restarts), trusting only
    # what this process wrote.
    integrity_key: bytes = field(
        default_factory=lambda: secrets.token_bytes(MIN_SECRET_BYTES), repr=False
    )

    def __post_init__(self) -> None:
        if ":" not in self.target:
            raise ValueError(f"kvstore target must be HOST:PORT, got {self.target!r}")
        if not self.auth_token and not self.insecure:
            raise ValueError(
                f"kvstore {self.target} needs a data-plane token: set auth_token "
                "(genai-server --kvstore-auth-token-file or $GENAI_KVSTORE_AUTH_TOKEN), or "
                "insecure (--kvstore-insecure) for a kvstore that requires none"
            )
        if self.auth_token and self.insecure:
            raise ValueError("kvstore auth_token and insecure exclude each other; set one")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("kvstore tls_cert_file and tls_key_file go together")
        if self.tls_cert_file and not self.tls_ca_file:
            raise ValueError("kvstore tls_cert_file (mTLS) needs tls_ca_file")
        _positive("kvstore timeout_s", self.timeout_s)
        if self.record_wait_s < 0:
            raise ValueError(f"record_wait_s must be >= 0, got {self.record_wait_s}")
        if len(self.integrity_key) < MIN_SECRET_BYTES:
            raise ValueError(
                f"kvstore integrity_key is {len(self.integrity_key)} bytes; at least "
                f"{MIN_SECRET_BYTES} are required"
            )


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs; composed of the parts above."""

    model_dir: str
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    sessions: SessionConfig = field(default_factory=SessionConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    context: ContextConfig = field(default_factory=ContextConfig)
    kvstore: KvStoreConfig | None = None  # None: in-process prefix reuse only
    max_context_length: int | None = flag(
        None, help="cap below the model's own context window", metavar="N"
    )

    def __post_init__(self) -> None:
        if not self.model_dir:
            raise ValueError("model_dir must be set")
        if self.max_context_length is not None:
            _positive("max_context_length", self.max_context_length)


_TLS = tls_server_fields(client_ca_help="require client certificates")


@dataclass(frozen=True)
class ServerConfig:
    """The ``genai-server`` process: the control plane plus its engine."""

    engine: EngineConfig
    host: str = flag("127.0.0.1", help="address to listen on")
    port: int = flag(50051, help="control-plane port", metavar="P")
    grace_period_s: float = flag(
        30.0,
        help="seconds in-flight streams may run after SIGTERM",
        aliases=["--grace-period"],
        metavar="S",
    )
    log_format: str = "console"  # "console" | "json"
    # gRPC receive/send limit per message. Requests up to it reach the frontend,
    # which checks every field's own limit (max_input_chars, session metadata)
    # before anything goes to the engine; responses are far smaller (a
    # ListSessions page is bounded by SESSION_LIST_PAGE_BYTES).
    max_message_bytes: int = 16 * 1024 * 1024
    max_input_chars: int = 1_000_000  # text / messages size limit before tokenizing
    engine_start_timeout_s: float = 900.0  # covers first-run conversion of the default model
    metrics_port: int | None = flag(  # 0: any free port; None: off
        None, help="serve Prometheus metrics at http://HOST:P/metrics", metavar="P"
    )
    # The OpenAI-compatible HTTP plane on this port (0: any free); None: off
    # (docs/design.md, "HTTP gateway").
    http_port: int | None = flag(
        None,
        help="serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
        "/v1/models, /health) on port P, with the same tokens and TLS as the control plane",
        metavar="P",
    )
    # What a slow or idle HTTP client may hold (docs/design.md, "HTTP gateway"):
    # uvicorn alone closes an idle keep-alive connection but waits forever for a
    # request's headers or body, so a client sending a byte every few seconds
    # (or nothing) keeps a connection, and a file, for good.
    http_header_timeout_s: float = flag(
        10.0,
        help="HTTP: a request's headers must arrive within S seconds of the connection "
        "opening or of the request's first byte; then 408 and the connection closes",
        metavar="S",
    )
    http_body_timeout_s: float = flag(
        60.0,
        help="HTTP: a request's body must arrive within S seconds of its headers (408)",
        metavar="S",
    )
    http_idle_timeout_s: float = flag(
        5.0,
        help="HTTP: a keep-alive connection idle this long between requests is closed",
        metavar="S",
    )
    http_max_connections: int = flag(
        1000,
        help="HTTP: connections open at once; one more is answered 503 and closed",
        metavar="N",
    )
    # The names a request's `model` may give over HTTP, listed by /v1/models
    # (--served-model-name, repeatable); empty: "default" and the model id.
    served_model_names: tuple[str, ...] = ()
    strict_openai: bool = flag(
        False,
        help="HTTP: refuse (400) request fields this server does not know, instead of "
        "accepting and logging them as vLLM does",
    )
    # Bearer tokens accepted on the control plane, as (token, principal); empty: no auth.
    auth_tokens: tuple[tuple[str, str], ...] = ()
    tls_cert_file: str | None = _TLS["tls_cert_file"]  # PEM; with tls_key_file, serve TLS
    tls_key_file: str | None = _TLS["tls_key_file"]
    tls_client_ca_file: str | None = _TLS["tls_client_ca_file"]  # PEM; require client certs
    # Tokens coalesced per streamed Delta (vLLM's --stream-interval): a request's
    # first tokens go out at once, later ones once this many are pending (at most
    # this many per Delta, unless one engine step alone made more), what is left
    # with the request's end. 1: every engine step's tokens as they come
    # (docs/design.md, "Processes and planes").
    stream_interval: int = flag(
        1,
        help="coalesce up to N tokens per streamed message (a request's first token goes "
        "out at once); fewer messages, less CPU per token, coarser streaming",
        metavar="N",
    )
    # Processes that compile and try out constraints and tool schemas before
    # the engine sees them, and how long one check may take (docs/design.md,
    # "Structured output").
    constraint_check_workers: int = flag(
        1,
        help="processes that compile and try out constraints and tool schemas before "
        "the engine sees them",
        metavar="N",
    )
    constraint_check_timeout_ms: int = flag(
        10_000,
        help="a constraint whose check takes more CPU (or 5 times it in wall time) is refused "
        "(INVALID_ARGUMENT)",
        metavar="MS",
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.grace_period_s < 0:
            raise ValueError(f"grace_period_s must be >= 0, got {self.grace_period_s}")
        if self.log_format not in ("console", "json"):
            raise ValueError(f"log_format must be console or json, got {self.log_format!r}")
        _positive("max_message_bytes", self.max_message_bytes)
        _positive("max_input_chars", self.max_input_chars)
        _positive("engine_start_timeout_s", self.engine_start_timeout_s)
        _positive("stream_interval", self.stream_interval)
        _positive("constraint_check_workers", self.constraint_check_workers)
        _positive("constraint_check_timeout_ms", self.constraint_check_timeout_ms)
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
        for name in self.served_model_names:
            if not 1 <= len(name) <= 256:
                raise ValueError(f"served_model_names: {name[:64]!r} must be 1 to 256 characters")
        for name in ("http_header_timeout_s", "http_body_timeout_s", "http_idle_timeout_s"):
            _positive(name, getattr(self, name))
        _positive("http_max_connections", self.http_max_connections)
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("tls_client_ca_file (mTLS) needs tls_cert_file and tls_key_file")
        for token, principal in self.auth_tokens:
            if not token or not principal:
                raise ValueError("auth tokens and their principals must not be empty")
        cache = self.engine.cache
        if cache.prefix_cache_scope is None:  # the default follows auth, however built
            scope = "principal" if self.auth_tokens else "global"
            engine = dataclasses.replace(
                self.engine, cache=dataclasses.replace(cache, prefix_cache_scope=scope)
            )
            object.__setattr__(self, "engine", engine)
