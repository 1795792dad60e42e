"""The benchmark's report per section (bench/report.py, bench/history.py), its
/proc CPU reader (bench/procs.py) and its llama-server client (bench/llama.py), on
synthetic results and a stand-in llama-server; no engine runs here."""

from __future__ import annotations

import json
import math
import os
import stat
import sys
import time
from pathlib import Path

import pytest

from bench import history, llama, report
from bench.procs import ProcCpu, proc_cpu_seconds

ROOT = Path(__file__).resolve().parents[2]


def _single(ttft: float, decode: float, cpu: dict | None = None) -> dict:
    out: dict = {"ttft_s": ttft, "decode_tok_s": decode, "reps": []}
    if cpu:
        out["cpu_ms_per_token"] = cpu
    return out


def _conc(tok_s: float, cpu: dict | None = None) -> dict:
    out: dict = {"agg_tok_s": tok_s, "ttft_p50_s": 0.5, "ttft_p99_s": 0.7, "reps": []}
    if cpu:
        out["cpu_ms_per_token"] = cpu
    return out


OURS_CPU = {"frontend": 0.12, "engine": 6.0, "client": 0.2}


def results(*, sampled_rows: bool = True) -> dict:
    """A run's results in the shape bench/suite.py writes (two lengths, one shape)."""
    lengths = ("128", "512")
    single: dict = {
        "ours_inproc": {k: _single(0.10, 70.0) for k in lengths},
        "ours_server": {
            k: _single(0.11, 66.0, OURS_CPU if sampled_rows else None) for k in lengths
        },
        "og_share_true": {k: _single(0.12, 60.0, {"og": 8.0}) for k in lengths},
        "og_share_false": {k: _single(0.13, 55.0) for k in lengths},
    }
    single["og_best"] = {
        k: {"ttft_s": 0.12, "decode_tok_s": 60.0, "ttft_setting": "true", "decode_setting": "true"}
        for k in lengths
    }
    shape = "64-token prompts + 256 new tokens"
    row: dict = {
        "ours": _conc(160.0, OURS_CPU if sampled_rows else None),
        "ours_inproc": _conc(170.0),
        "og": _conc(120.0, {"og": 5.0}),
    }
    plan: dict = {"quick": False, "reps": 1, "threads": 2, "single_new_tokens": 32}
    r: dict = {"single": single, "concurrency": {shape: {"1": row, "8": row}}}
    if sampled_rows:
        sampled = {
            "label": "temperature 0.7, top_p 0.9, top_k 50",
            "ours_server": {k: _single(0.11, 63.0, OURS_CPU) for k in lengths},
            "og_share_true": {k: _single(0.12, 64.0, {"og": 8.5}) for k in lengths},
            "og_share_false": {k: _single(0.12, 50.0) for k in lengths},
            "og_best": {k: {"ttft_s": 0.12, "decode_tok_s": 64.0} for k in lengths},
        }
        single["samplings"] = {"sampled": sampled}
        row["samplings"] = {
            "sampled": {"ours": _conc(152.0, OURS_CPU), "og": _conc(100.0, {"og": 5.5})},
            "sampled_rep": {"ours": _conc(130.0, OURS_CPU), "og": _conc(110.0, {"og": 5.6})},
        }
        r["long"] = {
            "prompt_tokens": 8064,
            "new_tokens": 128,
            "samplings": {
                "greedy": {"ours_server": _single(4.0, 40.0, OURS_CPU), "og": _single(5.0, 38.0)}
            },
        }
        r["llama_server"] = {"skipped": "no --llama-server binary given"}
        r["sampler"] = {"skipped": "no bench.sampler_bench in this checkout"}
        plan |= {
            "concurrency_samplings": ["greedy", "sampled", "sampled_rep"],
            "single_samplings": ["greedy", "sampled"],
        }
    r["meta"] = {
        "date": "2026-12-01 23:00 UTC",
        "machine": {
            "cpu": "test",
            "logical_cores": 2,
            "affinity_cores": 2,
            "memory_gib": 1,
            "python": "3.11",
            "load_avg_at_start": [0.1, 0.1, 0.1],
        },
        "versions": {
            "genai-grpc_git_rev": "abc",
            "genai-grpc_git_dirty": False,
            "onnxruntime": "1",
            "onnxruntime-genai": "0.18.0",
        },
        "plan": plan,
        "model": {"dir": "/m", "name": "m.gguf", "weights": "{}"},
        "elapsed_s": 60.0,
    }
    return r


