"""``python -m bench.history``: the headline targets (``report.targets`` with
``headline``) across the full runs in ``bench/results/`` as one markdown table
(a run per column, the latest last; ``*`` marks a met target; ``–``: not
measured in that run), to see which results hold and which flip with the
machine's load. ``bench.run`` puts it at the end of docs/benchmarks.md.

    python -m bench.history                     # the headline targets, the last 12 runs
    python -m bench.history --all --runs 0      # every target, every run
    python -m bench.history --since 20261130T2125
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from .procs import REPO
from .report import targets

RESULTS = REPO / "bench" / "results"
RUNS = 12  # columns of the table in docs/benchmarks.md


def table(files: Sequence[Path], *, headline_only: bool = True, runs: int = RUNS) -> str:
    """Targets as rows, runs as columns; runs of ``--quick`` plans are left out."""
    found: list[tuple[str, dict[str, dict]]] = []
    for path in files:
        r = json.loads(path.read_text())
        if r["meta"]["plan"].get("quick"):
            continue
        ts = targets(r)
        if headline_only:
            ts = [t for t in ts if t.get("headline")]
        found.append((r["meta"]["date"], {t["target"]: t for t in ts}))
    if runs:
        found = found[-runs:]
    names: list[str] = []
    for _, ts in found:
        names += [n for n in ts if n not in names]
    lines = [
        "| target | " + " | ".join(date[5:16].replace("T", " ") for date, _ in found) + " | met |",
        "|---|" + "---|" * (len(found) + 1),
    ]
    for name in names:
        cells, met = [], 0
        for _, ts in found:
            t = ts.get(name)
            if t is None or t["measured"] != t["measured"]:  # absent, or NaN
                cells.append("–")
                continue
            met += bool(t["met"])
            cells.append(f"{t['measured']:.2f}{'*' if t['met'] else ''}")
        present = sum(1 for _, ts in found if name in ts)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {met}/{present} |")
    return "\n".join(lines)


def result_files(since: str = "") -> list[Path]:
    """The full runs' JSON files (not the per-script ones such as sampler-*.json)."""
    return sorted(f for f in RESULTS.glob("2*.json") if f.name >= since)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.history", description=__doc__.split("\n")[0])
    p.add_argument("--since", default="", help="first result file name (e.g. 20261130T2125)")
    p.add_argument("--all", action="store_true", help="every target, not the headline ones")
    p.add_argument("--runs", type=int, default=RUNS, help="the last N runs (0: all)")
    args = p.parse_args(argv)
    print(table(result_files(args.since), headline_only=not args.all, runs=args.runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
