"""``python -m bench.gemma3_bench``: Gemma 3 270M against onnxruntime-genai (issue 27).

    python -m bench.builder_reference --builder-python VENV/bin/python --gemma3 \\
        --keep-gemma3 DIR                       # the builder's directory, made once
    python -m bench.gemma3_bench --builder-dir DIR [--llama-server PATH] [--reps 3]

The same weights on both sides: the Q4_K_M GGUF (``--model gemma3-270m``'s
file) dequantized into Hugging Face layout and exported by onnxruntime-genai's
own builder at fp32 (``bench/builder_reference.py``: no arithmetic of ours),
against our fp32 conversion of the same file (``genai-convert gemma3-270m DIR
--weights fp32``). Both keep the 262,144-token LM head at fp32, so the vocabulary's
cost (the LM head and the sampler over 262k logits) is in every row.

- single stream (128 new tokens, EOS ignored), prompts of 128 and 512 tokens,
  greedy and sampled: ``genai-server`` through ``GenerateStream`` against
  ``og.Generator`` (``past_present_share_buffer`` true);
- 8 concurrent streams of 64-token prompts + 128 new tokens, greedy and sampled:
  ``genai-server`` against ``og.Engine``;
- with ``--llama-server PATH`` (a binary; nothing here builds one), the same
  single-stream and 8-stream rows against llama.cpp's ``llama-server`` on the
  GGUF itself (``bench/llama.py``), ours on the conversion ``--model gemma3-270m``
  serves (``DEFAULT_WEIGHTS``) rather than fp32: llama.cpp runs the file at its
  own quantization, so each side runs what its user gets. Either comparison may
  run without the other.

Sampled = temperature 0.7, top_p 0.9, top_k 50 (``workload.SAMPLINGS``), the same
settings and a seed per request on both. Each rep draws fresh prompts from the
corpus (nothing cached), the engines take turns going first; medians over reps.

``measure(builder_dir, ..., llama_server=None) -> dict``, ``targets(result)`` and
``markdown(result) -> list[str]`` are the API bench.run uses.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .procs import REPO, machine_info, versions
from .workload import SAMPLINGS, TokenSource, concurrency_stats

SINGLE_PROMPTS = (128, 512)
SINGLE_NEW = 128
STREAMS = 8
STREAM_PROMPT, STREAM_NEW = 64, 128
SAMPLING_NAMES = ("greedy", "sampled")


def our_fp32_dir() -> str:
    from genai_service.convert.default_model import resolve_model

    return str(resolve_model("gemma3-270m", weights="fp32", progress=False))


def _params(name: str, seed: int) -> dict | None:
    s = SAMPLINGS[name]
    return None if s.greedy else {**s.params(), "seed": seed}


def _med(rows: Sequence[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def _in_turns(runs: dict[str, Callable[[], Any]], rep: int) -> list[tuple[str, Any]]:
    """Each engine's measurement, the engines taking turns going first by rep."""
    order = list(runs)
    if rep % 2:
        order.reverse()
    return [(engine, runs[engine]()) for engine in order]


def measure(
    builder_dir: str | None,
    reps: int = 3,
    threads: int = 2,
    quick: bool = False,
    llama_server: str | None = None,
) -> dict[str, Any]:
    """The og comparison (with ``builder_dir``) and the llama-server one (with
    ``llama_server``), each on servers of its own, one after the other."""
    if not builder_dir and not llama_server:
        raise ValueError("measure needs a builder directory, a llama-server binary or both")
    result: dict[str, Any] = _measure_og(builder_dir, reps, threads, quick) if builder_dir else {}
    if llama_server:
        result["llama"] = _measure_llama(llama_server, reps, threads, quick)
    result["targets"] = targets(result)
    return result


def _record_single(raw: dict, key: str, runs: dict[str, Callable[[], Any]], rep: int) -> None:
    """One single-stream row of each engine, in turns: TTFT, decode and the first 16
    token ids (where the engine reports them)."""
    for engine, out in _in_turns(runs, rep):
        raw["single"].setdefault(key, {}).setdefault(engine, []).append(
            {k: out[k] for k in ("ttft_s", "decode_tok_s")}
            | {"token_ids": out.get("token_ids", [])[:16]}
        )


def _record_concurrent(raw: dict, name: str, runs: dict[str, Callable[[], Any]], rep: int) -> None:
    for engine, out in _in_turns(runs, rep):
        stats = concurrency_stats(out["submit"], out["streams"])
        raw["concurrent"].setdefault(name, {}).setdefault(engine, []).append(stats)