def _by_name(r: dict) -> dict[str, dict]:
    return {t["target"]: t for t in report.targets(r)}


def test_sampled_targets_compare_each_sampling_with_the_same_sampling_and_with_greedy() -> None:
    ts = _by_name(results())
    shape = "64-token prompts + 256 new tokens"
    t = ts[f"8 streams, {shape}, sampled: total tok/s ≥ 1.3× og.Engine same sampling"]
    assert t["measured"] == pytest.approx(1.52) and t["met"] is True and t["headline"]
    t = ts[f"8 streams, {shape}, sampled_rep: total tok/s ≥ 0.95× ours greedy"]
    assert t["measured"] == pytest.approx(130 / 160) and t["met"] is False
    t = ts["single stream 512 tokens, sampled: decode tok/s ≥ 1.0× og.Generator (best)"]
    assert t["measured"] == pytest.approx(63 / 64) and t["met"] is False
    t = ts["single stream, 8192-token context, greedy: TTFT ≤ 1.0× og.Generator"]
    assert t["measured"] == pytest.approx(0.8) and t["met"] is True
    t = ts[f"8 streams, {shape}, greedy: frontend CPU per streamed token ≤ 0.15 ms"]
    assert t["unit"] == "ms" and t["measured"] == pytest.approx(0.12) and t["met"] is True
    assert "1 stream, 512 tokens, greedy: frontend CPU per streamed token ≤ 0.15 ms" in ts
    # the step profile's slot: not measured in this run
    (slot,) = (t for name, t in ts.items() if "engine-loop Python" in name)
    assert math.isnan(slot["measured"]) and slot["met"] is None
    assert f"8 streams, {shape}: total tok/s ≥ 1.3× og.Engine" in ts
    assert not [n for n in ts if "issue" in n]


def test_a_greedy_only_run_gives_only_the_greedy_targets() -> None:
    names = list(_by_name(results(sampled_rows=False)))
    assert names and not [n for n in names if "sampled" in n or "engine-loop" in n]


def test_markdown_has_the_sampled_rows_the_cpu_table_and_the_skipped_sections() -> None:
    r = results()
    r["targets"] = report.targets(r)
    md = report.markdown(r)
    assert "| 8 | sampled_rep | 130.00 |" in md  # concurrency row per sampling
    assert "Single stream, sampled (temperature 0.7, top_p 0.9, top_k 50)" in md
    assert "### The model's full window: one stream, 8064-token prompt + 128" in md
    assert "### CPU per generated token (ms)" in md
    assert "| 1 stream, 512 tokens | sampled | 0.12 | 6.00 | 0.20 | 8.50 |" in md
    assert "llama-server: not measured (no --llama-server binary given)." in md
    assert "Sampler microbenchmark: not measured" in md
    assert "0.12 ms | yes |" in md  # a target in ms
    # one targets table leads, then the sections in SECTIONS order
    summary = md[md.index("### Targets") : md.index("### Single stream")]
    assert "sampled: total tok/s ≥ 1.3× og.Engine same sampling | 1.52× | yes |" in summary
    assert "| 8 streams, 64-token prompts + 256 new tokens: total tok/s ≥ 1.3× og.Engine" in summary
    assert md.index("### Single stream") < md.index("### Concurrent") < md.index("### CPU per")
    assert md.count("### Targets") == 1


def test_a_failed_section_is_named_and_the_rest_is_reported() -> None:
    # bench.run keeps going past a section that raises (a missing redis-server
    # once cost a 45-minute run all its numbers) and records why.
    r = results()
    r["meta"]["failed_sections"] = {"fleet": "FileNotFoundError: 'redis-server'"}
    r["targets"] = report.targets(r)
    md = report.markdown(r)
    assert "**Section `fleet` failed and was not measured**: FileNotFoundError" in md
    assert "### CPU per generated token (ms)" in md


