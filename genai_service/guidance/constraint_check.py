"""The constraint checker's process: compile and try out constraints before
the engine sees them (docs/design.md, "Structured output").

llguidance is native code: a grammar can overflow its stack, take a second to
compile, or take hundreds of MB. The frontend (``server/constraint_checker.py``)
sends each constraint it has not seen before here, where ``Guidance.check``
compiles it and matches its first tokens, and gets back an empty verdict or the
``INVALID_ARGUMENT`` message; a crash, a time-out or a bloated process costs
this process (restarted by the frontend) and that one request, never the
engine or the frontend.

The compiler thread's stack here is 8x smaller than the engine's
(``CHECK_STACK_BYTES`` against ``constraints.COMPILE_STACK_BYTES``): llguidance's
recursion depth is a function of the grammar alone, so whatever compiled here
compiles there. The process runs at a lower CPU priority than the engine, so a
slow compile takes time from streams only when a core is idle.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from multiprocessing.connection import Connection

import structlog

from genai_common import procfs
from genai_common.errors import GenAIError
from genai_common.logging import configure_logging

from ..contract.request import Constraint
from ..model.model_dir import ModelSpec
from ..model.tokenizer import Tokenizer
from .constraints import Guidance

log = structlog.get_logger(__name__)

CHECK_STACK_BYTES = 64 * 1024 * 1024
NICE = 10  # below the engine's priority


@dataclass(frozen=True)
class CheckJob:
    """One constraint to check; ``field`` is what its message names."""

    job_id: int
    constraint: Constraint
    field: str


@dataclass(frozen=True)
class Verdict:
    job_id: int
    error: str  # "" when the constraint may run; else the INVALID_ARGUMENT message
    rss_bytes: int  # the checker's resident memory after the job


@dataclass(frozen=True)
class CheckerReady:
    rss_bytes: int


def checker_main(
    conn: Connection,
    spec: ModelSpec,
    max_constraint_bytes: int,
    log_format: str,
    stack_bytes: int = CHECK_STACK_BYTES,
) -> None:
    """Entry point of the checker's process (started with ``spawn``): answer
    ``CheckJob``s with ``Verdict``s until the pipe closes or ``None`` arrives.
    ``stack_bytes``: the compiler thread's stack (tests make it small to see
    a crash)."""
    configure_logging(log_format)
    os.nice(NICE)
    tokenizer = Tokenizer.from_dir(spec.path, spec)
    guidance = Guidance(
        tokenizer.inner,
        spec.vocab_size,
        spec.eos_token_ids,
        max_constraint_bytes=max_constraint_bytes,
        cache_entries=0,  # the frontend keeps the verdicts
        compile_stack_bytes=stack_bytes,
    )
    conn.send(CheckerReady(procfs.rss_bytes()))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        try:
            guidance.check(job.constraint, job.field)
            error = ""
        except GenAIError as exc:
            error = exc.message
        except Exception as exc:  # llguidance raising on input it cannot take
            log.warning("constraint_check_raised", field=job.field, exc_info=exc)
            error = f"{job.field}: llguidance cannot compile it: {str(exc)[:512]}"
        conn.send(Verdict(job.job_id, error, procfs.rss_bytes()))
