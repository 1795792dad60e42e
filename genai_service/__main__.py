"""``genai-server``: the one place where flags become configuration."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog

from genai_common.credentials import MIN_SECRET_BYTES, read_secret_file
from genai_common.logging import configure_logging
from kvstore.protocol import AUTH_TOKEN_ENV

from .config import (
    PREFIX_CACHE_SCOPES,
    CacheConfig,
    EngineConfig,
    KvStoreConfig,
    LimitsConfig,
    RunnerConfig,
    SchedulerConfig,
    ServerConfig,
    SessionConfig,
    SpeculationConfig,
)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to a flag's help, except where there is no default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.help is None:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``genai-server``. Each one that sets a config field is named
    after it (``--max-parked-kv-bytes`` sets ``SessionConfig.max_parked_kv_bytes``)
    and takes its default from the dataclass; older names stay as aliases."""
    p = argparse.ArgumentParser(
        prog="genai-server",
        description="LLM text generation on ONNX Runtime over gRPC",
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "--model", required=True, help="model directory, or 'default' (SmolLM2-135M-Instruct)"
    )
    p.add_argument("--host", default=ServerConfig.host, help="address to listen on")
    p.add_argument(
        "--port", type=int, metavar="P", default=ServerConfig.port, help="control-plane port"
    )
    p.add_argument(
        "--log-format", choices=("console", "json"), default=ServerConfig.log_format, help="logs"
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=ServerConfig.metrics_port,
        metavar="P",
        help="serve Prometheus metrics at http://HOST:P/metrics",
    )
    p.add_argument(
        "--http-port",
        type=int,
        default=ServerConfig.http_port,
        metavar="P",
        help="serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
        "/v1/models, /health) on port P, with the same tokens and TLS as the control plane",
    )
    p.add_argument(
        "--grace-period-s",
        "--grace-period",
        dest="grace_period_s",
        type=float,
        default=ServerConfig.grace_period_s,
        metavar="S",
        help="seconds in-flight streams may run after SIGTERM",
    )
    p.add_argument(
        "--stream-interval",
        type=int,
        metavar="N",
        default=ServerConfig.stream_interval,
        help="coalesce up to N tokens per streamed message (a request's first token goes "
        "out at once); fewer messages, less CPU per token, coarser streaming",
    )
    g = p.add_argument_group("engine")
    g.add_argument(
        "--intra-op-threads",
        "--threads",
        dest="intra_op_threads",
        type=int,
        metavar="N",
        default=RunnerConfig.intra_op_threads,
        help="ONNX Runtime intra-op threads (0: one per core)",
    )
    g.add_argument(
        "--runner",
        choices=("auto", "past_present", "shared_buffer"),
        default=RunnerConfig.runner,
        help="how the model runs",
    )
    g.add_argument(
        "--max-context-length",
        type=int,
        metavar="N",
        default=EngineConfig.max_context_length,
        help="cap below the model's own context window",
    )
    g.add_argument(
        "--max-num-seqs",
        type=int,
        metavar="N",
        default=SchedulerConfig.max_num_seqs,
        help="sequences decoded together",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        "--max-batched-tokens",
        dest="max_num_batched_tokens",
        type=int,
        metavar="N",
        default=SchedulerConfig.max_num_batched_tokens,
        help="prefill tokens per step",
    )
    g.add_argument(
        "--max-queue",
        type=int,
        metavar="N",
        default=SchedulerConfig.max_queue,
        help="waiting requests before RESOURCE_EXHAUSTED",
    )
    g.add_argument(
        "--kv-chunk-size",
        type=int,
        metavar="N",
        default=CacheConfig.chunk_size,
        help="tokens per KV chunk (prefix reuse)",
    )
    g.add_argument(
        "--prefix-cache-bytes",
        type=int,
        metavar="N",
        default=CacheConfig.prefix_cache_bytes,
        help="in-process prefix cache (LRU by bytes; 0: off)",
    )
    g.add_argument(
        "--prefix-cache-scope",
        choices=PREFIX_CACHE_SCOPES,
        default=CacheConfig.prefix_cache_scope,
        help="who shares reused prompt KV: every request, or only one principal's "
        "(default: principal when --auth-token-file/GENAI_AUTH_TOKEN is set, else global)",
    )
    g.add_argument(
        "--default-max-new-tokens",
        type=int,
        metavar="N",
        default=LimitsConfig.default_max_new_tokens,
        help="max_new_tokens of a request that sets none",
    )
    g.add_argument(
        "--max-new-tokens-limit",
        type=int,
        metavar="N",
        default=LimitsConfig.max_new_tokens_limit,
        help="largest max_new_tokens a request may ask for",
    )
    g.add_argument(
        "--max-constraint-bytes",
        type=int,
        metavar="N",
        default=LimitsConfig.max_constraint_bytes,
        help="largest structured-output constraint (schema, regex, grammar or choices), "
        "in UTF-8 bytes; also the most the tools' parameter schemas of one request may hold",
    )
    g.add_argument(
        "--constraint-check-workers",
        type=int,
        metavar="N",
        default=ServerConfig.constraint_check_workers,
        help="processes that compile and try out constraints and tool schemas before "
        "the engine sees them",
    )
    g.add_argument(
        "--constraint-check-timeout-ms",
        type=int,
        metavar="MS",
        default=ServerConfig.constraint_check_timeout_ms,
        help="a constraint whose check takes longer is refused (INVALID_ARGUMENT)",
    )
    g.add_argument(
        "--speculate",
        type=int,
        default=SpeculationConfig.num_tokens,
        metavar="N",
        help="prompt-lookup speculative decoding: draft N tokens per step (0: off)",
    )
    g.add_argument(
        "--speculate-max-batch",
        type=int,
        default=SpeculationConfig.max_batch,
        metavar="N",
        help="speculate only while at most N sequences decode",
    )
    s = p.add_argument_group("sessions")
    s.add_argument(
        "--max-sessions",
        type=int,
        metavar="N",
        default=SessionConfig.max_sessions,
        help="sessions held in memory",
    )
    s.add_argument(
        "--idle-ttl-s",
        "--session-ttl",
        dest="idle_ttl_s",
        type=float,
        default=SessionConfig.idle_ttl_s,
        metavar="S",
        help="a session idle this long is closed",
    )
    s.add_argument(
        "--max-parked-kv-bytes",
        "--session-kv-bytes",
        dest="max_parked_kv_bytes",
        type=int,
        metavar="N",
        default=SessionConfig.max_parked_kv_bytes,
        help="host memory for parked sessions' KV (LRU beyond it is recomputed)",
    )
    s.add_argument(
        "--max-metadata-entries",
        "--session-metadata-entries",
        dest="max_metadata_entries",
        type=int,
        default=SessionConfig.max_metadata_entries,
        metavar="N",
        help="most metadata entries a CreateSession may carry",
    )
    s.add_argument(
        "--max-metadata-key-bytes",
        "--session-metadata-key-bytes",
        dest="max_metadata_key_bytes",
        type=int,
        default=SessionConfig.max_metadata_key_bytes,
        metavar="N",
        help="largest session metadata key (UTF-8 bytes)",
    )
    s.add_argument(
        "--max-metadata-value-bytes",
        "--session-metadata-value-bytes",
        dest="max_metadata_value_bytes",
        type=int,
        default=SessionConfig.max_metadata_value_bytes,
        metavar="N",
        help="largest session metadata value (UTF-8 bytes)",
    )
    s.add_argument(
        "--max-metadata-bytes",
        "--session-metadata-bytes",
        dest="max_metadata_bytes",
        type=int,
        default=SessionConfig.max_metadata_bytes,
        metavar="N",
        help="largest session metadata in all, keys and values (UTF-8 bytes)",
    )
    s.add_argument(
        "--max-record-fetches",
        "--session-max-record-fetches",
        dest="max_record_fetches",
        type=int,
        default=SessionConfig.max_record_fetches,
        metavar="N",
        help="session records fetched from the kvstore at once; more is RESOURCE_EXHAUSTED",
    )
    a = p.add_argument_group("security")
    a.add_argument(
        "--auth-token-file",
        default=None,
        metavar="PATH",
        help="bearer tokens, one 'PRINCIPAL TOKEN' per line (env GENAI_AUTH_TOKEN: one token)",
    )
    a.add_argument(
        "--tls-cert-file",
        "--tls-cert",
        dest="tls_cert_file",
        default=ServerConfig.tls_cert_file,
        metavar="PEM",
        help="serve TLS (with --tls-key-file)",
    )
    a.add_argument(
        "--tls-key-file",
        "--tls-key",
        dest="tls_key_file",
        default=ServerConfig.tls_key_file,
        metavar="PEM",
    )
    a.add_argument(
        "--tls-client-ca-file",
        "--tls-client-ca",
        dest="tls_client_ca_file",
        default=ServerConfig.tls_client_ca_file,
        metavar="PEM",
        help="require client certificates",
    )
    k = p.add_argument_group("kvstore (data plane)")
    k.add_argument(
        "--kvstore",
        default=None,
        metavar="HOST:PORT",
        help="share KV chunks and session records through this genai-kvstore",
    )
    k.add_argument(
        "--kvstore-timeout-s",
        "--kvstore-timeout",
        dest="kvstore_timeout_s",
        type=float,
        default=KvStoreConfig.timeout_s,
        metavar="S",
        help="a kvstore fetch slower than this is a cache miss",
    )
    k.add_argument(
        "--kvstore-auth-token-file",
        default=None,
        metavar="PATH",
        help="the data-plane bearer token (env GENAI_KVSTORE_AUTH_TOKEN); required with "
        "--kvstore unless --kvstore-insecure",
    )
    k.add_argument(
        "--kvstore-insecure",
        action="store_true",
        default=KvStoreConfig.insecure,
        help="send no data-plane token (for a genai-kvstore started with --insecure)",
    )
    k.add_argument(
        "--kvstore-tls-ca-file",
        "--kvstore-tls-ca",
        dest="kvstore_tls_ca_file",
        default=KvStoreConfig.tls_ca_file,
        metavar="PEM",
        help="kvstore over TLS",
    )
    k.add_argument(
        "--kvstore-tls-cert-file",
        "--kvstore-tls-cert",
        dest="kvstore_tls_cert_file",
        default=KvStoreConfig.tls_cert_file,
        metavar="PEM",
        help="client certificate",
    )
    k.add_argument(
        "--kvstore-tls-key-file",
        "--kvstore-tls-key",
        dest="kvstore_tls_key_file",
        default=KvStoreConfig.tls_key_file,
        metavar="PEM",
    )
    k.add_argument(
        "--kv-integrity-key-file",
        default=None,
        metavar="PATH",
        help=f"secret (>= {MIN_SECRET_BYTES} characters) sealing what the engine stores in the "
        "kvstore; replicas share KV and sessions only with the same one (default: a random "
        "key per process)",
    )
    return p