def test_a_section_that_raises_is_recorded_and_the_next_one_runs() -> None:
    from bench.run import run_one

    results: dict = {}
    failed: dict[str, str] = {}

    def broken() -> dict:
        raise FileNotFoundError("redis-server")

    run_one(results, failed, "fleet", broken)
    run_one(results, failed, "http", lambda: {"ok": 1})
    assert failed == {"fleet": "FileNotFoundError: redis-server"}
    assert results == {"http": {"ok": 1}}


def test_markdown_of_a_greedy_only_run_keeps_one_targets_table() -> None:
    r = results(sampled_rows=False)
    r["targets"] = report.targets(r)
    md = report.markdown(r)
    assert md.count("### Targets") == 1 and "CPU per generated" not in md


def test_history_follows_the_headline_targets(tmp_path: Path) -> None:
    old, new = results(sampled_rows=False), results()
    new["meta"]["date"] = "2026-12-02 01:00 UTC"
    (tmp_path / "a.json").write_text(json.dumps(old))
    (tmp_path / "b.json").write_text(json.dumps(new))
    files = sorted(tmp_path.glob("*.json"))
    table = history.table(files)
    line = next(x for x in table.splitlines() if "sampled: total tok/s ≥ 1.3×" in x)
    assert line.endswith("| – | 1.52* | 1/1 |")
    assert "TTFT ≤ 1.0× og.Generator" not in table  # not a headline target
    assert "TTFT ≤ 1.0× og.Generator" in history.table(files, headline_only=False)
    assert history.table(files, runs=1).splitlines()[0].count("|") == 4


def test_the_page_is_the_latest_run_and_the_history() -> None:
    from bench.run import page

    r = results()
    r["targets"] = report.targets(r)
    text = page(report.markdown(r), "| target | x | met |")
    assert text.startswith("# Benchmarks\n") and text.count("\n## ") == 2
    assert text.rstrip().endswith("| target | x | met |")


def test_the_sampler_draws_what_bench_sampler_golden_recorded() -> None:
    from bench import sampler_bench

    result = sampler_bench.measure(repeats=1)
    assert len(result["cases"]) == 14
    assert all(c["same_tokens"] for c in result["cases"]), [
        (c["config"], c["batch"]) for c in result["cases"] if not c["same_tokens"]
    ]


def test_proc_cpu_seconds_counts_this_process_and_nan_for_a_gone_one() -> None:
    cpu = ProcCpu({"me": [os.getpid()]})
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    assert cpu.lap()["me"] >= 0.03
    assert math.isnan(proc_cpu_seconds(2**22 + 12345))


def test_completion_body_maps_sampling_onto_llama_server_fields() -> None:
    greedy = llama.completion_body([1, 2], 8, None)
    assert greedy["temperature"] == 0.0 and greedy["ignore_eos"] and greedy["prompt"] == [1, 2]
    params = {"temperature": 0.7, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.1, "seed": 3}
    body = llama.completion_body([1], 8, params)
    assert (body["temperature"], body["top_p"], body["top_k"]) == (0.7, 0.9, 50)
    assert (body["repeat_penalty"], body["seed"], body["min_p"]) == (1.1, 3, 0.0)
    assert "repetition_penalty" not in body
    # the penalty's window: the whole context (a current llama-server refuses -1)
    assert body["repeat_last_n"] == 1 + 8


def test_parse_events_counts_tokens_but_not_the_final_summary() -> None:
    lines = [
        b'data: {"content": "a", "tokens": [5], "stop": false}\n',
        b"\n",
        b'data: {"content": "bc", "tokens": [6, 7], "stop": false}\n',
        b'data: {"content": "", "stop": true, "timings": {"predicted_n": 3}}\n',
    ]
    events = list(llama.parse_events(iter(lines)))
    assert [llama.event_tokens(e) for e in events] == [1, 2, 0]


