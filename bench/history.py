"""``python -m bench.history``: the targets of issues 6 and 14 (``report.targets``)
across the full runs in ``bench/results/`` as one markdown table (a run per
column; ``*`` marks a met target; ``–``: not measured in that run, such as issue
14's rows in runs that predate them), to see which results hold and which flip
with the machine's load.

    python -m bench.history                     # every full run
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


def table(files: Sequence[Path]) -> str:
    """Targets as rows, runs as columns; runs of ``--quick`` plans are left out."""
    runs: list[tuple[str, dict[str, dict]]] = []
    for path in files:
        r = json.loads(path.read_text())
        if r["meta"]["plan"].get("quick"):
            continue
        runs.append((r["meta"]["date"], {t["target"]: t for t in targets(r)}))
    names: list[str] = []
    for _, ts in runs:
        names += [n for n in ts if n not in names]
    lines = [
        "| target | " + " | ".join(date[5:16].replace("T", " ") for date, _ in runs) + " | met |",
        "|---|" + "---|" * (len(runs) + 1),
    ]
    for name in names:
        cells, met = [], 0
        for _, ts in runs:
            t = ts.get(name)
            if t is None or t["measured"] != t["measured"]:  # absent, or NaN
                cells.append("–")
                continue
            met += bool(t["met"])
            cells.append(f"{t['measured']:.2f}{'*' if t['met'] else ''}")
        present = sum(1 for _, ts in runs if name in ts)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {met}/{present} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.history", description=__doc__.split("\n")[0])
    p.add_argument("--since", default="", help="first result file name (e.g. 20261130T2125)")
    args = p.parse_args(argv)
    files = sorted(f for f in RESULTS.glob("*.json") if f.name >= args.since)
    print(table(files))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
