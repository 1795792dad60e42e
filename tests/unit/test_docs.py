"""docs/design.md is the design of record: what cites it names its sections, nothing cites elsewhere."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
SOURCES = (
    "genai_service",
    "genai_client",
    "genai_common",
    "kvstore",
    "protos",
    "tests",
    "bench",
    "docs",
    "k8s",
    "clients",
)
# Build output and installed dependencies under SOURCES (not ours to check).
SKIPPED_DIRS = {"_proto", "results", "node_modules", "gen", "dist"}
# The team's shared notes live outside the repository; nothing here cites them.
OUTSIDE = ("DESIGN.md", "DESIGN §", "MODEL_NOTES.md", "STYLE.md", "../shared")
SUFFIXES = {".py", ".pyi", ".proto", ".md", ".yaml", ".yml", ".go", ".ts"}
# A citation: docs/design.md, "Section" (the comma may be left out).
CITATION = re.compile(r'docs/design\.md,? "([^"]+)"')
# A cross-reference inside docs/design.md: (see "Section").
SEE = re.compile(r'see "([^"]+)"')


def _files() -> Iterator[Path]:
    yield ROOT / "README.md"
    yield ROOT / "Makefile"
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*")):
            if SKIPPED_DIRS & set(path.parts) or path == Path(__file__):
                continue
            if path.is_file() and path.suffix in SUFFIXES:
                yield path


def _headings() -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", DESIGN.read_text(), re.M)}


def test_nothing_cites_the_shared_design_document() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in _files()
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if any(name in line for name in OUTSIDE)
    ]
    assert found == [], "cite docs/design.md sections by name (or docs/*.md) instead"


def test_every_citation_names_a_section_of_docs_design_md() -> None:
    headings = _headings()
    assert {
        "Processes and planes",
        "Model directory",
        "KV chunk contract",
        "Status codes",
        "Security",
        "Public API names",
    } <= headings
    cited = [
        (str(path.relative_to(ROOT)), name)
        for path in _files()
        for name in CITATION.findall(path.read_text(errors="replace"))
    ]
    cited += [("docs/design.md (see)", name) for name in SEE.findall(DESIGN.read_text())]
    bad = [(where, name) for where, name in cited if name not in headings]
    assert bad == []


def test_citations_are_found() -> None:
    # The pattern above must actually see the citations (a typo in it would pass vacuously).
    cited = {name for path in _files() for name in CITATION.findall(path.read_text())}
    assert {"Status codes", "KV chunk contract", "Processes and planes"} <= cited
