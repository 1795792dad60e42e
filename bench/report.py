"""The targets of issue 6 checked against a run, and the markdown section for
``docs/benchmarks.md``."""

from __future__ import annotations

import math
from collections.abc import Callable
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
    name: str, measured: float, limit: float, ok: Callable[[float, float], bool], unit: str = "×"
) -> dict:
    met = None if math.isnan(measured) else bool(ok(measured, limit))
    return {"target": name, "measured": measured, "limit": limit, "unit": unit, "met": met}


def _ge(a: float, b: float) -> bool:
    return a >= b


def _le(a: float, b: float) -> bool:
    return a <= b


def targets(r: Results) -> list[dict]:
    """Issue 6's Targets, each with the measured value and whether it is met."""
    out: list[dict] = []
    single = r.get("single")
    if single:
        server, inproc, og = single["ours_server"], single["ours_inproc"], single["og_best"]
        for length in sorted(server, key=int):
            out.append(
                _target(
                    f"single stream {length} tokens: decode tok/s ≥ 1.0× og.Generator (best)",
                    _ratio(server[length]["decode_tok_s"], og[length]["decode_tok_s"]),
                    1.0,
                    _ge,
                )
            )
        for length in sorted(server, key=int):
            out.append(
                _target(
                    f"single stream {length} tokens: TTFT ≤ 1.0× og.Generator (best)",
                    _ratio(server[length]["ttft_s"], og[length]["ttft_s"]),
                    1.0,
                    _le,
                )
            )
        ttft_over = max(_ratio(server[k]["ttft_s"], inproc[k]["ttft_s"]) - 1 for k in server)
        decode_over = max(
            _ratio(inproc[k]["decode_tok_s"], server[k]["decode_tok_s"]) - 1 for k in server
        )
        out.append(
            _target(
                "gRPC + process overhead on TTFT ≤ 5% (worst length)", ttft_over * 100, 5, _le, "%"
            )
        )
        out.append(
            _target(
                "gRPC + process overhead on decode ≤ 5% (worst length)",
                decode_over * 100,
                5,
                _le,
                "%",
            )
        )
        lengths = sorted(server, key=int)
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
    conc = r.get("concurrency")
    if conc:
        shapes = list(conc)
        for i, shape in enumerate(shapes[:2]):
            levels = conc[shape]
            top = max(levels, key=int)
            ours, og = levels[top]["ours"], levels[top]["og"]
            need = 1.3 if i == 0 else 1.2
            out.append(
                _target(
                    f"{top} streams, {shape}: total tok/s ≥ {need}× og.Engine",
                    _ratio(ours["agg_tok_s"], og["agg_tok_s"]),
                    need,
                    _ge,
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
    sess = r.get("sessions")
    if sess:
        last = len(sess["alone"]["ours"]) - 1
        out.append(
            _target(
                f"session alone: turn-{last + 1} TTFT ≤ 1.0× og.Engine continuing",
                _ratio(sess["alone"]["ours"][last], sess["alone"]["og"][last]),
                1.0,
                _le,
            )
        )
        out.append(
            _target(
                f"{sess['conversations']} sessions interleaved: turn-{last + 1} TTFT ≤ 0.3× og",
                _ratio(sess["interleaved"]["ours"][last], sess["interleaved"]["og"][last]),
                0.3,
                _le,
            )
        )
    rss = r.get("rss")
    kv = r.get("kvstore")
    if kv:
        out.append(
            _target(
                "issue 4: 2,048-token TTFT with the prefix from the kvstore ≤ 0.2× cold",
                kv["reuse"]["ratio"],
                0.2,
                _le,
            )
        )
        out.append(
            _target(
                "issue 4: kvstore Get of 256-token chunks ≥ 1 GB/s over loopback",
                kv["throughput"]["get_gb_per_s_sync_no_verify"],
                1.0,
                _ge,
                "GB/s",
            )
        )
    if rss and rss.get("og_max_mb"):
        out.append(
            _target(
                "peak RSS ≤ onnxruntime-genai's",
                _ratio(rss["ours_server_tree_mb"], rss["og_max_mb"]),
                1.0,
                _le,
            )
        )
    return out


# -- markdown ------------------------------------------------------------------------


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
    return lines + [""]


def markdown(r: Results) -> str:
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
        f"{meta['plan']['threads']} intra-op threads for every engine; greedy; "
        f"median of {meta['plan']['reps']} rep(s); total run {meta['elapsed_s'] / 60:.1f} min.",
        "- Ours: the in-process `LLMEngine` and `genai-server` through `GenerateStream` "
        "(client-side timing: TTFT = first token's arrival, decode = (n−1)/(t_last−t_first)). "
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
    lines.append("")
    if "single" in r:
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
    if "sessions" in r:
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
    if "concurrency" in r:
        for shape, levels in r["concurrency"].items():
            lines += [
                f"### Concurrent streams through the server: {shape}",
                "",
                "(in-process: the same requests on our engine without gRPC, for reference.)",
                "",
            ]
            rows = []
            for n in sorted(levels, key=int):
                o, g = levels[n]["ours"], levels[n]["og"]
                ip = levels[n].get("ours_inproc", {})
                rows.append(
                    [
                        n,
                        o["agg_tok_s"],
                        ip.get("agg_tok_s"),
                        g["agg_tok_s"],
                        _ratio(o["agg_tok_s"], g["agg_tok_s"]),
                        o["ttft_p50_s"],
                        g["ttft_p50_s"],
                        _ratio(o["ttft_p50_s"], g["ttft_p50_s"]),
                        o["ttft_p99_s"],
                        g["ttft_p99_s"],
                    ]
                )
            lines += _table(
                [
                    "streams",
                    "ours tok/s",
                    "(in-process)",
                    "og.Engine tok/s",
                    "ours/og",
                    "ours p50 TTFT (s)",
                    "og p50 TTFT (s)",
                    "ours/og",
                    "ours p99 TTFT (s)",
                    "og p99 TTFT (s)",
                ],
                rows,
            )
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
    if "rss" in r:
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
    tg = r.get("targets") or []
    kv = r.get("kvstore")
    if kv:
        reuse, tp = kv["reuse"], kv["throughput"]
        lines += ["### KV reuse through the kvstore (issue 4)", ""]
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
    if tg:
        lines += ["### Targets", ""]
        rows = [
            [
                t["target"],
                f"{_fmt(t['measured'])}{ {'%': '%', 'GB/s': ' GB/s'}.get(t['unit'], '×') }",
                {True: "yes", False: "**no**", None: "–"}[t["met"]],
            ]
            for t in tg
        ]
        lines += _table(["target", "measured", "met?"], rows)
    notes = meta.get("notes") or []
    if notes:
        lines += ["Notes:", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)


def _engine_note(meta: dict) -> str:
    eng = meta.get("og_engine_model")
    if not eng or eng == meta["model"]["dir"]:
        return ""
    return (
        " (og.Engine's static batch rejects a graph that returns only the last position's "
        "logits, so it runs an all-logits conversion of the same GGUF with the same weights)"
    )