def _medians(raw: dict, other: str) -> dict[str, Any]:
    """Medians over reps of ours and ``other``'s rows, keyed ``ours_*`` / ``{other}_*``."""
    return {
        "single": {
            key: {
                f"{side}_{metric}": _med(v[side], metric)
                for metric in ("ttft_s", "decode_tok_s")
                for side in ("ours", other)
            }
            for key, v in raw["single"].items()
        },
        "concurrent": {
            name: {
                f"{side}_{metric}": _med(v[side], stat)
                for metric, stat in (("tok_s", "agg_tok_s"), ("ttft_p50_s", "ttft_p50_s"))
                for side in ("ours", other)
            }
            for name, v in raw["concurrent"].items()
        },
    }


def _measure_llama(binary: str, reps: int, threads: int, quick: bool) -> dict[str, Any]:
    """Ours (``--model gemma3-270m``'s conversion) against ``llama-server`` on the
    GGUF: single streams and 8 concurrent streams, in turns, medians."""
    from genai_client import Client
    from genai_service.convert.default_model import gemma3_gguf, resolve_model
    from genai_service.convert.weights import DEFAULT_WEIGHTS

    from .llama import LlamaServer
    from .ours import ServerProcess, server_concurrent, server_single

    ours_dir = str(resolve_model("gemma3-270m", progress=False))
    gguf = str(gemma3_gguf().path)
    source = TokenSource(ours_dir, lines=2400)
    single_prompts = SINGLE_PROMPTS[:1] if quick else SINGLE_PROMPTS
    new = 32 if quick else SINGLE_NEW
    streams_new = 32 if quick else STREAM_NEW
    raw: dict[str, Any] = {"single": {}, "concurrent": {}}
    server = ServerProcess(ours_dir, threads)
    llama: LlamaServer | None = None
    try:
        client = Client(server.target)
        llama = LlamaServer(binary, gguf, threads)
        server_single(client, source.take(32), 4)  # warm-up, not measured
        llama.single(source.take(32), 4)
        for rep in range(reps):
            for plen in single_prompts:
                for name in SAMPLING_NAMES:
                    ids = source.take(plen)
                    params = _params(name, 3000 + rep)
                    runs = {
                        "ours": lambda ids=ids, p=params: server_single(client, ids, new, p),
                        "llama": lambda ids=ids, p=params, ll=llama: ll.single(ids, new, p),
                    }
                    _record_single(raw, f"{plen}/{name}", runs, rep)
            for name in SAMPLING_NAMES:
                prompts = [source.take(STREAM_PROMPT) for _ in range(STREAMS)]
                per = [_params(name, 4000 + 100 * rep + i) for i in range(STREAMS)]
                runs = {
                    "ours": lambda ps=prompts, per=per: server_concurrent(
                        server.target, ps, streams_new, per),
                    "llama": lambda ps=prompts, per=per, ll=llama: ll.concurrent(
                        ps, streams_new, per),
                }  # fmt: skip
                _record_concurrent(raw, name, runs, rep)
        client.close()
        command = " ".join(llama.cmd)
    finally:
        server.stop()
        if llama is not None:
            llama.stop()
    return {
        "ours_dir": ours_dir,
        "ours_weights": DEFAULT_WEIGHTS,
        "gguf": gguf,
        "command": command,
        "llama_version": _llama_version(binary),
        "single_new_tokens": new,
        "stream_new_tokens": streams_new,
        "raw": raw,
        **_medians(raw, "llama"),
    }


def _llama_version(binary: str) -> str:
    """``llama-server --version``'s first line (its build number and commit)."""
    import subprocess

    try:
        out = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except OSError as e:
        return f"unknown ({e})"
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.startswith("version")]
    return lines[0] if lines else "unknown"


