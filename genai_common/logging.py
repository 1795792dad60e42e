"""structlog set-up, done once at start-up by each entry point (and the engine process)."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(fmt: str = "console", level: str = "INFO") -> None:
    """``fmt``: "json" (production: one JSON object per line) or "console" (dev)."""
    if fmt not in ("json", "console"):
        raise ValueError(f"log format must be json or console, got {fmt!r}")
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