def test_llama_server_section_client_against_a_stand_in(tmp_path: Path) -> None:
    fake = tmp_path / "llama-server"
    script = ROOT / "tests" / "fake_llama_server.py"
    fake.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    server = llama.LlamaServer(fake, tmp_path / "m.gguf", threads=2, start_timeout_s=30)
    try:
        one = server.single([1, 2, 3], 5, {"temperature": 0.7, "seed": 1})
        assert one["tokens"] == 5 and one["server_timings"] == {"predicted_n": 5}
        many = server.concurrent([[1], [2], [3]], 4)
        assert [s["tokens"] for s in many["streams"]] == [4, 4, 4]
        assert all(s["first"] >= many["submit"] for s in many["streams"])
    finally:
        rss = server.stop()
    assert rss["hwm_sum_mb"] > 0


def test_a_group_without_processes_is_not_measured_as_idle() -> None:
    assert math.isnan(ProcCpu({"engine": []}).lap()["engine"])


def test_the_fork_section_has_its_targets_and_table() -> None:
    r = results()
    r["session_fork"] = {
        "history_tokens": 450,
        "turn1_tokens": 150,
        "question_tokens": 8,
        "reps": 3,
        "fork_ms": 0.1,
        "fork_ttft_s": 0.1,
        "fresh_full_ttft_s": 2.0,
        "rewind_ms": 0.1,
        "rewind_ttft_s": 0.1,
        "fresh_turn1_ttft_s": 0.8,
        "fork_ttft_ratio": 0.05,
        "rewind_ttft_ratio": 0.125,
    }
    ts = _by_name(r)
    fork = ts["a fork's first turn: TTFT ≤ 0.5× a fresh session sending the same prompt"]
    assert fork["met"] is True and fork["headline"]
    md = report.markdown(r)
    assert "| ForkSession (whole history) | 0.10 | 0.100 | 2.000 | 0.05× |" in md


def test_the_slide_section_has_its_target_and_table() -> None:
    r = results()
    run = {
        "ttft_s": [0.5, 0.1, 0.12, 0.11],
        "ttft_median_s": 0.115,
        "ttft_max_s": 0.5,
        "ttft_first_half_median_s": 0.3,
        "ttft_second_half_median_s": 0.115,
        "slides": 2,
        "slide_ms_median": 3.25,
        "dropped_tokens": 512,
        "resets": 0,
        "history_tokens": 300,
        "last_answers": ["a", "the | last\nanswer"],
        "slide_kv": "rotate",
    }
    r["session_slide"] = {
        "window": 512,
        "turns": 4,
        "answer_tokens": 96,
        "slide_rotate": run,
        "slide_recompute": {**run, "slide_kv": "recompute"},
        "reset": {**run, "slides": 0, "slide_ms_median": 0.0, "resets": 2},
        "rotate_ttft_growth": 0.38,
        "rotate_vs_reset_ttft_max": 1.0,
    }
    ts = _by_name(r)
    name = (
        "a session past its window (slide, keys rotated): second-half median TTFT ≤ 1.5× "
        "the first half's"
    )
    assert ts[name]["met"] is True and ts[name]["headline"]
    md = report.markdown(r)
    assert "| slide, keys rotated | 0.50 | 0.10 | 0.12 | 0.11 | 2 (3.2) | 512 | 0 |" in md
    assert "“the / last answer…”" in md


def test_fewer_streams_have_targets_and_go_client_rows_where_measured() -> None:
    r = results()
    shape = "64-token prompts + 256 new tokens"
    levels = r["concurrency"][shape]
    one = {**levels["1"], "ours_go": _conc(126.0, {"frontend": 0.1, "engine": 6.0, "client": 0.05})}
    one["samplings"] = {
        name: {**d, "ours_go": _conc(d["ours"]["agg_tok_s"] + 1)}
        for name, d in levels["1"]["samplings"].items()
    }
    levels["1"] = one
    ts = _by_name(r)
    t = ts[f"1 stream(s), {shape}, greedy: total tok/s ≥ 1.0× og.Engine same sampling"]
    assert t["measured"] == pytest.approx(160 / 120) and t["met"] is True
    t = ts[f"1 stream(s), {shape}, sampled, Go client: total tok/s ≥ 1.0× og.Engine same sampling"]
    assert t["measured"] == pytest.approx(153 / 100)
    assert not [n for n in ts if n.startswith("8 stream(s)")]  # the most streams: own targets
    md = report.markdown({**r, "targets": report.targets(r)})
    assert "| 1 | greedy | 160.00 | 170.00 | 126.00 | 120.00 | 1.33 | 1.05 |" in md
    assert f"| 1 streams, {shape} (Go client) | greedy | 0.10 | 6.00 | 0.05 |" in md


