"""What Linux's /proc says about a process: its CPU time and resident memory.

Used where one process watches another (the frontend its constraint
checker) or itself (the checker reporting its memory after each job).
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid``; 0.0 where /proc cannot be
    read (the process is gone, or this is not Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    except (OSError, IndexError, ValueError):
        return 0.0


def rss_bytes(pid: int | str = "self") -> int:
    """The resident set of process ``pid`` now (not its peak); 0 where /proc
    cannot be read."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * resource.getpagesize()
    except (OSError, IndexError, ValueError):
        return 0
