"""``python -m bench.constrained_bench``: what a JSON-schema constraint costs per
decoded token (issue 15), in-process on the default model.

    python -m bench.constrained_bench                # table on stdout, JSON under bench/results/
    python -m bench.constrained_bench --reps 1 --new-tokens 64

For 1 and 8 concurrent streams, the same chat prompts run unconstrained and
with a JSON schema (a long array of small objects, so every request decodes
all ``--new-tokens`` tokens either way; unconstrained requests ignore EOS),
alternating rep by rep in one engine. A stream's decode rate is (tokens - 1)
/ (last token - first token); the table gives the median over reps of the
streams' mean rate and the overhead of the constraint. Where the installed
onnxruntime-genai has guidance (``GeneratorParams.set_guidance``), one
og.Generator stream runs the same schema for comparison (its own process).

``measure() -> dict`` and ``markdown(result) -> list[str]`` are the API for
``bench.run`` (section "constrained").
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 16},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": ITEM, "minItems": 50}
TOPICS = [
    "famous scientists",
    "painters",
    "football players",
    "poets",
    "chefs",
    "astronauts",
    "composers",
    "inventors",
]
TARGETS = {1: 0.10, 8: 0.15}
REPO = (
    Path(__file__).resolve().parent.parent
)  # issue 15: overhead at most 10 % at 1 stream, 15 % at 8


def _engine(model_dir: str, threads: int) -> Any:
    from genai_service.config import EngineConfig, RunnerConfig
    from genai_service.engine.engine import LLMEngine

    return LLMEngine(
        EngineConfig(model_dir=model_dir, runner=RunnerConfig(intra_op_threads=threads))
    )


def _prompt(engine: Any, topic: str) -> tuple[int, ...]:
    text = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"List {topic} as a JSON array of name, age and city."}]
    )
    return tuple(engine.tokenizer.encode(text, add_special_tokens=False))


def _rates(engine: Any, streams: int, new_tokens: int, constrained: bool, tag: str) -> float:
    """Mean decode tok/s of ``streams`` concurrent requests."""
    from genai_service.contract.request import Constraint, GenerationRequest, StoppingCriteria

    constraint = Constraint("json_schema", json.dumps(SCHEMA)) if constrained else None
    requests = [
        GenerationRequest(
            f"{tag}-{i}",
            _prompt(engine, TOPICS[i % len(TOPICS)]),
            stopping=StoppingCriteria(max_new_tokens=new_tokens, ignore_eos=True),
            constraint=constraint,
        )
        for i in range(streams)
    ]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = {r.request_id: 0 for r in requests}
    for r in requests:
        engine.add_request(r)
    done = 0
    while done < streams:
        for out in engine.step():
            now = time.perf_counter()
            if out.token_ids:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                count[out.request_id] += len(out.token_ids)
            done += out.finished
    engine.flush_finished()
    rates = [(count[r] - 1) / (last[r] - first[r]) for r in count if count[r] > 1]
    return statistics.fmean(rates)


def _og_child(model_dir: str, new_tokens: int, threads: int, reps: int) -> dict[str, Any]:
    """In the child process: og.Generator decode rates, unconstrained and guided."""
    import onnxruntime_genai as og

    if not hasattr(og.GeneratorParams, "set_guidance"):
        return {"skipped": "this onnxruntime-genai has no guidance"}
    config = og.Config(model_dir)
    options = {"session_options": {"intra_op_num_threads": threads}}
    config.overlay(json.dumps({"model": {"decoder": options}}))
    model = og.Model(config)
    tok = og.Tokenizer(model)
    chat = [{"role": "user", "content": f"List {TOPICS[0]} as a JSON array of name, age and city."}]
    ids = tok.encode(tok.apply_chat_template(json.dumps(chat), add_generation_prompt=True))
    total = len(ids) + new_tokens

    def run(schema: str | None) -> float:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=total, min_length=total)
        if schema is not None:
            params.set_guidance("json_schema", schema)
        gen = og.Generator(model, params)
        gen.append_tokens(ids)
        times = []
        while not gen.is_done():
            gen.generate_next_token()
            times.append(time.perf_counter())
        return (len(times) - 1) / (times[-1] - times[0])

    free, guided = [], []
    for _ in range(reps):
        free.append(run(None))
        guided.append(run(json.dumps(SCHEMA)))
    return {"free": statistics.median(free), "json_schema": statistics.median(guided)}


def _og_rates(model_dir: str, new_tokens: int, threads: int, reps: int) -> dict[str, Any]:
    """``_og_child`` in a process of its own (og and our engine never share one)."""
    args = json.dumps([model_dir, new_tokens, threads, reps])
    cmd = [sys.executable, "-m", "bench.constrained_bench", "--og-child", args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"skipped": "og.Generator run timed out"}
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        return {"skipped": f"og.Generator failed: {tail[0][:200]}"}
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def measure(
    model_dir: str | None = None,
    streams: Sequence[int] = (1, 8),
    new_tokens: int = 128,
    reps: int = 3,
    threads: int = 2,
    og: bool = True,
) -> dict[str, Any]:
    """Decode rates with and without the constraint, per stream count."""
    if model_dir is None:
        from genai_service.convert.default_model import resolve_model

        model_dir = str(resolve_model("default", progress=False))
    engine = _engine(model_dir, threads)
    _rates(engine, 1, 8, True, "warm")  # compile the schema, warm ORT
    rows = []
    for n in streams:
        free, constrained = [], []
        for rep in range(reps):
            free.append(_rates(engine, n, new_tokens, False, f"f{n}-{rep}"))
            constrained.append(_rates(engine, n, new_tokens, True, f"c{n}-{rep}"))
        f, c = statistics.median(free), statistics.median(constrained)
        rows.append(
            {
                "streams": n,
                "free_tok_s": f,
                "constrained_tok_s": c,
                "overhead": f / c - 1.0,
                "target": TARGETS.get(n),
            }
        )
    engine.close()
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "new_tokens": new_tokens,
        "reps": reps,
        "threads": threads,
        "rows": rows,
    }
    if og:
        result["og"] = _og_rates(model_dir, new_tokens, threads, reps)
    return result


def markdown(result: dict[str, Any]) -> list[str]:
    lines = [
        f"In-process `LLMEngine`, default model, {result['threads']} threads, "
        f"{result['new_tokens']} new tokens per stream (EOS ignored), median of "
        f"{result['reps']} alternating reps; the schema is an array of at least 50 "
        "`{name, age, city}` objects, so constrained streams decode every token too.",
        "",
        "| streams | unconstrained tok/s per stream | JSON schema tok/s | overhead | target |",
        "|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        target = row["target"]
        met = "" if target is None else (" *" if row["overhead"] <= target else "")
        lines.append(
            f"| {row['streams']} | {row['free_tok_s']:.1f} | {row['constrained_tok_s']:.1f} "
            f"| {100 * row['overhead']:+.1f} %{met} | "
            f"{'' if target is None else f'≤ {100 * target:.0f} %'} |"
        )
    og = result.get("og")
    if og:
        lines.append("")
        if "skipped" in og:
            lines.append(f"onnxruntime-genai guidance: skipped ({og['skipped']}).")
        else:
            lines.append(
                f"onnxruntime-genai `og.Generator` (1 stream, same schema): "
                f"{og['free']:.1f} tok/s unconstrained, {og['json_schema']:.1f} with "
                f"guidance ({100 * (og['free'] / og['json_schema'] - 1):+.1f} %)."
            )
    lines.append("")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.constrained_bench", description=__doc__)
    p.add_argument("--model", default=None, help="model dir (default: the default model)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-og", action="store_true", help="skip the onnxruntime-genai comparison")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--og-child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.og_child:
        try:
            print(json.dumps(_og_child(*json.loads(args.og_child))))
        except ImportError:
            print(json.dumps({"skipped": "onnxruntime-genai is not installed (make bench)"}))
        return 0
    result = measure(
        args.model,
        new_tokens=args.new_tokens,
        reps=args.reps,
        threads=args.threads,
        og=not args.no_og,
    )
    print("\n".join(markdown(result)))
    out = args.out or Path(__file__).parent / "results" / (
        "constrained-" + dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S") + ".json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
