"""The weights of a fresh ONNX Runtime session onto transparent huge pages.

A decode step reads all of a session's packed weights (~150 MB at int8 for
SmolLM2); on 4 KiB pages that is tens of thousands of TLB misses a step, and
the hardware prefetcher stops at every page edge. ``load_session`` notes the
address ranges of this process's anonymous mappings before the session loads
and, after, advises the ranges the load added (where the weights landed)
``MADV_HUGEPAGE`` and collapses them at once (``MADV_COLLAPSE``, Linux 6.1+;
elsewhere the kernel's khugepaged does it in time). Only those ranges: memory
that was there before (the KV buffers, which ask for small pages) and memory
allocated later (activations, a prefill's scratch) keeps the system's default
pages; where the system's transparent huge pages are ``never``, nothing is
advised (docs/design.md, "Processes and planes").
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import onnxruntime as ort
import structlog

from ...config import RunnerConfig

log = structlog.get_logger(__name__)

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
THP = Path("/sys/kernel/mm/transparent_hugepage")
DEFAULT_HUGE_PAGE = 2 << 20

Range = tuple[int, int]


def thp_mode() -> str | None:
    """The system's transparent-huge-page setting ("always", "madvise",
    "never"), or None where there is none to read."""
    try:
        text = (THP / "enabled").read_text()
        return text[text.index("[") + 1 : text.index("]")]
    except (OSError, ValueError):
        return None


def huge_page_size() -> int:
    try:
        return int((THP / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return DEFAULT_HUGE_PAGE


def anonymous_mappings() -> list[Range]:
    """This process's private writable mappings backed by no file (the heap
    and named anonymous ones included), as ``(start, end)``; empty where
    ``/proc`` is not there."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 5 or not fields[1].startswith("rw") or fields[1][3:4] != "p":
            continue
        name = fields[5].strip() if len(fields) == 6 else ""
        if name and name != "[heap]" and not name.startswith("[anon:"):
            continue  # a file, the stack, vdso...
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        out.append((lo, hi))
    return out


def added(before: Iterable[Range], after: Iterable[Range]) -> list[Range]:
    """The parts of ``after``'s ranges that no range of ``before`` covered:
    a mapping that grew or merged with a new neighbour adds only its new part."""
    old = sorted(before)
    out = []
    for lo, hi in sorted(after):
        start = lo
        for a, b in old:
            if b <= start or a >= hi:
                continue
            if a > start:
                out.append((start, a))
            start = max(start, b)
            if start >= hi:
                break
        if start < hi:
            out.append((start, hi))
    return out


def _madvise() -> Callable[..., int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn: Any = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


def collapse(ranges: Iterable[Range]) -> int:
    """Advise each range's whole huge pages ``MADV_HUGEPAGE`` and collapse
    them; returns the bytes of the ranges collapsed at once (a range with one
    huge page left uncollapsed counts none)."""
    size = huge_page_size()
    spans = []
    for lo, hi in ranges:
        start, end = -(-lo // size) * size, hi // size * size
        if end - start >= 2 * size:  # smaller ones are not worth a system call
            spans.append((start, end))
    madvise = _madvise() if spans else None
    if madvise is None:
        return 0
    done = 0
    for start, end in spans:
        if madvise(start, end - start, MADV_HUGEPAGE) != 0:
            log.debug("madvise_hugepage_failed", errno=ctypes.get_errno())
            continue
        if madvise(start, end - start, MADV_COLLAPSE) == 0:
            done += end - start
    return done


def load_session(
    model: str | bytes, options: ort.SessionOptions, config: RunnerConfig
) -> ort.InferenceSession:
    """An ``InferenceSession`` on the CPU, its weights on huge pages when
    ``config.huge_pages`` is "on" and the system has them (see the module's
    docstring)."""
    wanted = config.huge_pages == "on" and thp_mode() in ("madvise", "always")
    before = anonymous_mappings() if wanted else []
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    if wanted:
        new = added(before, anonymous_mappings())
        collapsed = collapse(new)
        log.debug("session_huge_pages", ranges=len(new), collapsed_bytes=collapsed)
    return session
