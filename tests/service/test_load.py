"""``make load`` (bench.load): the soak tool on a tiny model, and its token checks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.load import KINDS, Expected, Ledger, parse_mix
from bench.procs import REPO


def test_ledger_checks_whole_responses_and_prefixes() -> None:
    ledger = Ledger({"c": Expected((5, 6, 7), "MAX_TOKENS")})
    ledger.check("unary", "c", (5, 6, 7), "MAX_TOKENS", complete=True)
    ledger.check("cancel", "c", (5, 6), "CANCELLED", complete=False)  # cut short: a prefix
    ledger.check("cancel", "c", (), "CANCELLED", complete=False)
    assert ledger.n_mismatches == 0
    ledger.check("unary", "c", (5, 6), "MAX_TOKENS", complete=True)  # short but "complete"
    ledger.check("unary", "c", (5, 6, 7), "EOS_TOKEN", complete=True)  # other finish reason
    ledger.check("cancel", "c", (5, 8), "CANCELLED", complete=False)  # not a prefix
    assert ledger.n_mismatches == 3
    assert [m["got"] for m in ledger.mismatches] == [[5, 6], [5, 6, 7], [5, 8]]
    assert ledger.checked == {"full": 3, "prefix": 3}


def test_ledger_counts_codes_a_kind_must_not_get() -> None:
    ledger = Ledger({})
    ledger.call("cancel", "GenerateStream", "CANCELLED", 0.1, frozenset({"OK", "CANCELLED"}))
    ledger.call("unary", "Generate", "UNAVAILABLE", 0.1, frozenset({"OK"}))
    assert ledger.n_unexpected == 1
    assert ledger.unexpected == [{"kind": "unary", "rpc": "Generate", "code": "UNAVAILABLE"}]


def test_mix_names_the_bad_kind() -> None:
    assert parse_mix("unary=1,bidi=0.5") == {"unary": 1.0, "bidi": 0.5}
    for text, message in [
        ("unary=1,soak=2", "unknown kind 'soak'"),
        ("unary=x", "weight of 'unary' is 'x'"),
        ("unary=-1", "must be >= 0"),
        ("unary=0", "at least one kind"),
    ]:
        try:
            parse_mix(text)
        except ValueError as exc:
            assert message in str(exc)
        else:
            raise AssertionError(f"{text!r} was accepted")


def test_load_run_on_a_tiny_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A few seconds of the soak: every kind ran, nothing failed, nothing mismatched."""
    out = tmp_path / "load.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.load",
            "--model",
            str(tiny_model_dir),
            "--duration-s",
            "5",
            "--workers",
            "3",
            "--threads",
            "1",
            "--rss-interval-s",
            "1",
            "--out",
            str(out),
            "--kv-chunk-size",  # a genai-server flag: chunks short prompts fill
            "16",
        ],  # fmt: skip
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    s = report["summary"]
    assert set(s["requests_by_kind"]) == set(KINDS)
    assert all(n > 0 for n in s["requests_by_kind"].values()), s["requests_by_kind"]
    for rpc in ("Generate", "GenerateStream", "GenerateBidi", "Generate(session)"):
        assert s["calls_by_rpc"][rpc] > 0, rpc
    assert s["internal_or_unknown"] == 0
    assert s["unexpected_codes"] == 0
    assert s["token_mismatches"] == 0
    assert s["token_checks"]["full"] > 0 and s["token_checks"]["prefix"] > 0
    assert s["outcomes_by_code"]["CANCELLED"] > 0  # the cancels reached the server
    assert s["outcomes_by_code"]["INVALID_ARGUMENT"] > 0
    for when in ("boot", "start", "end"):
        assert all(mb > 0 for mb in report["rss_mb"][when].values()), report["rss_mb"]
    assert len(report["rss_samples"]) >= 3
    # The server reached its kvstore with the token the tool gave both of them.
    last = report["rss_samples"][-1]
    assert last["kvstore_pushed_chunks"] > 0
    assert last["kvstore_errors"] == 0 and last["kvstore_mac_failures"] == 0
    assert report["passed"] is True
