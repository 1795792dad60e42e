"""``python -m bench.run``: genai-grpc against onnxruntime-genai, one run.

    python -m bench.run                 # the full run (median of 3 reps, ~20 min on 2 cores)
    python -m bench.run --quick         # 1 rep, fewer lengths, shorter outputs (smoke test)
    python -m bench.run --reps 5 --out bench/results/mine.json
    python -m bench.run --sections single,sessions
    python -m bench.run --samplings greedy,sampled  # fewer samplings per row (faster)
    python -m bench.run --llama-server ~/llama.cpp/build/bin/llama-server  # + ~4 min

Writes JSON to ``bench/results/<timestamp>.json`` (kept in the repository:
``bench.history`` reads every run) and rewrites ``docs/benchmarks.md`` with
this run's tables and the history (a full run only: not for ``--quick`` or a
subset of ``--sections`` unless ``--doc``). What is measured and how:
``bench/suite.py``; the timing rules: ``bench/ours.py`` and ``bench/ortgenai.py``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import structlog

from genai_common.logging import configure_logging
from genai_service.convert.convert import ConvertOptions, convert
from genai_service.convert.default_model import default_cache_dir, default_gguf, resolve_model

from . import history, report
from .procs import REPO, CpuLedger, machine_info, versions
from .suite import NOISY_CORES, Bench
from .workload import SAMPLINGS, Plan

log = structlog.get_logger("bench")
SECTIONS = (
    "single",
    "sessions",
    "concurrency",
    "surface",
    "long",
    "speculation",
    "llama_server",
    "sampler",
    "step_profile",
    "constrained",
    "session_fork",
    "session_slide",
    "draft_speculation",
    "gemma3",
    "kvstore",
    "fleet",
    "http",
)
# Sections run after the engines of the others are gone (they start their own, or
# time CPU work that the others' idle threads would disturb).
AFTER_CLOSE = (
    "sampler",
    "step_profile",
    "constrained",
    "session_fork",
    "session_slide",
    "draft_speculation",
    "gemma3",
    "kvstore",
    "fleet",
    "http",
)
DOC = REPO / "docs" / "benchmarks.md"
DOC_HEADER = """# Benchmarks

`make bench` (or `python -m bench.run`) measures genai-grpc against onnxruntime-genai on the
default model (SmolLM2-135M-Instruct) in one run and rewrites this page: the run's tables,
then the history of the headline targets across runs (`python -m bench.history`; every
target: `--all`). The raw numbers of every full run are in `bench/results/<timestamp>.json`
(kept in the repository); the runs before 2026-12-03, as they were appended then, are in
docs/benchmarks-archive.md. Absolute times depend on the machine and its load; the ratios are
what to compare. `docs/design.md` explains the engine. Every concurrency row runs greedy,
sampled (temperature 0.7, top_p 0.9, top_k 50) and sampled with repetition_penalty 1.1
against og.Engine with the same settings; single streams greedy and sampled against
og.Generator, plus one stream filling the model's 8,192-token window; a table of CPU per
generated token per process (from /proc). The first concurrency shape is driven twice through
the server: by the Python asyncio client and by the Go client (`clients/go/cmd/genai-bench`,
which `make bench` builds; `--go-client PATH`), so the client's own CPU shows. Options:
`--quick` (smoke test, writes no page),
`--sections`, `--samplings greedy` (concurrency rows greedy only), `--llama-server PATH
[--gguf PATH]` (adds llama.cpp's `llama-server` on the same GGUF; skipped without a binary),
`--gemma3-builder DIR` (Gemma 3 270M against onnxruntime-genai's builder export of the same
weights, bench/gemma3_bench.py; docs/models.md says how to make it; a `--llama-server` binary
adds Gemma 3 against llama.cpp on its GGUF; skipped with neither).
"""


def page(section_md: str, history_md: str) -> str:
    """docs/benchmarks.md: the header, the latest run's section, the history."""
    return (
        DOC_HEADER
        + "\n"
        + section_md.rstrip("\n")
        + "\n\n## History of the headline targets\n\n"
        + "Ratios per run (`*`: met), the latest last; from `bench/results/*.json`.\n\n"
        + history_md
        + "\n"
    )


def og_engine_model_dir(model_dir: Path) -> Path:
    """A model directory og.Engine can run.

    onnxruntime-genai 0.18's static-batch Engine binds logits for every prompt
    position and fails on our graphs, which return the last position's only.
    For a converted model (``conversion.json``) we convert the same GGUF with
    the same options but ``all_logits``, once, next to the default model's cache.
    """
    meta_path = model_dir / "conversion.json"
    if not meta_path.is_file():
        return model_dir
    options = json.loads(meta_path.read_text())["options"]
    if options.get("all_logits"):
        return model_dir
    target = default_cache_dir() / f"bench-{model_dir.name}-all-logits"
    if target.is_dir():
        return target
    source = default_gguf().path
    if json.loads(meta_path.read_text()).get("source") != source.name:
        return model_dir  # not the default model: og.Engine gets the same directory
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        log.info("converting an all-logits graph for og.Engine (once)", out=str(target))
        convert(
            source,
            tmp,
            ConvertOptions(**{**options, "all_logits": True}),
            progress=False,
        )
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def kvstore_section(model_dir: str, reps: int, threads: int) -> dict:
    """Issue 4: a long prompt's TTFT cold vs. served from the kvstore, and Get throughput."""
    from . import kv_reuse, kvstore_bench

    return {
        "reuse": kv_reuse.measure(model_dir, 2048, reps, threads, 256),
        "throughput": kvstore_bench.measure(),
    }


def sampler_section() -> dict:
    """The sampler microbenchmark (``bench/sampler_bench.py``), where that module exists."""
    if importlib.util.find_spec(report.SAMPLER_MODULE) is None:
        return {"skipped": f"no {report.SAMPLER_MODULE} in this checkout"}
    module = importlib.import_module(report.SAMPLER_MODULE)
    result: dict = (module.measure_all if hasattr(module, "measure_all") else module.measure)()
    return result


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1 rep, fewer lengths (smoke test)")
    p.add_argument("--reps", type=int, default=None, help="repetitions per measurement (3)")
    p.add_argument("--out", type=Path, default=None, help="JSON output path")
    p.add_argument("--model", default="default", help="model directory, or 'default'")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads for every engine")
    p.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}"
    )
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=30.0,
        metavar="S",
        help="before each rep, wait up to S seconds for other work on the machine to pause (0: no)",
    )
    p.add_argument(
        "--retries",
        type=int,
        default=2,
        help=f"reruns of a rep during which other work took > {NOISY_CORES} cores (fresh prompts)",
    )
    p.add_argument(
        "--samplings",
        default=None,
        help=f"comma-separated samplings of the concurrency rows, of {tuple(SAMPLINGS)} (all)",
    )
    p.add_argument(
        "--llama-server",
        default=None,
        metavar="PATH",
        help="a llama-server binary: adds its section (skipped without one)",
    )
    p.add_argument(
        "--gguf", default=None, metavar="PATH", help="GGUF for llama-server (the default model's)"
    )
    p.add_argument(
        "--gemma3-builder",
        default=None,
        metavar="DIR",
        help="onnxruntime-genai's builder export of Gemma 3 270M (python -m "
        "bench.builder_reference --gemma3 --keep-gemma3 DIR): adds the gemma3 section",
    )
    p.add_argument(
        "--go-client",
        default=None,
        metavar="PATH",
        help="clients/go/cmd/genai-bench, built (make bench builds it): the first "
        "concurrency shape is also driven by the Go client (skipped when absent)",
    )
    doc = p.add_mutually_exclusive_group()
    doc.add_argument("--doc", dest="doc", action="store_true", default=None)
    doc.add_argument("--no-doc", dest="doc", action="store_false")
    return p.parse_args(argv)


