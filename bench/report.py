"""A run's report for ``docs/benchmarks.md``, built per section.

Each section of a run's results (the keys ``bench/run.py`` writes: ``single``,
``sessions``, ``concurrency``, …) has one entry in ``SECTIONS``: the targets
it must reach (each measured against its limit) and its tables.
``targets(r)`` and ``markdown(r)`` walk ``SECTIONS`` in order, so a new
section is one entry, and a run that lacks a section shows nothing of it.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Results = dict[str, Any]


def _ratio(a: float, b: float) -> float:
    return a / b if b and not (math.isnan(a) or math.isnan(b)) else float("nan")


def _fmt(x: Any, digits: int = 2) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        if math.isnan(x):
            return "–"
        return f"{x:.{digits}f}"
    return str(x)


def _target(
    name: str,
    measured: float,
    limit: float,
    ok: Callable[[float, float], bool],
    unit: str = "×",
    *,
    headline: bool = False,
) -> dict:
    """One target; ``headline``: one of the few ``bench.history`` follows across runs."""
    met = None if math.isnan(measured) else bool(ok(measured, limit))
    return {
        "target": name,
        "measured": measured,
        "limit": limit,
        "unit": unit,
        "met": met,
        "headline": headline,
    }


def _ge(a: float, b: float) -> bool:
    return a >= b


def _le(a: float, b: float) -> bool:
    return a <= b


# The sampler microbenchmark, where it exists: measure() -> dict (the run's
# "sampler" section), markdown(result) -> list[str] (its table).
SAMPLER_MODULE = "bench.sampler_bench"
# Frontend CPU per streamed token, in ms.
FRONTEND_MS_PER_TOKEN = 0.15
# Where another script's profile of one decode step leaves its figure: results
# ["step_profile"]["engine_loop_python_ms_per_step"] (batch 1).
STEP_PROFILE_KEY = "engine_loop_python_ms_per_step"
HEADLINE_LENGTH = "512"  # the single-stream prompt length the history follows


def _top_level(conc: dict, shape: str) -> str:
    return max(conc[shape], key=int)


def _sampled_run(r: Results) -> bool:
    """Whether the run measured sampled rows beside greedy (its plan has samplings)."""
    return "concurrency_samplings" in (r.get("meta") or {}).get("plan", {})


# -- targets, per section -------------------------------------------------------------


def _single_targets(r: Results) -> list[dict]:
    single = r["single"]
    server, inproc, og = single["ours_server"], single["ours_inproc"], single["og_best"]
    lengths = sorted(server, key=int)
    out: list[dict] = []
    by = {
        "greedy": (server, og),
        **{n: (s["ours_server"], s["og_best"]) for n, s in (single.get("samplings") or {}).items()},
    }
    for name, (ours, other) in by.items():
        label = "" if name == "greedy" else f", {name}"
        for length in lengths:
            out.append(
                _target(
                    f"single stream {length} tokens{label}: decode tok/s ≥ 1.0× og.Generator "
                    "(best)",
                    _ratio(ours[length]["decode_tok_s"], other[length]["decode_tok_s"]),
                    1.0,
                    _ge,
                    headline=length == HEADLINE_LENGTH,
                )
            )
            out.append(
                _target(
                    f"single stream {length} tokens{label}: TTFT ≤ 1.0× og.Generator (best)",
                    _ratio(ours[length]["ttft_s"], other[length]["ttft_s"]),
                    1.0,
                    _le,
                )
            )
    ttft_over = max(_ratio(server[k]["ttft_s"], inproc[k]["ttft_s"]) - 1 for k in server)
    decode_over = max(
        _ratio(inproc[k]["decode_tok_s"], server[k]["decode_tok_s"]) - 1 for k in server
    )
    out.append(
        _target("gRPC + process overhead on TTFT ≤ 5% (worst length)", ttft_over * 100, 5, _le, "%")
    )
    out.append(
        _target(
            "gRPC + process overhead on decode ≤ 5% (worst length)", decode_over * 100, 5, _le, "%"
        )
    )
    if len(lengths) >= 2:
        lo, hi = lengths[0], lengths[-1]
        out.append(
            _target(
                f"per-token decode time at {hi} ≤ 2× at {lo} (server)",
                _ratio(server[lo]["decode_tok_s"], server[hi]["decode_tok_s"]),
                2.0,
                _le,
            )
        )
    return out


def _sessions_targets(r: Results) -> list[dict]:
    sess = r["sessions"]
    last = len(sess["alone"]["ours"]) - 1
    return [
        _target(
            f"session alone: turn-{last + 1} TTFT ≤ 1.0× og.Engine continuing",
            _ratio(sess["alone"]["ours"][last], sess["alone"]["og"][last]),
            1.0,
            _le,
        ),
        _target(
            f"{sess['conversations']} sessions interleaved: turn-{last + 1} TTFT ≤ 0.3× og",
            _ratio(sess["interleaved"]["ours"][last], sess["interleaved"]["og"][last]),
            0.3,
            _le,
            headline=True,
        ),
    ]


def _concurrency_targets(r: Results) -> list[dict]:
    out: list[dict] = []
    for i, (shape, levels) in enumerate(list(r["concurrency"].items())[:2]):
        top = _top_level(r["concurrency"], shape)
        row = levels[top]
        ours, og = row["ours"], row["og"]
        need = 1.3 if i == 0 else 1.2
        out.append(
            _target(
                f"{top} streams, {shape}: total tok/s ≥ {need}× og.Engine",
                _ratio(ours["agg_tok_s"], og["agg_tok_s"]),
                need,
                _ge,
                headline=True,
            )
        )
        if i == 1:
            out.append(
                _target(
                    f"{top} streams, {shape}: p50 TTFT ≤ 0.6× og.Engine",
                    _ratio(ours["ttft_p50_s"], og["ttft_p50_s"]),
                    0.6,
                    _le,
                )
            )
        if i == 0:
            out += _fewer_streams_targets(shape, levels, top)
            for name, by in (row.get("samplings") or {}).items():
                o, g = by.get("ours", {}), by.get("og", {})
                out.append(
                    _target(
                        f"{top} streams, {shape}, {name}: total tok/s ≥ 1.3× og.Engine "
                        "same sampling",
                        _ratio(o.get("agg_tok_s", math.nan), g.get("agg_tok_s", math.nan)),
                        1.3,
                        _ge,
                        headline=name == "sampled",
                    )
                )
                out.append(
                    _target(
                        f"{top} streams, {shape}, {name}: total tok/s ≥ 0.95× ours greedy",
                        _ratio(o.get("agg_tok_s", math.nan), ours["agg_tok_s"]),
                        0.95,
                        _ge,
                    )
                )
    return out


def _fewer_streams_targets(shape: str, levels: dict, top: str) -> list[dict]:
    """Issue 25: below the most streams, every sampling ≥ 1.0× og.Engine through
    the server, with the Python client and (where measured) the Go client."""
    out: list[dict] = []
    for n in sorted((k for k in levels if k != top), key=int):
        row = levels[n]
        by = {"greedy": row, **(row.get("samplings") or {})}
        for name, d in by.items():
            og = d.get("og", {}).get("agg_tok_s", math.nan)
            for client, key in (("", "ours"), (", Go client", "ours_go")):
                if key not in d:
                    continue
                out.append(
                    _target(
                        f"{n} stream(s), {shape}, {name}{client}: total tok/s ≥ 1.0× og.Engine "
                        "same sampling",
                        _ratio(d[key]["agg_tok_s"], og),
                        1.0,
                        _ge,
                    )
                )
    return out


def _surface_targets(r: Results) -> list[dict]:
    sf = r["surface"]
    return [
        _target(
            f"{sf['streams']} streams, {sf['shape']}, sampled + DRY + XTC + logit_bias: "
            "total tok/s ≥ 0.9× the same row without them",
            _ratio(sf["surface"]["agg_tok_s"], sf["plain"]["agg_tok_s"]),
            0.9,
            _ge,
        )
    ]


def _surface_md(r: Results) -> list[str]:
    sf = r["surface"]
    plain, ext = sf["plain"], sf["surface"]
    return [
        f"### The decoding surface: {sf['streams']} streams of {sf['shape']}, sampled, with "
        "and without DRY + XTC + logit_bias",
        "",
        "Through the server, each side on prompts of its own (nothing cached); added fields: "
        f"`{sf['fields']}`.",
        "",
        *_table(
            ["row", "tok/s", "p50 TTFT (s)", "p99 TTFT (s)", "vs plain"],
            [
                ["sampled", plain["agg_tok_s"], plain["ttft_p50_s"], plain["ttft_p99_s"], 1.0],
                [
                    "sampled + DRY + XTC + logit_bias",
                    ext["agg_tok_s"],
                    ext["ttft_p50_s"],
                    ext["ttft_p99_s"],
                    _ratio(ext["agg_tok_s"], plain["agg_tok_s"]),
                ],
            ],
        ),
    ]


def _long_targets(r: Results) -> list[dict]:
    long = r["long"]
    ctx = long["prompt_tokens"] + long["new_tokens"]
    out: list[dict] = []
    for name, by in (long.get("samplings") or {}).items():
        ours, og = by["ours_server"], by["og"]
        out.append(
            _target(
                f"single stream, {ctx}-token context, {name}: decode tok/s ≥ 1.0× og.Generator",
                _ratio(ours["decode_tok_s"], og["decode_tok_s"]),
                1.0,
                _ge,
            )
        )
        out.append(
            _target(
                f"single stream, {ctx}-token context, {name}: TTFT ≤ 1.0× og.Generator",
                _ratio(ours["ttft_s"], og["ttft_s"]),
                1.0,
                _le,
            )
        )
    return out


def _llama_targets(r: Results) -> list[dict]:
    out: list[dict] = []
    for name, by in (r["llama_server"].get("single") or {}).items():
        for length in sorted(by.get("ours", {}), key=int):
            out.append(
                _target(
                    f"single stream {length} tokens, {name}: decode tok/s ≥ 1.0× llama-server",
                    _ratio(by["ours"][length]["decode_tok_s"], by["llama"][length]["decode_tok_s"]),
                    1.0,
                    _ge,
                )
            )
    c = r["llama_server"].get("concurrency") or {}
    for name, by in (c.get("samplings") or {}).items():
        out.append(
            _target(
                f"{c['streams']} streams, {c['shape']}, {name}: tok/s ≥ 1.5× llama-server",
                _ratio(by["ours"]["agg_tok_s"], by["llama"]["agg_tok_s"]),
                1.5,
                _ge,
            )
        )
    return out


def _frontend_rows(r: Results) -> list[tuple[str, dict]]:
    """The server measurements the frontend-CPU target reads: one stream at 512
    prompt tokens (or the first length) and the most streams of the first
    concurrency shape, greedy."""
    rows: list[tuple[str, dict]] = []
    single = (r.get("single") or {}).get("ours_server") or {}
    if single:
        length = "512" if "512" in single else min(single, key=int)
        rows.append((f"1 stream, {length} tokens, greedy", single[length]))
    conc = r.get("concurrency") or {}
    if conc:
        shape = next(iter(conc))
        top = _top_level(conc, shape)
        rows.append((f"{top} streams, {shape}, greedy", conc[shape][top]["ours"]))
    return [(what, summary) for what, summary in rows if "cpu_ms_per_token" in summary]


def _cpu_targets(r: Results) -> list[dict]:
    return [
        _target(
            f"{what}: frontend CPU per streamed token ≤ {FRONTEND_MS_PER_TOKEN} ms",
            summary.get("cpu_ms_per_token", {}).get("frontend", math.nan),
            FRONTEND_MS_PER_TOKEN,
            _le,
            "ms",
        )
        for what, summary in _frontend_rows(r)
    ]


def _step_targets(r: Results) -> list[dict]:
    step = (r.get("step_profile") or {}).get(STEP_PROFILE_KEY, math.nan)
    return [
        _target(
            "engine-loop Python per decode step at batch 1 ≤ 0.1 ms (bench/step_profile.py)",
            float(step),
            0.1,
            _le,
            "ms",
        )
    ]


def _rss_targets(r: Results) -> list[dict]:
    rss = r["rss"]
    if not rss.get("og_max_mb"):
        return []
    return [
        _target(
            "peak RSS ≤ onnxruntime-genai's",
            _ratio(rss["ours_server_tree_mb"], rss["og_max_mb"]),
            1.0,
            _le,
            headline=True,
        )
    ]


def _kvstore_targets(r: Results) -> list[dict]:
    kv = r["kvstore"]
    return [
        _target(
            "2,048-token TTFT with the prefix from the kvstore ≤ 0.2× cold",
            kv["reuse"]["ratio"],
            0.2,
            _le,
            headline=True,
        ),
        _target(
            "kvstore Get of 256-token chunks ≥ 1 GB/s over loopback",
            kv["throughput"]["get_gb_per_s_sync_no_verify"],
            1.0,
            _ge,
            "GB/s",
        ),
    ]


def _session_slide_targets(r: Results) -> list[dict]:
    ss = r["session_slide"]
    return [
        _target(
            "a session past its window (slide, keys rotated): second-half median TTFT ≤ 1.5× "
            "the first half's",
            ss["rotate_ttft_growth"],
            1.5,
            _le,
            headline=True,
        ),
    ]


def _session_fork_targets(r: Results) -> list[dict]:
    sf = r["session_fork"]
    return [
        _target(
            "a fork's first turn: TTFT ≤ 0.5× a fresh session sending the same prompt",
            sf["fork_ttft_ratio"],
            0.5,
            _le,
            headline=True,
        ),
        _target(
            "a turn after RewindSession: TTFT ≤ 0.5× a fresh session sending the same prompt",
            sf["rewind_ttft_ratio"],
            0.5,
            _le,
        ),
    ]


def _draft_speculation_targets(r: Results) -> list[dict]:
    """The section's own targets (``bench/draft_speculation.py``'s ``targets``), all ``≥``."""
    return [
        _target(t["target"], t["measured"], t["limit"], _ge, headline=t["headline"])
        for t in r["draft_speculation"]["targets"]
    ]


def _gemma3_targets(r: Results) -> list[dict]:
    """The section's own targets (``bench/gemma3_bench.py``'s ``targets``), all ``≥``."""
    return [
        _target(t["target"], t["measured"], t["limit"], _ge) for t in r["gemma3"].get("targets", [])
    ]


def _http_targets(r: Results) -> list[dict]:
    http = r["http"]
    return [
        _target(
            "one stream's decode tok/s through HTTP/SSE ≥ 0.95× GenerateStream",
            http["decode_ratio"],
            0.95,
            _ge,
        ),
        _target(
            "one stream's TTFT through HTTP/SSE ≤ 1.05× GenerateStream",
            http["ttft_ratio"],
            1.05,
            _le,
        ),
    ]


# -- tables, per section --------------------------------------------------------------


def _single_md(r: Results) -> list[str]:
    """Single streams: ours in-process and through the server against og.Generator."""
    meta = r["meta"]
    lines: list[str] = []
    s = r["single"]
    lines += [
        f"### Single stream ({meta['plan']['single_new_tokens']} new tokens)",
        "",
    ]
    rows = []
    for length in sorted(s["ours_server"], key=int):
        ip, sv, og = s["ours_inproc"][length], s["ours_server"][length], s["og_best"][length]
        rows.append(
            [
                length,
                ip["ttft_s"],
                sv["ttft_s"],
                og["ttft_s"],
                _ratio(sv["ttft_s"], og["ttft_s"]),
                ip["decode_tok_s"],
                sv["decode_tok_s"],
                og["decode_tok_s"],
                _ratio(sv["decode_tok_s"], og["decode_tok_s"]),
            ]
        )
    lines += _table(
        [
            "prompt",
            "TTFT in-process (s)",
            "TTFT server (s)",
            "TTFT og (s)",
            "server/og",
            "decode in-process (tok/s)",
            "decode server (tok/s)",
            "decode og (tok/s)",
            "server/og",
        ],
        rows,
    )
    og_rows = [
        [
            length,
            s["og_share_true"][length]["ttft_s"],
            s["og_share_true"][length]["decode_tok_s"],
            s["og_share_false"][length]["ttft_s"],
            s["og_share_false"][length]["decode_tok_s"],
        ]
        for length in sorted(s["og_share_true"], key=int)
    ]
    lines += ["og.Generator by setting:", ""]
    lines += _table(
        [
            "prompt",
            "TTFT share=true (s)",
            "decode share=true",
            "TTFT share=false (s)",
            "decode share=false",
        ],
        og_rows,
    )
    if s.get("og_all_logits_probe"):
        p = s["og_all_logits_probe"]
        lines += [
            f"og.Generator on the all-logits graph that og.Engine needs "
            f"({p['length']}-token prompt): TTFT {_fmt(p['ttft_s'])} s, decode "
            f"{_fmt(p['decode_tok_s'], 1)} tok/s.",
            "",
        ]
    if s.get("agreement"):
        lines += [f"Greedy tokens (first 32, rep 0) equal to og's: {s['agreement']}.", ""]
    for name, ss in (s.get("samplings") or {}).items():
        lines += _single_sampled(name, ss)
    return lines


def _sessions_md(r: Results) -> list[str]:
    """Multi-turn sessions, alone and interleaved, against og.Engine."""
    meta = r["meta"]
    lines: list[str] = []
    ss = r["sessions"]
    p = meta["plan"]
    lines += [
        f"### Sessions ({p['session_turns']} turns of {p['session_new_prompt_tokens']} new "
        f"prompt tokens + {p['session_new_tokens']} generated): TTFT per turn (s)",
        "",
    ]
    rows = []
    for t in range(len(ss["alone"]["ours"])):
        a, ia = ss["alone"], ss["interleaved"]
        rows.append(
            [
                t + 1,
                a["ours"][t],
                a["og"][t],
                _ratio(a["ours"][t], a["og"][t]),
                a["og_modes"][t],
                ia["ours"][t],
                ia["og"][t],
                _ratio(ia["ours"][t], ia["og"][t]),
                ia["og_modes"][t],
            ]
        )
    lines += _table(
        [
            "turn",
            "alone: ours",
            "og.Engine",
            "ours/og",
            "og request",
            f"{ss['conversations']} interleaved: ours",
            "og.Engine",
            "ours/og",
            "og request",
        ],
        rows,
    )
    return lines


def _speculation_md(r: Results) -> list[str]:
    """Prompt-lookup speculation through a server with --speculate."""
    meta = r["meta"]
    lines: list[str] = []
    sp = r.get("speculation")
    if sp:
        lines += [
            f"### Speculative decoding: single streams through a server with `--speculate "
            f"{sp['draft_tokens']}`",
            "",
            "Not part of the targets above (those compare the same work: one token per "
            "step). Prompt-lookup drafts pay off where the answer quotes the prompt. "
            f"Tasks (chat prompts, {meta['plan']['single_new_tokens']} new tokens, greedy): "
            "`copy` asks for its numbered "
            "notes back, corrected; `free` asks for a short story; `notes` is 512 tokens "
            'of the numbered notes as in the single-stream table. "same": the first 32 '
            "tokens equal the plain server's, per rep (see docs/design.md on rounding).",
            "",
        ]
        rows = []
        for task in sp["ours_server"]:
            plain, spec, og = (
                sp[e][task] for e in ("ours_server", "ours_speculating", "og_share_true")
            )
            rows.append(
                [
                    task,
                    "/".join(str(n) for n in sp["prompt_tokens"][task]),
                    plain["decode_tok_s"],
                    spec["decode_tok_s"],
                    og["decode_tok_s"],
                    _ratio(spec["decode_tok_s"], og["decode_tok_s"]),
                    _ratio(spec["decode_tok_s"], plain["decode_tok_s"]),
                    spec["ttft_s"],
                    og["ttft_s"],
                    " ".join("yes" if x else "no" for x in sp["same_first_32"][task]),
                ]
            )
        lines += _table(
            [
                "task",
                "prompt tokens",
                "plain server tok/s",
                "speculating tok/s",
                "og.Generator tok/s",
                "speculating/og",
                "speculating/plain",
                "speculating TTFT (s)",
                "og TTFT (s)",
                "same",
            ],
            rows,
        )
    return lines


def _cold_start_md(r: Results) -> list[str]:
    """The first burst after start-up."""
    lines: list[str] = []
    cold = r.get("cold_start")
    if cold:
        o, g = cold["ours"], cold["og"]
        lines += [
            f"First burst after start-up (warm-up, not in the tables above): {cold['streams']} "
            f"streams of {cold['prompt_tokens']}+{cold['new_tokens']} tokens: ours p50 TTFT "
            f"{_fmt(o['ttft_p50_s'])} s, {_fmt(o['agg_tok_s'], 1)} tok/s; og.Engine p50 TTFT "
            f"{_fmt(g['ttft_p50_s'])} s, {_fmt(g['agg_tok_s'], 1)} tok/s.",
            "",
        ]
    return lines


def _rss_md(r: Results) -> list[str]:
    """Peak RSS per process tree."""
    lines: list[str] = []
    rs = r["rss"]
    lines += [
        "### Peak RSS (MB): the kernel's peak (VmHWM) summed over each process tree",
        "",
    ]
    rows = [
        [name, d["hwm_sum_mb"], ", ".join(f"{v:.0f}" for v in d["hwm_by_process_mb"].values())]
        for name, d in rs["processes"].items()
    ]
    lines += _table(["process", "peak RSS", "by process"], rows)
    return lines


def _kvstore_md(r: Results) -> list[str]:
    """KV reuse through the kvstore and its throughput."""
    lines: list[str] = []
    kv = r.get("kvstore")
    if kv:
        reuse, tp = kv["reuse"], kv["throughput"]
        lines += ["### KV reuse through the kvstore", ""]
        lines += _table(
            ["measure", "value"],
            [
                [
                    "prompt tokens / reused from the kvstore",
                    f"{reuse['prompt_tokens']} / {reuse['cached_tokens']}",
                ],
                ["TTFT cold (s)", reuse["ttft_cold_s"]],
                [
                    "TTFT with the prefix from the kvstore, fresh engine (s)",
                    reuse["ttft_from_kvstore_s"],
                ],
                ["ratio", reuse["ratio"]],
                ["chunk blob (MB)", tp["blob_bytes"] / 1e6],
                ["Get GB/s (sync client, checksum verified)", tp["get_gb_per_s_sync"]],
                [
                    "Get GB/s (sync client, payload checksum left to the engine)",
                    tp["get_gb_per_s_sync_no_verify"],
                ],
                ["Put GB/s", tp["put_gb_per_s"]],
            ],
        )
    return lines


def _engine_note(meta: dict) -> str:
    eng = meta.get("og_engine_model")
    if not eng or eng == meta["model"]["dir"]:
        return ""
    return (
        " (og.Engine's static batch rejects a graph that returns only the last position's "
        "logits, so it runs an all-logits conversion of the same GGUF with the same weights)"
    )


def _targets_table(ts: list[dict]) -> list[str]:
    units = {"%": "%", "GB/s": " GB/s", "ms": " ms"}
    rows = [
        [
            t["target"],
            f"{_fmt(t['measured'])}{units.get(t['unit'], '×')}",
            {True: "yes", False: "**no**", None: "–"}[t["met"]],
        ]
        for t in ts
    ]
    return _table(["target", "measured", "met?"], rows)


def _samplings_note(meta: dict) -> str:
    plan = meta["plan"]
    if "concurrency_samplings" not in plan:
        return ""
    return (
        "; sampled = temperature 0.7, top_p 0.9, top_k 50 (`sampled_rep`: + repetition_penalty "
        "1.1), the same settings on every engine, a seed per request; concurrency rows: "
        + ", ".join(plan["concurrency_samplings"])
        + "; single streams: "
        + ", ".join(plan["single_samplings"])
    )


def _single_sampled(name: str, s: dict) -> list[str]:
    lines = [
        f"Single stream, {name} ({s.get('label', name)}), through the server vs og.Generator "
        "(best of share_buffer true/false, per metric):",
        "",
    ]
    pairs = [
        (length, s["ours_server"][length], s["og_best"][length])
        for length in sorted(s["ours_server"], key=int)
    ]
    return lines + _server_vs_og("prompt", pairs)


def _server_vs_og(first: str, pairs: list[tuple[Any, dict, dict]]) -> list[str]:
    """A table of TTFT and decode, server against og, one row per (label, ours, og)."""
    rows = [
        [
            label,
            ours["ttft_s"],
            og["ttft_s"],
            _ratio(ours["ttft_s"], og["ttft_s"]),
            ours["decode_tok_s"],
            og["decode_tok_s"],
            _ratio(ours["decode_tok_s"], og["decode_tok_s"]),
        ]
        for label, ours, og in pairs
    ]
    return _table(
        [
            first,
            "TTFT server (s)",
            "TTFT og (s)",
            "server/og",
            "decode server (tok/s)",
            "decode og (tok/s)",
            "server/og",
        ],
        rows,
    )


def _concurrency(shape: str, levels: dict) -> list[str]:
    """One table per shape: a row per (streams, sampling); greedy has the
    in-process figure, the others their ratio to greedy through the server."""
    lines = [
        f"### Concurrent streams through the server: {shape}",
        "",
        "(ours: through the server from the Python asyncio client; in-process: the same "
        "greedy requests on our engine without gRPC, for reference; Go client: the same "
        "requests through the server from the Go client, where measured; vs greedy: this "
        "sampling's tok/s over ours greedy in the same row.)",
        "",
    ]
    rows = []
    for n in sorted(levels, key=int):
        row = levels[n]
        greedy = row["ours"]
        by = {"greedy": row}
        by.update(row.get("samplings") or {})
        for name, d in by.items():
            o, g = d["ours"], d["og"]
            go = d.get("ours_go", {}).get("agg_tok_s", math.nan)
            rows.append(
                [
                    n,
                    name,
                    o["agg_tok_s"],
                    row.get("ours_inproc", {}).get("agg_tok_s") if name == "greedy" else None,
                    go,
                    g["agg_tok_s"],
                    _ratio(o["agg_tok_s"], g["agg_tok_s"]),
                    _ratio(go, g["agg_tok_s"]),
                    _ratio(o["agg_tok_s"], greedy["agg_tok_s"]),
                    o["ttft_p50_s"],
                    g["ttft_p50_s"],
                    _ratio(o["ttft_p50_s"], g["ttft_p50_s"]),
                    o["ttft_p99_s"],
                    g["ttft_p99_s"],
                ]
            )
    return lines + _table(
        [
            "streams",
            "sampling",
            "ours tok/s",
            "(in-process)",
            "Go client tok/s",
            "og.Engine tok/s",
            "ours/og",
            "Go/og",
            "vs greedy",
            "ours p50 TTFT (s)",
            "og p50 TTFT (s)",
            "ours/og",
            "ours p99 TTFT (s)",
            "og p99 TTFT (s)",
        ],
        rows,
    )


def _long(lg: dict) -> list[str]:
    ctx = lg["prompt_tokens"] + lg["new_tokens"]
    lines = [
        f"### The model's full window: one stream, {lg['prompt_tokens']}-token prompt + "
        f"{lg['new_tokens']} new tokens ({ctx} in all)",
        "",
        "A server and an og.Generator of their own (share_buffer=true, its KV sized to the "
        "window), so the other tables' processes keep theirs; peak RSS (VmHWM, MB): "
        + "; ".join(f"{name} {d['hwm_sum_mb']:.0f}" for name, d in (lg.get("rss") or {}).items())
        + ".",
        "",
    ]
    pairs = [(name, by["ours_server"], by["og"]) for name, by in lg["samplings"].items()]
    return lines + _server_vs_og("sampling", pairs)


def _llama(ll: dict | None) -> list[str]:
    if not ll:
        return []
    if "skipped" in ll:
        return [f"llama-server: not measured ({ll['skipped']}).", ""]
    lines = [
        "### llama.cpp's llama-server on the same GGUF (HTTP `/completion`, streamed)",
        "",
        f"`{' '.join(ll['command'])}`; token-id prompts, EOS ignored, its other samplers off "
        "(min_p 0), repetition penalty over the whole context; client-side timing as ours.",
        "",
    ]
    rows = []
    for name, by in ll["single"].items():
        for length in sorted(by["ours"], key=int):
            o, g = by["ours"][length], by["llama"][length]
            rows.append(
                [
                    f"1 stream, {length}-token prompt + {ll['single_new_tokens']}",
                    name,
                    o["decode_tok_s"],
                    g["decode_tok_s"],
                    _ratio(o["decode_tok_s"], g["decode_tok_s"]),
                    o["ttft_s"],
                    g["ttft_s"],
                    _ratio(o["ttft_s"], g["ttft_s"]),
                ]
            )
    c = ll["concurrency"]
    fewer = ll.get("fewer_streams") or {}  # (runs before 2026-12-04 have none)
    for streams, samplings in [
        *((n, fewer[n]["samplings"]) for n in sorted(fewer, key=int)),
        (c["streams"], c["samplings"]),
    ]:
        for name, by in samplings.items():
            o, g = by["ours"], by["llama"]
            rows.append(
                [
                    f"{streams} stream{'s' if int(streams) > 1 else ''}, {c['shape']} (total)",
                    name,
                    o["agg_tok_s"],
                    g["agg_tok_s"],
                    _ratio(o["agg_tok_s"], g["agg_tok_s"]),
                    o["ttft_p50_s"],
                    g["ttft_p50_s"],
                    _ratio(o["ttft_p50_s"], g["ttft_p50_s"]),
                ]
            )
    return lines + _table(
        [
            "measurement",
            "sampling",
            "ours tok/s",
            "llama-server tok/s",
            "ours/llama",
            "ours TTFT (s, p50)",
            "llama TTFT (s, p50)",
            "ours/llama",
        ],
        rows,
    )


def cpu_rows(r: Results) -> list[list[Any]]:
    """Per server measurement: CPU ms per generated token of the frontend, the
    engine process and the client, and og's (or llama-server's) process."""
    rows: list[list[Any]] = []

    def add(what: str, sampling: str, ours: dict, other: dict | None, other_key: str) -> None:
        c = ours.get("cpu_ms_per_token")
        if not c:
            return
        o = (other or {}).get("cpu_ms_per_token", {}).get(other_key)
        rows.append([what, sampling, c.get("frontend"), c.get("engine"), c.get("client"), o])

    single = r.get("single") or {}
    for length in sorted(single.get("ours_server") or {}, key=int):
        add(
            f"1 stream, {length} tokens",
            "greedy",
            single["ours_server"][length],
            single["og_share_true"][length],
            "og",
        )
        for name, s in (single.get("samplings") or {}).items():
            add(
                f"1 stream, {length} tokens",
                name,
                s["ours_server"][length],
                s["og_share_true"][length],
                "og",
            )
    for shape, levels in (r.get("concurrency") or {}).items():
        # Every level where the Go client drove it too (the first shape), else the most.
        go_levels = [n for n in levels if "ours_go" in levels[n]]
        for n in sorted(go_levels or [max(levels, key=int)], key=int):
            row = levels[n]
            by = {"greedy": row, **(row.get("samplings") or {})}
            for name, d in by.items():
                add(f"{n} streams, {shape}", name, d["ours"], d["og"], "og")
                if "ours_go" in d:
                    add(f"{n} streams, {shape} (Go client)", name, d["ours_go"], d["og"], "og")
    # (not the full-window row: an 8,000-token prefill is most of its CPU)
    llama = r.get("llama_server") or {}
    c = llama.get("concurrency") or {}
    for name, d in (c.get("samplings") or {}).items():
        add(
            f"{c['streams']} streams, {c['shape']} (vs llama-server)",
            name,
            d["ours"],
            d["llama"],
            "llama",
        )
    return rows


def _cpu_table(r: Results) -> list[str]:
    rows = cpu_rows(r)
    if not rows:
        return []
    return [
        "### CPU per generated token (ms): utime + stime from /proc over each measurement",
        "",
        "Each process's CPU seconds over the measured calls (every rep) divided by the "
        "tokens they generated (prefill included; the kernel counts in 10 ms ticks). "
        "Ours: the frontend (`genai-server`), "
        "the engine process and the benchmark's client; og: its worker process (engine and "
        "caller in one; og.Generator share_buffer=true for one stream, og.Engine for "
        f"several). Target: frontend ≤ {FRONTEND_MS_PER_TOKEN} ms per streamed token.",
        "",
    ] + _table(
        ["measurement", "sampling", "frontend", "engine", "client", "og / llama-server"], rows
    )


def _own_table(title: str, module_name: str, result: dict | None) -> list[str]:
    """A section that renders itself (the module's ``markdown(result)``)."""
    if not result:
        return []
    module = importlib.import_module(module_name)
    return [f"### {title}", "", *module.markdown(result), ""]


def _sampler(result: dict | None) -> list[str]:
    """The sampler microbenchmark's own table (``bench/sampler_bench.py``'s ``markdown``)."""
    if not result:
        return []
    if "skipped" in result:
        return [f"Sampler microbenchmark: not measured ({result['skipped']}).", ""]
    if importlib.util.find_spec(SAMPLER_MODULE) is None:
        return ["Sampler microbenchmark: measured, but no bench/sampler_bench.py to render it.", ""]
    module = importlib.import_module(SAMPLER_MODULE)
    return ["### Sampler microbenchmark (bench/sampler_bench.py)", "", *module.markdown(result), ""]


# -- the sections, in report order ----------------------------------------------------


def _concurrency_md(r: Results) -> list[str]:
    """Concurrent streams through the server, per prompt shape."""
    lines: list[str] = []
    for shape, levels in r["concurrency"].items():
        lines += _concurrency(shape, levels)
    return lines


def _own(title: str, module_name: str, key: str) -> Callable[[Results], list[str]]:
    """A section whose module renders its own table (its ``markdown(result)``)."""
    return lambda r: _own_table(title, module_name, r.get(key))


def _none(r: Results) -> list:
    return []


@dataclass(frozen=True)
class Section:
    """One section of a run: present when ``present(r)``; its targets and tables."""

    key: str
    targets: Callable[[Results], list[dict]] = _none
    render: Callable[[Results], list[str]] = _none
    present: Callable[[Results], bool] | None = None  # default: r has ``key``

    def here(self, r: Results) -> bool:
        return self.present(r) if self.present else bool(r.get(self.key))


SECTIONS: tuple[Section, ...] = (
    Section("single", _single_targets, _single_md),
    Section("sessions", _sessions_targets, _sessions_md),
    Section("concurrency", _concurrency_targets, _concurrency_md),
    Section("surface", _surface_targets, _surface_md),
    Section("long", _long_targets, lambda r: _long(r["long"])),
    Section("llama_server", _llama_targets, lambda r: _llama(r["llama_server"])),
    # CPU per token, from the single and concurrency sections' /proc readings.
    Section("cpu", _cpu_targets, _cpu_table, present=lambda r: bool(cpu_rows(r))),
    Section("speculation", render=_speculation_md),
    Section("cold_start", render=_cold_start_md),
    Section("rss", _rss_targets, _rss_md),
    Section("kvstore", _kvstore_targets, _kvstore_md),
    Section("sampler", render=lambda r: _sampler(r.get("sampler"))),
    # A slot in every run with sampled rows, measured or not, so it is not forgotten.
    Section(
        "step_profile",
        _step_targets,
        _own(
            "Engine loop per decode step (bench/step_profile.py)",
            "bench.step_profile",
            "step_profile",
        ),
        present=lambda r: bool(r.get("step_profile")) or _sampled_run(r),
    ),
    Section(
        "constrained",
        render=_own(
            "Structured output: a JSON schema's cost per token (bench/constrained_bench.py)",
            "bench.constrained_bench",
            "constrained",
        ),
    ),
    Section(
        "session_fork",
        _session_fork_targets,
        _own(
            "Rewind and fork: a session's next turn against a fresh one (bench/session_fork.py)",
            "bench.session_fork",
            "session_fork",
        ),
    ),
    Section(
        "session_slide",
        _session_slide_targets,
        _own(
            "A session past its context window: TTFT per turn (bench/session_slide.py)",
            "bench.session_slide",
            "session_slide",
        ),
    ),
    Section(
        "draft_speculation",
        _draft_speculation_targets,
        _own(
            "Speculative decoding with a draft model: fp32 target, int4/int8/poor drafts "
            "(bench/draft_speculation.py)",
            "bench.draft_speculation",
            "draft_speculation",
        ),
    ),
    Section(
        "gemma3",
        _gemma3_targets,
        _own(
            "Gemma 3 270M: our fp32 conversion against onnxruntime-genai's builder export "
            "of the same weights, and our served conversion against llama-server on the "
            "GGUF (bench/gemma3_bench.py)",
            "bench.gemma3_bench",
            "gemma3",
        ),
    ),
    Section(
        "fleet",
        render=_own(
            "Beyond one node: sessions across three replicas sharing Redis (bench/fleet.py)",
            "bench.fleet",
            "fleet",
        ),
    ),
    Section(
        "http",
        _http_targets,
        _own(
            "The HTTP gateway against GenerateStream (bench/http_bench.py)",
            "bench.http_bench",
            "http",
        ),
    ),
)


def targets(r: Results) -> list[dict]:
    """Every present section's targets, each with the measured value and whether it is met."""
    return [t for section in SECTIONS if section.here(r) for t in section.targets(r)]


def markdown(r: Results) -> str:
    """The run's section of docs/benchmarks.md: what ran where, its targets, then
    each present section's tables."""
    meta = r["meta"]
    m, v = meta["machine"], meta["versions"]
    lines = [
        f"## {meta['date']}{' (quick)' if meta['plan']['quick'] else ''}",
        "",
        f"- Machine: {m['cpu']}, {m['logical_cores']} logical cores "
        f"({m['affinity_cores']} usable), {m['memory_gib']} GiB; load average at start "
        f"{', '.join(str(x) for x in m['load_avg_at_start'])}.",
        f"- Versions: genai-grpc {v['genai-grpc_git_rev']}"
        f"{' (uncommitted changes)' if v['genai-grpc_git_dirty'] else ''}, onnxruntime "
        f"{v['onnxruntime']}, onnxruntime-genai {v['onnxruntime-genai']}, Python {m['python']}.",
        f"- Model: `{meta['model']['name']}` ({meta['model']['weights']}); "
        f"{meta['plan']['threads']} intra-op threads for every engine; greedy unless a "
        f"table says otherwise{_samplings_note(meta)}; EOS ignored everywhere; "
        f"median of {meta['plan']['reps']} rep(s); total run {meta['elapsed_s'] / 60:.1f} min.",
        "- Ours: the in-process `LLMEngine` and `genai-server` through `GenerateStream` "
        "(client-side timing: TTFT = first token's arrival, decode = (n−1)/(t_last−t_first)); "
        "both put the model's weights on transparent huge pages (`--huge-pages on`, the "
        'default; docs/design.md, "Processes and planes"); the other engines run as their '
        "users get them. "
        "og = onnxruntime-genai in its own process: `og.Generator` for single streams "
        "(best of `past_present_share_buffer` true/false, per metric), `og.Engine` "
        f"for sessions and concurrency{_engine_note(meta)}.",
    ]
    phases = meta.get("phases") or {}
    if phases:
        lines.append(
            "- CPU taken by other work on the machine during the run, in cores (of "
            f"{m['logical_cores']}): "
            + ", ".join(f"{k} {d['foreign_cores']}" for k, d in phases.items())
            + " (ours: "
            + ", ".join(f"{k} {d['ours_cores']}" for k, d in phases.items())
            + ")."
        )
    noisy = meta.get("noisy_measurements")
    if noisy is not None:
        lines.append(
            f"- Before each rep the run waited for a quiet moment "
            f"({meta.get('waited_for_quiet_s', 0)} s in all), and the engines took turns "
            f"going first in it; "
            f"{len(meta.get('retried_reps', []))} rep(s) were rerun with fresh prompts because "
            f"other work took > {meta.get('noisy_threshold_cores')} cores meanwhile; "
            f"{len(noisy)} rep(s) stayed that disturbed (`meta.noisy_measurements`)."
        )
    for name, error in (meta.get("failed_sections") or {}).items():
        lines.append(f"- **Section `{name}` failed and was not measured**: {error}")
    lines.append("")
    lines.append("")
    tg = r.get("targets") or targets(r)
    if tg:
        lines += ["### Targets", ""]
        if _sampled_run(r):
            lines += [
                "(sampled = temperature 0.7, top_p 0.9, top_k 50; sampled_rep: + "
                "repetition_penalty 1.1; ratios are ours over the other engine with the same "
                "settings in this run.)",
                "",
            ]
        lines += _targets_table(tg)
    for section in SECTIONS:
        if section.here(r):
            lines += section.render(r)
    notes = meta.get("notes") or []
    if notes:
        lines += ["Notes:", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
    return lines + [""]
