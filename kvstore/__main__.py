"""``genai-kvstore``: the data-plane KV blob store (docs/design.md, "Processes and planes").

The only place that reads the kvstore's flags and environment.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import sys
from collections.abc import Mapping, Sequence

import structlog

from genai_common.credentials import read_secret_file
from genai_common.logging import configure_logging
from kvstore.protocol import AUTH_TOKEN_ENV
from kvstore.redis_tier import REDIS_PASSWORD_ENV, REDIS_URL_ENV, RedisConfig
from kvstore.server import KvStoreConfig, serve

_UNITS = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 1 << 10,
    "mi": 1 << 20,
    "gi": 1 << 30,
    "ti": 1 << 40,
}


def parse_bytes(text: str) -> int:
    """Parse a byte count such as "1073741824", "512MiB", "2G" or "1.5GiB"."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text, re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (e.g. 1073741824, 512MiB)")
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "").lower()])


def build_parser() -> argparse.ArgumentParser:
    defaults = KvStoreConfig(insecure=True)  # for the other fields' defaults only
    parser = argparse.ArgumentParser(
        prog="genai-kvstore",
        description=(
            "KV-cache blob store (kvstore.v1.KvStore): memory tier + optional disk tier "
            "+ optional Redis (Cluster) tier shared with other kvstores. "
            "Every KvStore RPC requires 'authorization: Bearer <token>' (health and "
            "reflection stay open): give the token with --auth-token-file, "
            f"${AUTH_TOKEN_ENV} or --auth-token, or start with --insecure."
        ),
    )
    parser.add_argument(
        "--host", default=defaults.host, help="address to bind (default %(default)s)"
    )
    parser.add_argument(
        "--port", type=int, default=defaults.port, help="port to bind (default %(default)s)"
    )
    parser.add_argument(
        "--memory-bytes",
        type=parse_bytes,
        default=defaults.memory_bytes,
        help="memory tier capacity, e.g. 4GiB (default %(default)s)",
    )
    parser.add_argument(
        "--disk-dir",
        default=defaults.disk_dir,
        help="directory of the disk tier (default: no disk tier)",
    )
    parser.add_argument(
        "--disk-bytes",
        type=parse_bytes,
        default=defaults.disk_bytes,
        help="disk tier capacity (default %(default)s)",
    )
    parser.add_argument(
        "--max-blob-bytes",
        type=parse_bytes,
        default=defaults.max_blob_bytes,
        help="largest blob a Put may store (default %(default)s)",
    )
    auth = parser.add_argument_group("security")
    token = auth.add_mutually_exclusive_group()
    token.add_argument(
        "--auth-token-file",
        default=None,
        metavar="PATH",
        help="file holding the bearer token KvStore RPCs require (surrounding whitespace stripped)",
    )
    token.add_argument(
        "--auth-token",
        default=None,
        help=f"the bearer token itself (visible to ps; prefer the file or ${AUTH_TOKEN_ENV}, "
        "which applies when neither flag is given)",
    )
    token.add_argument(
        "--insecure",
        action="store_true",
        help="require no token: any client that can connect may read and overwrite KV "
        "(logs a warning)",
    )
    # Flags are named after the KvStoreConfig field they set; older names stay as aliases.
    auth.add_argument(
        "--tls-cert-file",
        "--tls-cert",
        dest="tls_cert_file",
        default=defaults.tls_cert_file,
        metavar="PEM",
        help="serve TLS (with --tls-key-file)",
    )
    auth.add_argument(
        "--tls-key-file",
        "--tls-key",
        dest="tls_key_file",
        default=defaults.tls_key_file,
        metavar="PEM",
    )
    auth.add_argument(
        "--tls-client-ca-file",
        "--tls-client-ca",
        dest="tls_client_ca_file",
        default=defaults.tls_client_ca_file,
        metavar="PEM",
        help="require client certificates (mTLS)",
    )
    redis_defaults = RedisConfig(url="redis://localhost")  # for the defaults only
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
    shared.add_argument(
        "--redis-cluster", action="store_true", help="the url is a Redis Cluster node"
    )
    shared.add_argument(
        "--redis-password-file",
        default=None,
        metavar="PATH",
        help="file holding the Redis password (surrounding whitespace stripped)",
    )
    shared.add_argument(
        "--redis-ttl-s",
        type=int,
        default=redis_defaults.ttl_s,
        help="expiry of every value written to Redis, 0 for none: then Redis's "
        "maxmemory-policy (allkeys-lru) evicts (default %(default)s)",
    )
    shared.add_argument(
        "--redis-timeout-ms",
        type=int,
        default=redis_defaults.timeout_ms,
        help="bound on one Redis operation; slower is a miss (default %(default)s)",
    )
    shared.add_argument(
        "--redis-split-bytes",
        type=parse_bytes,
        default=redis_defaults.split_bytes,
        help="blobs above this are stored as parts of this size (default %(default)s)",
    )
    shared.add_argument(
        "--redis-key-prefix",
        default=redis_defaults.key_prefix,
        help="prefix of every Redis key (default %(default)s)",
    )
    shared.add_argument("--redis-tls-ca-file", default=None, metavar="PEM", help="rediss:// CA")
    shared.add_argument(
        "--redis-tls-cert-file", default=None, metavar="PEM", help="rediss:// client cert"
    )
    shared.add_argument("--redis-tls-key-file", default=None, metavar="PEM")
    parser.add_argument(
        "--grace-s",
        type=float,
        default=defaults.grace_s,
        help="seconds in-flight RPCs get on shutdown (default %(default)s)",
    )
    parser.add_argument("--log-format", choices=("json", "console"), default="json")
    parser.add_argument(
        "--log-level", choices=("debug", "info", "warning", "error"), default="info"
    )
    return parser


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> KvStoreConfig:
    """The configuration ``args`` and ``environ`` describe; ValueError or OSError when invalid."""
    if args.auth_token_file:
        token: str | None = read_secret_file(args.auth_token_file, "--auth-token-file")
    elif args.insecure:
        token = None
    else:
        token = args.auth_token or environ.get(AUTH_TOKEN_ENV) or None
    return KvStoreConfig(
        redis=redis_config(args, environ),
        host=args.host,
        port=args.port,
        memory_bytes=args.memory_bytes,
        disk_dir=args.disk_dir,
        disk_bytes=args.disk_bytes,
        max_blob_bytes=args.max_blob_bytes,
        auth_token=token,
        insecure=args.insecure,
        tls_cert_file=args.tls_cert_file,
        tls_key_file=args.tls_key_file,
        tls_client_ca_file=args.tls_client_ca_file,
        grace_s=args.grace_s,
    )


def redis_config(args: argparse.Namespace, environ: Mapping[str, str]) -> RedisConfig | None:
    url = args.redis or environ.get(REDIS_URL_ENV)
    if not url:
        return None
    if args.redis_password_file:
        password: str | None = read_secret_file(args.redis_password_file, "--redis-password-file")
    else:
        password = environ.get(REDIS_PASSWORD_ENV) or None
    return RedisConfig(
        url=url,
        cluster=args.redis_cluster,
        password=password,
        ttl_s=args.redis_ttl_s,
        timeout_ms=args.redis_timeout_ms,
        split_bytes=args.redis_split_bytes,
        key_prefix=args.redis_key_prefix,
        tls_ca_file=args.redis_tls_ca_file,
        tls_cert_file=args.redis_tls_cert_file,
        tls_key_file=args.redis_tls_key_file,
    )


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