def test_the_gemma3_section_has_its_targets_and_tables_or_says_why_not() -> None:
    from bench import gemma3_bench

    r = results()
    r["gemma3"] = {"skipped": "no --gemma3-builder directory given"}
    assert not [t for t in report.targets(r) if "Gemma" in t["target"]]
    assert "Skipped: no --gemma3-builder directory given." in report.markdown(r)

    g: dict = {
        "builder_made_by": "builder 0.18",
        "threads": 2,
        "reps": 3,
        "single_new_tokens": 128,
        "stream_new_tokens": 128,
        "single": {
            "128/greedy": {
                "ours_ttft_s": 0.2,
                "og_ttft_s": 0.25,
                "ours_decode_tok_s": 33.0,
                "og_decode_tok_s": 30.0,
                "same_first_tokens": [True, True, False],
            }
        },
        "concurrent": {
            "sampled": {
                "ours_tok_s": 110.0,
                "og_tok_s": 100.0,
                "ours_ttft_p50_s": 1.0,
                "og_ttft_p50_s": 2.0,
            }
        },
    }
    g["targets"] = gemma3_bench.targets(g)
    r["gemma3"] = g
    ts = _by_name(r)
    one = ts[
        "Gemma 3 270M fp32, single stream 128 tokens, greedy: decode tok/s ≥ 1.0× og.Generator"
    ]
    assert one["met"] is True and one["measured"] == pytest.approx(1.1)
    eight = ts["Gemma 3 270M fp32, 8 streams, sampled: tok/s ≥ 1.2× og.Engine"]
    assert eight["met"] is False and eight["measured"] == pytest.approx(1.1)
    md = report.markdown(r)
    assert "| 128 | greedy | 0.20 | 0.25 | 0.80 | 33.00 | 30.00 | 1.10 | yes yes no |" in md
    assert "| sampled | 110.0 | 100.0 | 1.10 | 1.00 | 2.00 |" in md


def test_the_gemma3_section_compares_with_llama_server_with_or_without_og() -> None:
    from bench import gemma3_bench

    ll = {
        "ours_weights": "int8",
        "llama_version": "version: 1 (abc)",
        "command": "llama-server -m g.gguf -t 2",
        "single_new_tokens": 128,
        "stream_new_tokens": 128,
        "single": {
            "512/sampled": {
                "ours_ttft_s": 0.5,
                "llama_ttft_s": 1.0,
                "ours_decode_tok_s": 45.0,
                "llama_decode_tok_s": 50.0,
            }
        },
        "concurrent": {
            "greedy": {
                "ours_tok_s": 160.0,
                "llama_tok_s": 100.0,
                "ours_ttft_p50_s": 1.0,
                "llama_ttft_p50_s": 2.0,
            }
        },
    }
    r = results()
    g: dict = {"llama": ll}  # no builder directory: the llama-server comparison alone
    g["targets"] = gemma3_bench.targets(g)
    r["gemma3"] = g
    ts = _by_name(r)
    one = ts["Gemma 3 270M, single stream 512 tokens, sampled: decode tok/s ≥ 1.0× llama-server"]
    assert one["met"] is False and one["measured"] == pytest.approx(0.9)
    eight = ts["Gemma 3 270M, 8 streams, greedy: tok/s ≥ 1.5× llama-server"]
    assert eight["met"] is True and eight["measured"] == pytest.approx(1.6)
    assert not [t for t in ts if t.startswith("Gemma") and "og." in t]
    md = report.markdown(r)
    assert (
        "| 1 stream, 512-token prompt + 128 (decode) | sampled | 45.00 | 50.00 | 0.90 "
        "| 0.50 | 1.00 | 0.50 |" in md
    )
    assert "| 8 streams, 64-token prompts + 128 (total) | greedy | 160.0 | 100.0 | 1.60 |" in md
    assert "version: 1 (abc)" in md and "(int8 weights)" in md
    with pytest.raises(ValueError, match="builder directory, a llama-server binary"):
        gemma3_bench.measure(None)