def run_one(results: dict, failed: dict[str, str], name: str, measure: Callable[[], dict]) -> None:
    """One section: its result in ``results``, or (when it raises) the error in
    ``failed`` (``meta.failed_sections``) and the run goes on, so a section that
    cannot run (a missing tool, a crash) costs only its own numbers."""
    try:
        results[name] = measure()
    except Exception as exc:
        log.exception("section failed", section=name)
        failed[name] = f"{type(exc).__name__}: {exc}"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    configure_logging("console")
    sections = tuple(s for s in args.sections.split(",") if s)
    if args.llama_server and "llama_server" not in sections:
        sections += ("llama_server",)  # a binary given is a section asked for
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    plan = Plan.quick_plan(sections) if args.quick else Plan(sections=sections)
    if args.samplings is not None:
        chosen = tuple(x for x in args.samplings.split(",") if x)
        if not chosen or set(chosen) - set(SAMPLINGS):
            raise SystemExit(f"--samplings: choose from {tuple(SAMPLINGS)}")
        plan = Plan(**{**asdict(plan), "concurrency_samplings": chosen})
    if args.reps is not None:
        if args.reps < 1:
            raise SystemExit("--reps must be >= 1")
        plan = Plan(**{**asdict(plan), "reps": args.reps})
    plan = Plan(**{**asdict(plan), "threads": args.threads})
    started = time.perf_counter()
    date = dt.datetime.now(dt.UTC)
    model_dir = resolve_model(args.model).resolve()
    og_engine_dir = (
        og_engine_model_dir(model_dir) if {"sessions", "concurrency"} & set(sections) else model_dir
    )
    conversion = {}
    if (model_dir / "conversion.json").is_file():
        conversion = json.loads((model_dir / "conversion.json").read_text())
    results: dict = {
        "meta": {
            "date": date.strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine_info(),
            "versions": versions(),
            "plan": asdict(plan),
            "model": {
                "dir": str(model_dir),
                "name": conversion.get("source", model_dir.name),
                "weights": json.dumps(conversion.get("options", {})),
            },
            "og_engine_model": str(og_engine_dir),
        }
    }
    go_client = args.go_client if args.go_client and Path(args.go_client).is_file() else None
    if args.go_client and not go_client:
        log.warning("no Go bench client; its rows are skipped", path=args.go_client)
    bench = Bench(
        plan,
        model_dir,
        og_engine_dir,
        quiet_wait_s=args.quiet_wait,
        retries=args.retries,
        go_client=go_client,
    )
    results["meta"]["runner_kind"] = bench.inproc.runner_kind
    # Wall time and CPU per phase, and the CPU other work took meanwhile.
    phases: dict[str, dict] = {}
    ledger = CpuLedger()
    failed: dict[str, str] = {}

    def own(module: str) -> Any:
        return importlib.import_module(f"{__package__}.{module}")

    def timed_streams(module: str, new_tokens: int) -> Callable[[], dict]:
        """The measurement of a module whose ``measure`` streams ``new_tokens``
        (64 with --quick) per request, ``plan.reps`` times."""
        return lambda: own(module).measure(
            str(model_dir),
            reps=plan.reps,
            threads=args.threads,
            new_tokens=64 if args.quick else new_tokens,
        )

    def run_section(name: str, measure: Callable[[], dict]) -> None:
        run_one(results, failed, name, measure)
        phases[name] = ledger.lap()
        log.info("section done", section=name, **phases[name])

    try:
        results["cold_start"] = bench.warmup()
        phases["warmup"] = ledger.lap()
        for section in SECTIONS:
            if section not in sections or section in AFTER_CLOSE:
                continue
            if section == "llama_server":
                if not args.llama_server:
                    results[section] = {"skipped": "no --llama-server binary given"}
                    continue
                run_section(
                    section,
                    lambda: bench.llama_server(
                        args.llama_server, args.gguf or str(default_gguf().path)
                    ),
                )
            else:
                run_section(section, getattr(bench, section))
    finally:
        results["rss"] = bench.close()
    if "sampler" in sections:
        run_section("sampler", sampler_section)
    # Each section's module is imported inside its measurement, so that an import
    # failure is that section's failure too.
    if "step_profile" in sections:
        # In-process engines of their own, like the kvstore's.
        run_section(
            "step_profile",
            lambda: own("step_profile").summary(str(model_dir), threads=args.threads),
        )
    if "constrained" in sections:
        run_section("constrained", timed_streams("constrained_bench", 128))
    if "session_fork" in sections:
        run_section("session_fork", timed_streams("session_fork", 32))
    if "session_slide" in sections:
        run_section(
            "session_slide",
            lambda: own("session_slide").measure(
                str(model_dir), threads=args.threads, answer_tokens=48 if args.quick else 96
            ),
        )
    if "draft_speculation" in sections:
        # Five servers of its own on the default model's fp32 conversion (int4, int8
        # and a poor draft beside it), and a child process's cost model.
        run_section(
            "draft_speculation",
            lambda: own("draft_speculation").measure(
                reps=plan.reps, threads=args.threads, quick=args.quick
            ),
        )
    if "gemma3" in sections:
        # A server and onnxruntime-genai workers of its own, on the second model.
        # Either comparison runs alone: og with a builder directory, llama.cpp
        # with a binary.
        if args.gemma3_builder or args.llama_server:
            run_section(
                "gemma3",
                lambda: own("gemma3_bench").measure(
                    args.gemma3_builder,
                    reps=plan.reps,
                    threads=args.threads,
                    quick=args.quick,
                    llama_server=args.llama_server,
                ),
            )
        else:
            results["gemma3"] = {
                "skipped": "no --gemma3-builder directory or --llama-server binary given"
            }
    if "kvstore" in sections:
        # After the other engines are gone: it starts engines of its own.
        run_section("kvstore", lambda: kvstore_section(str(model_dir), plan.reps, args.threads))
    if "fleet" in sections:
        # Servers, sidecars and a Redis Cluster of its own.
        run_section("fleet", lambda: own("fleet").measure(str(model_dir), threads=args.threads))
    if "http" in sections:
        # A server of its own, with --http-port.
        run_section("http", timed_streams("http_bench", 256))
    results["meta"]["phases"] = phases
    results["meta"]["failed_sections"] = failed
    results["meta"]["elapsed_s"] = time.perf_counter() - started
    results["meta"]["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    results["meta"]["notes"] = bench.notes
    results["meta"]["noisy_measurements"] = bench.noisy
    results["meta"]["retried_reps"] = bench.retried
    results["meta"]["waited_for_quiet_s"] = round(bench.waited_s, 1)
    results["meta"]["noisy_threshold_cores"] = NOISY_CORES
    results["targets"] = report.targets(results)

    out = args.out or REPO / "bench" / "results" / f"{date.strftime('%Y%m%dT%H%M%SZ')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    section_md = report.markdown(results)
    # The page is one full run's: a quick run or a subset of sections leaves it.
    full = set(sections) == set(SECTIONS)
    write_doc = args.doc if args.doc is not None else not plan.quick and full
    if write_doc:
        DOC.write_text(page(section_md, history.table(history.result_files())))
    print(section_md)
    print(f"JSON: {out}" + (f"; {DOC} rewritten" if write_doc else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