def _measure_og(builder_dir: str, reps: int, threads: int, quick: bool) -> dict[str, Any]:
    from genai_client import Client

    from .ortgenai import OgWorker
    from .ours import ServerProcess, server_concurrent, server_single

    ours_dir = our_fp32_dir()
    source = TokenSource(ours_dir, lines=2400)
    single_prompts = SINGLE_PROMPTS[:1] if quick else SINGLE_PROMPTS
    new = 32 if quick else SINGLE_NEW
    # og sizes its KV by max_length; the local layers' GQA wants at least their
    # 512-token window of it.
    max_len = max(1024, -(-(max(single_prompts) + new + 64) // 256) * 256)
    raw: dict[str, Any] = {"single": {}, "concurrent": {}}
    server = ServerProcess(ours_dir, threads)
    workers: dict[str, OgWorker] = {}
    try:
        client = Client(server.target)
        workers["generator"] = OgWorker(
            "generator", builder_dir, threads=threads, share_buffer=True,
            max_length=max_len, engine=False, kv_floor=max_len,
        )  # fmt: skip
        # Warm-up (not measured): each side's first calls pay for lazy initialisation.
        server_single(client, source.take(32), 4)
        workers["generator"].call("single", ids=source.take(32), new_tokens=4)
        for rep in range(reps):
            for plen in single_prompts:
                for name in SAMPLING_NAMES:
                    ids = source.take(plen)
                    params = _params(name, 1000 + rep)
                    runs = {
                        "ours": lambda ids=ids, p=params: server_single(client, ids, new, p),
                        "og": lambda ids=ids, p=params: workers["generator"].call(
                            "single", ids=ids, new_tokens=new, sampling=p),
                    }  # fmt: skip
                    _record_single(raw, f"{plen}/{name}", runs, rep)
        workers.pop("generator").stop()
        workers["engine"] = OgWorker(
            "engine", builder_dir, threads=threads, share_buffer=True,
            max_length=max_len, engine=True,
        )  # fmt: skip
        streams_new = 32 if quick else STREAM_NEW
        warm = [source.take(STREAM_PROMPT) for _ in range(2)]
        server_concurrent(server.target, warm, 4)
        workers["engine"].call("concurrent", prompts=warm, new_tokens=4)
        for rep in range(reps):
            for name in SAMPLING_NAMES:
                prompts = [source.take(STREAM_PROMPT) for _ in range(STREAMS)]
                per = [_params(name, 2000 + 100 * rep + i) for i in range(STREAMS)]
                runs = {
                    "ours": lambda ps=prompts, per=per: server_concurrent(
                        server.target, ps, streams_new, per),
                    "og": lambda ps=prompts, per=per: workers["engine"].call(
                        "concurrent", prompts=ps, new_tokens=streams_new, sampling=per),
                }  # fmt: skip
                _record_concurrent(raw, name, runs, rep)
        client.close()
    finally:
        server.stop()
        for worker in workers.values():
            worker.stop()
    result = {
        "ours_dir": ours_dir,
        "builder_dir": builder_dir,
        "builder_made_by": _made_by(builder_dir),
        "reps": reps,
        "threads": threads,
        "single_new_tokens": new,
        "stream_new_tokens": streams_new,
        "raw": raw,
        **_medians(raw, "og"),
    }
    for key, v in raw["single"].items():
        result["single"][key]["same_first_tokens"] = [
            a["token_ids"] == b["token_ids"] for a, b in zip(v["ours"], v["og"], strict=True)
        ]
    return result


def _made_by(builder_dir: str) -> str:
    stamp = Path(builder_dir) / "made_by.txt"
    return stamp.read_text().strip() if stamp.exists() else "unknown"


def targets(result: dict[str, Any]) -> list[dict]:
    """Issue 27's Gemma 3 targets (all ``>=``): decode >= 1.0x og.Generator on every
    single-stream row, 8 sampled streams >= 1.2x og.Engine; against llama-server
    the default model's bar (issue 25): single-stream decode >= 1.0x, 8 streams >= 1.5x."""
    out = []

    def add(name: str, measured: float, limit: float) -> None:
        met = None if measured != measured else bool(measured >= limit)
        out.append(
            {"target": name, "measured": measured, "limit": limit, "unit": "×", "met": met,
             "headline": False}
        )  # fmt: skip

    for key, row in result.get("single", {}).items():
        plen, name = key.split("/")
        add(
            f"Gemma 3 270M fp32, single stream {plen} tokens, {name}: decode tok/s "
            "≥ 1.0× og.Generator",
            row["ours_decode_tok_s"] / row["og_decode_tok_s"],
            1.0,
        )
    row = result.get("concurrent", {}).get("sampled")
    if row:
        add(
            f"Gemma 3 270M fp32, {STREAMS} streams, sampled: tok/s ≥ 1.2× og.Engine",
            row["ours_tok_s"] / row["og_tok_s"],
            1.2,
        )
    ll = result.get("llama") or {}
    for key, row in ll.get("single", {}).items():
        plen, name = key.split("/")
        add(
            f"Gemma 3 270M, single stream {plen} tokens, {name}: decode tok/s ≥ 1.0× llama-server",
            row["ours_decode_tok_s"] / row["llama_decode_tok_s"],
            1.0,
        )
    for name, row in ll.get("concurrent", {}).items():
        add(
            f"Gemma 3 270M, {STREAMS} streams, {name}: tok/s ≥ 1.5× llama-server",
            row["ours_tok_s"] / row["llama_tok_s"],
            1.5,
        )
    return out


def _f(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}"


def markdown(result: dict[str, Any]) -> list[str]:
    if "skipped" in result:
        return [f"Skipped: {result['skipped']}.", ""]
    lines = _og_markdown(result) if "single" in result else []
    if "llama" in result:
        lines += _llama_markdown(result["llama"])
    lines += ["Targets:", ""]
    for t in targets(result):
        met = "met" if t["met"] else "**missed**"
        lines.append(f"- {t['target']}: {_f(t['measured'])} (limit {t['limit']}) — {met}")
    lines.append("")
    return lines


def _og_markdown(result: dict[str, Any]) -> list[str]:
    lines = [
        f"Ours: `genai-server` on our fp32 conversion of the Q4_K_M GGUF; og: onnxruntime-genai "
        f"on its builder's fp32 export of the same weights ({result['builder_made_by']}); "
        f"{result['threads']} intra-op threads each; median of {result['reps']} rep(s), "
        "fresh prompts per rep; sampled = temperature 0.7, top_p 0.9, top_k 50.",
        "",
        f"Single stream, {result['single_new_tokens']} new tokens (og.Generator, share_buffer "
        "true); same: the first 16 tokens equal (greedy rows), per rep:",
        "",
        "| prompt | sampling | TTFT ours (s) | TTFT og (s) | ours/og | decode ours (tok/s) "
        "| decode og (tok/s) | ours/og | same |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, row in result["single"].items():
        plen, name = key.split("/")
        same = (
            " ".join("yes" if s else "no" for s in row["same_first_tokens"])
            if name == "greedy"
            else "–"
        )
        lines.append(
            f"| {plen} | {name} | {_f(row['ours_ttft_s'])} | {_f(row['og_ttft_s'])} | "
            f"{_f(row['ours_ttft_s'] / row['og_ttft_s'])} | {_f(row['ours_decode_tok_s'])} | "
            f"{_f(row['og_decode_tok_s'])} | "
            f"{_f(row['ours_decode_tok_s'] / row['og_decode_tok_s'])} | {same} |"
        )
    lines += [
        "",
        f"{STREAMS} concurrent streams, {STREAM_PROMPT}-token prompts + "
        f"{result['stream_new_tokens']} new tokens (og.Engine):",
        "",
        "| sampling | ours tok/s | og tok/s | ours/og | p50 TTFT ours (s) | p50 TTFT og (s) |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in result["concurrent"].items():
        lines.append(
            f"| {name} | {_f(row['ours_tok_s'], 1)} | {_f(row['og_tok_s'], 1)} | "
            f"{_f(row['ours_tok_s'] / row['og_tok_s'])} | {_f(row['ours_ttft_p50_s'])} | "
            f"{_f(row['og_ttft_p50_s'])} |"
        )
    lines.append("")
    return lines


def _llama_markdown(ll: dict[str, Any]) -> list[str]:
    lines = [
        f"Against llama.cpp's `llama-server` ({ll['llama_version']}) on the GGUF itself, at its "
        f"own quantization: `{ll['command']}`; ours: `genai-server --model gemma3-270m` "
        f"({ll['ours_weights']} weights); HTTP `/completion` streamed with token-id prompts, "
        "EOS ignored, its other samplers off; client-side timing as ours.",
        "",
        "| measurement | sampling | ours tok/s | llama-server tok/s | ours/llama "
        "| ours TTFT (s) | llama TTFT (s) | ours/llama |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, row in ll["single"].items():
        plen, name = key.split("/")
        lines.append(
            f"| 1 stream, {plen}-token prompt + {ll['single_new_tokens']} (decode) | {name} | "
            f"{_f(row['ours_decode_tok_s'])} | {_f(row['llama_decode_tok_s'])} | "
            f"{_f(row['ours_decode_tok_s'] / row['llama_decode_tok_s'])} | "
            f"{_f(row['ours_ttft_s'])} | {_f(row['llama_ttft_s'])} | "
            f"{_f(row['ours_ttft_s'] / row['llama_ttft_s'])} |"
        )
    for name, row in ll["concurrent"].items():
        lines.append(
            f"| {STREAMS} streams, {STREAM_PROMPT}-token prompts + {ll['stream_new_tokens']} "
            f"(total) | {name} | {_f(row['ours_tok_s'], 1)} | {_f(row['llama_tok_s'], 1)} | "
            f"{_f(row['ours_tok_s'] / row['llama_tok_s'])} | {_f(row['ours_ttft_p50_s'])} | "
            f"{_f(row['llama_ttft_p50_s'])} | "
            f"{_f(row['ours_ttft_p50_s'] / row['llama_ttft_p50_s'])} |"
        )
    lines.append("")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--builder-dir", default=None, help="bench.builder_reference --keep-gemma3")
    ap.add_argument("--llama-server", default=None, help="a llama-server binary")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    started = time.time()
    if not args.builder_dir and not args.llama_server:
        ap.error("give --builder-dir, --llama-server or both")
    result = measure(
        args.builder_dir, args.reps, args.threads, args.quick, llama_server=args.llama_server
    )
    result["meta"] = {
        "machine": machine_info(),
        "versions": versions(),
        "elapsed_s": round(time.time() - started, 1),
    }
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(started))
    out = args.out or REPO / "bench" / "results" / f"gemma3-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(markdown(result)))
    print(f"JSON: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