def read_integrity_key(path: str) -> bytes:
    """The kv integrity secret in ``path``: its contents, surrounding whitespace stripped."""
    key = read_secret_file(path, "--kv-integrity-key-file")
    if len(key) < MIN_SECRET_BYTES:
        raise ValueError(
            f"--kv-integrity-key-file: the key in {path} has {len(key)} characters; "
            f"at least {MIN_SECRET_BYTES} are required"
        )
    return key.encode()


def kvstore_config(args: argparse.Namespace) -> KvStoreConfig | None:
    options: dict[str, Any] = {}
    if args.kv_integrity_key_file:  # checked even without --kvstore: a bad file is a mistake
        options["integrity_key"] = read_integrity_key(args.kv_integrity_key_file)
    if not args.kvstore:
        return None
    token = None
    if args.kvstore_auth_token_file:
        token = read_secret_file(args.kvstore_auth_token_file, "--kvstore-auth-token-file")
    elif not args.kvstore_insecure:
        token = os.environ.get(AUTH_TOKEN_ENV) or None
    return KvStoreConfig(
        args.kvstore,
        timeout_s=args.kvstore_timeout_s,
        auth_token=token,
        insecure=args.kvstore_insecure,
        tls_ca_file=args.kvstore_tls_ca_file,
        tls_cert_file=args.kvstore_tls_cert_file,
        tls_key_file=args.kvstore_tls_key_file,
        **options,
    )


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    model_dir = args.model
    if model_dir == "default":
        from .convert.default_model import resolve_model

        model_dir = str(resolve_model("default"))
    tokens: list[tuple[str, str]] = []
    if os.environ.get("GENAI_AUTH_TOKEN"):
        tokens.append((os.environ["GENAI_AUTH_TOKEN"], "default"))
    if args.auth_token_file:
        for n, line in enumerate(Path(args.auth_token_file).read_text().splitlines(), 1):
            fields = line.split()
            if not fields or fields[0].startswith("#"):
                continue
            if len(fields) != 2:
                raise ValueError(f"{args.auth_token_file}:{n}: expected 'PRINCIPAL TOKEN'")
            tokens.append((fields[1], fields[0]))
    engine = EngineConfig(
        model_dir=model_dir,
        runner=RunnerConfig(intra_op_threads=args.intra_op_threads, runner=args.runner),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_queue=args.max_queue,
        ),
        cache=CacheConfig(
            chunk_size=args.kv_chunk_size,
            prefix_cache_bytes=args.prefix_cache_bytes,
            prefix_cache_scope=args.prefix_cache_scope,  # None: ServerConfig picks by auth
        ),
        sessions=SessionConfig(
            max_sessions=args.max_sessions,
            idle_ttl_s=args.idle_ttl_s,
            max_parked_kv_bytes=args.max_parked_kv_bytes,
            max_metadata_entries=args.max_metadata_entries,
            max_metadata_key_bytes=args.max_metadata_key_bytes,
            max_metadata_value_bytes=args.max_metadata_value_bytes,
            max_metadata_bytes=args.max_metadata_bytes,
            max_record_fetches=args.max_record_fetches,
        ),
        limits=LimitsConfig(
            default_max_new_tokens=args.default_max_new_tokens,
            max_new_tokens_limit=args.max_new_tokens_limit,
            max_constraint_bytes=args.max_constraint_bytes,
        ),
        speculation=SpeculationConfig(
            num_tokens=args.speculate, max_batch=args.speculate_max_batch
        ),
        max_context_length=args.max_context_length,
        kvstore=kvstore_config(args),
    )
    return ServerConfig(
        auth_tokens=tuple(tokens),
        metrics_port=args.metrics_port,
        http_port=args.http_port,
        tls_cert_file=args.tls_cert_file,
        tls_key_file=args.tls_key_file,
        tls_client_ca_file=args.tls_client_ca_file,
        engine=engine,
        host=args.host,
        port=args.port,
        grace_period_s=args.grace_period_s,
        log_format=args.log_format,
        stream_interval=args.stream_interval,
        constraint_check_workers=args.constraint_check_workers,
        constraint_check_timeout_ms=args.constraint_check_timeout_ms,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_format)
    log = structlog.get_logger("genai-server")
    try:
        config = config_from_args(args)
    except (ValueError, OSError) as exc:
        log.error("bad_configuration", error=str(exc))
        return 2
    if config.engine.kvstore is not None and config.engine.kvstore.insecure:
        log.warning("kvstore_insecure", target=config.engine.kvstore.target, auth=False)
    if config.engine.kvstore is not None and not args.kv_integrity_key_file:
        log.warning(
            "kv_integrity_key_generated",
            detail="no --kv-integrity-key-file: a random key for this process, so it trusts "
            "only KV chunks and sessions it wrote itself (no reuse across replicas or restarts)",
        )
    from .server.app import serve

    try:
        asyncio.run(serve(config))
    except Exception as exc:
        log.error("server_failed", error=str(exc), exc_info=exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
