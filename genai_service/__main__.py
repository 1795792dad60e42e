"""``genai-server``: the one place where flags become configuration."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import structlog

from genai_common.credentials import MIN_SECRET_BYTES, read_secret_file
from genai_common.flags import (
    TLS_FIELDS,
    HelpFormatter,
    add_auth_token_file,
    add_flags,
    add_logging_flags,
    flag_values,
)
from genai_common.logging import configure_logging
from kvstore.protocol import AUTH_TOKEN_ENV

from .config import (
    CacheConfig,
    ContextConfig,
    EngineConfig,
    KvStoreConfig,
    LimitsConfig,
    RunnerConfig,
    SchedulerConfig,
    ServerConfig,
    SessionConfig,
    SpeculationConfig,
)

# The engine's kvstore connection: --kvstore-timeout-s sets KvStoreConfig.timeout_s.
KVSTORE_PREFIX = "kvstore_"
KVSTORE_TLS_FIELDS = ("tls_ca_file", "tls_cert_file", "tls_key_file")


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``genai-server``: each one that sets a config field is
    declared with that field (config.py; ``genai_common.flags``), named after
    it (``--max-parked-kv-bytes`` sets ``SessionConfig.max_parked_kv_bytes``),
    with its default; older names stay as aliases. Only the flags that set no
    single field (a file to read, a target that makes a ``KvStoreConfig``) are
    written here."""
    p = argparse.ArgumentParser(
        prog="genai-server",
        description="LLM text generation on ONNX Runtime over gRPC",
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--model",
        required=True,
        help="model directory, or a named model: 'default' (SmolLM2-135M-Instruct) "
        "or 'gemma3-270m' (Gemma 3 270M)",
    )
    add_flags(p, ServerConfig, only=("host", "port"))
    add_logging_flags(p, ServerConfig.log_format)
    add_flags(p, ServerConfig, only=("metrics_port", "http_port", "grace_period_s"))
    add_flags(p, ServerConfig, only=("strict_openai",))
    p.add_argument(
        "--served-model-name",
        action="append",
        default=None,
        metavar="NAME",
        help="a name the HTTP API serves the model under (repeatable): /v1/models lists "
        "them and a request's model must be one (default: 'default' and the model id)",
    )
    add_flags(
        p.add_argument_group("HTTP connections"),
        ServerConfig,
        only=(
            "http_header_timeout_s",
            "http_body_timeout_s",
            "http_idle_timeout_s",
            "http_max_connections",
        ),
    )
    add_flags(p, ServerConfig, only=("stream_interval",))
    g = p.add_argument_group("engine")
    for part in (
        RunnerConfig,
        EngineConfig,
        SchedulerConfig,
        CacheConfig,
        LimitsConfig,
        ContextConfig,
    ):
        add_flags(g, part)
    add_flags(g, ServerConfig, only=("constraint_check_workers", "constraint_check_timeout_ms"))
    add_flags(g, SpeculationConfig)
    add_flags(p.add_argument_group("sessions"), SessionConfig)
    a = p.add_argument_group("security")
    add_auth_token_file(
        a, "bearer tokens, one 'PRINCIPAL TOKEN' per line (env GENAI_AUTH_TOKEN: one token)"
    )
    add_flags(a, ServerConfig, only=TLS_FIELDS)
    k = p.add_argument_group("kvstore (data plane)")
    k.add_argument(
        "--kvstore",
        default=None,
        metavar="HOST:PORT",
        help="share KV chunks and session records through this genai-kvstore",
    )
    add_flags(k, KvStoreConfig, KVSTORE_PREFIX, only=("timeout_s",))
    k.add_argument(
        "--kvstore-auth-token-file",
        default=None,
        metavar="PATH",
        help="the data-plane bearer token (env GENAI_KVSTORE_AUTH_TOKEN); required with "
        "--kvstore unless --kvstore-insecure",
    )
    add_flags(k, KvStoreConfig, KVSTORE_PREFIX, only=("insecure", *KVSTORE_TLS_FIELDS))
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
        auth_token=token,
        **flag_values(args, KvStoreConfig, KVSTORE_PREFIX),
        **options,
    )


def _served_names(args: argparse.Namespace, model_dir: str) -> tuple[str, ...]:
    """--served-model-name; without it, a named model other than 'default'
    (--model gemma3-270m) is served under its name too, beside 'default' and
    the model id (the gateway's own default: ServerConfig.served_model_names)."""
    if args.served_model_name:
        return tuple(args.served_model_name)
    if args.model != model_dir and args.model != "default":
        return ("default", args.model, Path(model_dir).name)
    return ()


def _speculation(
    args: argparse.Namespace, named: Any, resolve: Callable[[str], Path]
) -> SpeculationConfig:
    """The speculation flags; a named draft model (``--draft-model default``)
    resolves as ``--model`` does."""
    values = flag_values(args, SpeculationConfig)
    if values.get("draft_model") in named:
        values["draft_model"] = str(resolve(values["draft_model"]))
    return SpeculationConfig(**values)


def _check_draft(engine: EngineConfig) -> None:
    """A draft model whose vocabulary is not the target's is refused before the
    server starts (the engine checks it again), naming the first mismatch."""
    draft = engine.speculation.draft_model
    if draft is None:
        return
    from .model.model_dir import load_model_spec
    from .model.tokenizer import Tokenizer, vocabulary_mismatch

    target_spec, draft_spec = load_model_spec(engine.model_dir), load_model_spec(draft)
    mismatch = vocabulary_mismatch(
        Tokenizer.from_dir(target_spec.path, target_spec),
        Tokenizer.from_dir(draft_spec.path, draft_spec),
    )
    if mismatch is not None:
        raise ValueError(f"draft_model {draft}: {mismatch}")


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    model_dir = args.model
    from .convert.default_model import NAMED_MODELS, resolve_model

    if model_dir in NAMED_MODELS:
        model_dir = str(resolve_model(model_dir))
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
        runner=RunnerConfig(**flag_values(args, RunnerConfig)),
        scheduler=SchedulerConfig(**flag_values(args, SchedulerConfig)),
        # prefix_cache_scope None: ServerConfig picks it by auth.
        cache=CacheConfig(**flag_values(args, CacheConfig)),
        sessions=SessionConfig(**flag_values(args, SessionConfig)),
        limits=LimitsConfig(**flag_values(args, LimitsConfig)),
        speculation=_speculation(args, NAMED_MODELS, resolve_model),
        context=ContextConfig(**flag_values(args, ContextConfig)),
        kvstore=kvstore_config(args),
        **flag_values(args, EngineConfig),
    )
    _check_draft(engine)
    return ServerConfig(
        engine=engine,
        auth_tokens=tuple(tokens),
        served_model_names=_served_names(args, model_dir),
        log_format=args.log_format,
        **flag_values(args, ServerConfig),
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
