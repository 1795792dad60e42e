"""The weights of a fresh session onto transparent huge pages (engine/runner/huge_pages.py):
only the mappings the session's load made are advised and collapsed, never older ones
(the KV buffers, which ask for small pages), and ``--huge-pages off`` leaves every one alone."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest

from genai_service.config import RunnerConfig
from genai_service.engine.runner import huge_pages
from genai_service.engine.runner.shared_buffer_runner import SharedBufferRunner
from genai_service.model.model_dir import load_model_spec

HAS_THP = huge_pages.thp_mode() in ("madvise", "always")


def _smaps_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps entry of the mapping holding ``address``."""
    entry: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
            continue
        if inside:
            key, _, value = line.partition(":")
            entry[key] = value.strip()
    return entry


def _address(buf: mmap.mmap) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def test_huge_pages_must_be_on_or_off() -> None:
    with pytest.raises(ValueError, match="huge_pages must be one of on, off; got 'yes'"):
        RunnerConfig(huge_pages="yes")


def test_a_region_is_advised_and_collapsed() -> None:
    if not HAS_THP:
        pytest.skip(f"transparent huge pages are {huge_pages.thp_mode()!r} here")
    size = 16 << 20
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.write(b"\1" * size)  # resident on small pages
        start = _address(buf)
        collapsed = huge_pages.collapse({(start, start + size)})
        entry = _smaps_of(start)
        assert "hg" in entry["VmFlags"].split()
        if collapsed:  # MADV_COLLAPSE (Linux 6.1+): at once
            assert int(entry["AnonHugePages"].split()[0]) * 1024 >= collapsed
    finally:
        buf.close()


@pytest.mark.skipif(not HAS_THP, reason="no transparent huge pages here")
def test_loading_a_session_leaves_older_mappings_alone(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    older = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    older.madvise(mmap.MADV_NOHUGEPAGE)
    seen: list[list[tuple[int, int]]] = []
    real = huge_pages.collapse
    monkeypatch.setattr(
        huge_pages, "collapse", lambda regions: seen.append(regions) or real(regions)
    )
    spec = load_model_spec(tiny_models["gqa"])
    try:
        SharedBufferRunner(spec, RunnerConfig(huge_pages="off"), max_slots=2, max_len=64)
        assert seen == []
        SharedBufferRunner(spec, RunnerConfig(), max_slots=2, max_len=64)
        assert len(seen) == 1
        start = _address(older)
        assert not any(lo <= start < hi for lo, hi in seen[0])
        flags = _smaps_of(start)["VmFlags"].split()
        assert "nh" in flags and "hg" not in flags
    finally:
        older.close()


def test_only_what_a_load_added_is_advised() -> None:
    # a mapping that grew, one that merged with a new neighbour, one untouched
    before = [(0x1000, 0x5000), (0x9000, 0xA000), (0x20000, 0x30000)]
    after = [(0x1000, 0x8000), (0x9000, 0xC000), (0x20000, 0x30000), (0x40000, 0x50000)]
    assert huge_pages.added(before, after) == [
        (0x5000, 0x8000),
        (0xA000, 0xC000),
        (0x40000, 0x50000),
    ]
    assert huge_pages.added(after, after) == []
    assert huge_pages.added([(0x2000, 0x3000)], [(0x1000, 0x4000)]) == [
        (0x1000, 0x2000),
        (0x3000, 0x4000),
    ]


@pytest.mark.skipif(not HAS_THP, reason="no transparent huge pages here")
def test_a_sessions_new_memory_is_collapsed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in session whose "weights" are a fresh 16 MiB mapping: load_session
    advises exactly that range (so the feature cannot silently find nothing)."""
    weights: list[mmap.mmap] = []

    def fake_session(*args: object, **kw: object) -> object:
        buf = mmap.mmap(-1, 16 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf.write(b"\1" * (16 << 20))
        weights.append(buf)
        return object()

    seen: list[list[tuple[int, int]]] = []
    real = huge_pages.collapse
    monkeypatch.setattr(huge_pages.ort, "InferenceSession", fake_session)
    monkeypatch.setattr(huge_pages, "collapse", lambda ranges: seen.append(ranges) or real(ranges))
    try:
        huge_pages.load_session("model.onnx", None, RunnerConfig())  # type: ignore[arg-type]
        start = _address(weights[0])
        assert any(lo <= start and start + (16 << 20) <= hi for lo, hi in seen[0])
        assert "hg" in _smaps_of(start)["VmFlags"].split()
        huge_pages.load_session("model.onnx", None, RunnerConfig(huge_pages="off"))  # type: ignore[arg-type]
        assert len(seen) == 1
    finally:
        for buf in weights:
            buf.close()


def test_anonymous_mappings_see_a_new_one() -> None:
    before = huge_pages.anonymous_mappings()
    buf = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        start = _address(buf)
        new = huge_pages.added(before, huge_pages.anonymous_mappings())
        assert any(lo <= start < hi for lo, hi in new)
    finally:
        buf.close()
