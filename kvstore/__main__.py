"""``genai-kvstore``: the data-plane KV blob store (docs/design.md, "Processes and planes").

The only place that reads the kvstore's flags and environment.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Mapping, Sequence

import structlog

from genai_common.credentials import read_secret_file
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
from kvstore.redis_tier import REDIS_PASSWORD_ENV, REDIS_URL_ENV, RedisConfig
from kvstore.server import KvStoreConfig, serve

REDIS_PREFIX = "redis_"  # --redis-ttl-s sets RedisConfig.ttl_s


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``genai-kvstore``: those that set a config field are declared
    with it (``KvStoreConfig``, ``RedisConfig``; ``genai_common.flags``); the
    TLS and logging groups are the ones ``genai-server`` has too."""
    parser = argparse.ArgumentParser(
        prog="genai-kvstore",
        description=(
            "KV-cache blob store (kvstore.v1.KvStore): memory tier + optional disk tier "
            "+ optional Redis (Cluster) tier shared with other kvstores. "
            "Every KvStore RPC requires 'authorization: Bearer <token>' (health and "
            "reflection stay open): give the token with --auth-token-file, "
            f"${AUTH_TOKEN_ENV} or --auth-token, or start with --insecure."
        ),
        formatter_class=HelpFormatter,
    )
    add_flags(parser, KvStoreConfig, only=STORE_FIELDS)
    auth = parser.add_argument_group("security")
    token = auth.add_mutually_exclusive_group()
    add_auth_token_file(
        token,
        "file holding the bearer token KvStore RPCs require (surrounding whitespace stripped)",
    )
    token.add_argument(
        "--auth-token",
        default=None,
        help=f"the bearer token itself (visible to ps; prefer the file or ${AUTH_TOKEN_ENV}, "
        "which applies when neither flag is given)",
    )
    add_flags(token, KvStoreConfig, only=("insecure",))
    add_flags(auth, KvStoreConfig, only=TLS_FIELDS)
    shared = parser.add_argument_group("Redis tier (docs/design.md, 'Redis tier')")
    shared.add_argument(
        "--redis",
        default=None,
        metavar="URL",
        help="Redis behind the local tiers, shared by kvstores: redis://HOST:PORT[/DB], "
        "rediss:// for TLS, redis+cluster:// or rediss+cluster:// (any node) for a Redis "
        f"Cluster (default: ${REDIS_URL_ENV}, else no Redis tier). Give a password with "
        f"--redis-password-file or ${REDIS_PASSWORD_ENV} rather than in the url (argv is "
        "visible to ps)",
    )
    add_flags(shared, RedisConfig, REDIS_PREFIX, only=("cluster",))
    shared.add_argument(
        "--redis-password-file",
        default=None,
        metavar="PATH",
        help="file holding the Redis password (surrounding whitespace stripped)",
    )
    add_flags(shared, RedisConfig, REDIS_PREFIX, only=REDIS_FIELDS)
    add_flags(parser, KvStoreConfig, only=("grace_s",))
    add_logging_flags(parser, "json", level=True)
    return parser


STORE_FIELDS = ("host", "port", "memory_bytes", "disk_dir", "disk_bytes", "max_blob_bytes")
REDIS_FIELDS = (
    "ttl_s",
    "timeout_ms",
    "split_bytes",
    "key_prefix",
    "tls_ca_file",
    "tls_cert_file",
    "tls_key_file",
)


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> KvStoreConfig:
    """The configuration ``args`` and ``environ`` describe; ValueError or OSError when invalid."""
    if args.auth_token_file:
        token: str | None = read_secret_file(args.auth_token_file, "--auth-token-file")
    elif args.insecure:
        token = None
    else:
        token = args.auth_token or environ.get(AUTH_TOKEN_ENV) or None
    return KvStoreConfig(
        redis=redis_config(args, environ), auth_token=token, **flag_values(args, KvStoreConfig)
    )


def redis_config(args: argparse.Namespace, environ: Mapping[str, str]) -> RedisConfig | None:
    url = args.redis or environ.get(REDIS_URL_ENV)
    if not url:
        return None
    if args.redis_password_file:
        password: str | None = read_secret_file(args.redis_password_file, "--redis-password-file")
    else:
        password = environ.get(REDIS_PASSWORD_ENV) or None
    return RedisConfig(url=url, password=password, **flag_values(args, RedisConfig, REDIS_PREFIX))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_format, args.log_level.upper())
    try:
        config = config_from_args(args, os.environ)
    except (ValueError, OSError) as exc:
        structlog.get_logger("kvstore").error("invalid configuration", error=str(exc))
        return 2

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(config, stop)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
