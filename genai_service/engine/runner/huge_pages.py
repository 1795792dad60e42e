"""The weights of a fresh ONNX Runtime session onto transparent huge pages.

A decode step reads all of a session's packed weights (~150 MB at int8 for
SmolLM2); on 4 KiB pages that is tens of thousands of TLB misses a step, and
the hardware prefetcher stops at every page edge. ``load_session`` notes this
process's anonymous mappings before the session loads and, after, advises the
new ones (where the weights landed) ``MADV_HUGEPAGE`` and collapses them at
once (``MADV_COLLAPSE``, Linux 6.1+; elsewhere the kernel's khugepaged does it
in time, or nothing happens where huge pages are off). Only those mappings:
memory allocated later (activations, a prefill's scratch) stays on the
system's default pages (docs/design.md, "Processes and planes").
"""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path

import onnxruntime as ort
import structlog

log = structlog.get_logger(__name__)

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
HUGE_PAGE = 2 << 20
MIN_BYTES = 2 * HUGE_PAGE  # smaller mappings are not worth a system call

_madvise = None


def _libc_madvise():  # noqa: ANN202 (a ctypes function)
    global _madvise
    if _madvise is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        _madvise = libc.madvise
    return _madvise


def anonymous_mappings() -> set[tuple[int, int]]:
    """This process's private writable mappings backed by no file (and the
    heap), as ``(start, end)``; empty where ``/proc`` is not there."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return set()
    out = set()
    for line in lines:
        fields = line.split()
        if len(fields) < 5 or not fields[1].startswith("rw") or fields[1][3:4] != "p":
            continue
        if len(fields) == 6 and fields[5] != "[heap]":
            continue  # a file, the stack, vdso...
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        out.add((lo, hi))
    return out


def collapse(regions: set[tuple[int, int]]) -> int:
    """Advise each region's whole huge pages ``MADV_HUGEPAGE`` and collapse
    them; returns the bytes collapsed at once."""
    madvise = _libc_madvise()
    done = 0
    for lo, hi in sorted(regions):
        start = -(-lo // HUGE_PAGE) * HUGE_PAGE
        end = hi // HUGE_PAGE * HUGE_PAGE
        if end - start < MIN_BYTES:
            continue
        if madvise(start, end - start, MADV_HUGEPAGE) != 0:
            continue  # huge pages unsupported here
        if madvise(start, end - start, MADV_COLLAPSE) == 0:
            done += end - start
    return done


def load_session(
    model: str | bytes, options: ort.SessionOptions, huge_pages: bool
) -> ort.InferenceSession:
    """An ``InferenceSession`` on the CPU, its weights on huge pages when
    ``huge_pages`` (see the module's docstring)."""
    before = anonymous_mappings() if huge_pages else set()
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    if huge_pages:
        new = anonymous_mappings() - before
        collapsed = collapse(new)
        log.debug("session_huge_pages", mappings=len(new), collapsed_bytes=collapsed)
    return session
