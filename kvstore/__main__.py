"""``genai-kvstore``: the data-plane KV blob store (DESIGN.md §1, §4).

The only place that reads the kvstore's flags and environment.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import sys
from collections.abc import Sequence

import structlog

from genai_service.logging import configure_logging
from kvstore.server import KvStoreConfig, serve

AUTH_TOKEN_ENV = "GENAI_KVSTORE_AUTH_TOKEN"

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
    defaults = KvStoreConfig()
    parser = argparse.ArgumentParser(
        prog="genai-kvstore",
        description="KV-cache blob store (kvstore.v1.KvStore): memory tier + optional disk tier.",
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
        "--disk-dir", default=None, help="directory of the disk tier (default: no disk tier)"
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
    parser.add_argument(
        "--auth-token",
        default=None,
        help=f"bearer token required on KvStore RPCs (default: ${AUTH_TOKEN_ENV}, else none)",
    )
    parser.add_argument(
        "--grace-s",
        type=float,
        default=defaults.grace_s,
        help="seconds in-flight RPCs get on shutdown",
    )
    parser.add_argument("--log-format", choices=("json", "console"), default="json")
    parser.add_argument(
        "--log-level", choices=("debug", "info", "warning", "error"), default="info"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_format, args.log_level.upper())
    try:
        config = KvStoreConfig(
            host=args.host,
            port=args.port,
            memory_bytes=args.memory_bytes,
            disk_dir=args.disk_dir,
            disk_bytes=args.disk_bytes,
            max_blob_bytes=args.max_blob_bytes,
            auth_token=args.auth_token or os.environ.get(AUTH_TOKEN_ENV) or None,
            grace_s=args.grace_s,
        )
    except ValueError as exc:
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
