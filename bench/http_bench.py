"""One stream through the OpenAI-compatible HTTP plane (SSE) against the same
stream through ``GenerateStream``: decode tok/s and TTFT, one server, reps
alternating (ABBA) so that drift and noise fall on both alike.

    .venv/bin/python -m bench.http_bench [--model default] [--reps 5] [--new-tokens 256]

Client-side timing as everywhere (``bench/ours.py``): the clock starts when
the request is sent, TTFT is the first chunk carrying a token, decode tok/s
is ``(n - 1) / (t_last - t_first)``. Prefix caching is off, so every
request computes its whole prompt. Target (issue 16): HTTP ≤ 5 % slower.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

from genai_client import Client

from .ours import ServerProcess, server_single
from .procs import ProcCpu, free_port
from .workload import stream_stats

PROMPT_TOKENS = 128


def http_single(port: int, ids: Sequence[int], new_tokens: int) -> dict:
    """One streamed ``/v1/completions`` call (greedy, EOS ignored), read as SSE."""
    body = {
        "model": "default",
        "prompt": list(ids),
        "max_tokens": new_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.connect()  # connected before the clock starts, as the gRPC channel is
        data = json.dumps(body).encode()
        submit = time.perf_counter()
        conn.request("POST", "/v1/completions", data, {"content-type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
        times: list[float] = []
        tokens = 0
        for line in response:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["finish_reason"] is None:
                times.append(time.perf_counter())  # one engine step's tokens per chunk
    finally:
        conn.close()
    # Chunks counted one token each, then the total from usage (a chunk that
    # caught up several steps carries several).
    stats = stream_stats(submit, times, [1] * len(times))
    if tokens and len(times) > 1:
        stats["decode_tok_s"] = (tokens - 1) / (times[-1] - times[0])
        stats["tokens"] = tokens
    return stats


def measure(model_dir: str, reps: int = 5, threads: int = 0, new_tokens: int = 256) -> dict:
    port = free_port()
    server = ServerProcess(
        model_dir, threads, extra_args=["--http-port", str(port), "--prefix-cache-bytes", "0"]
    )
    ids = [100 + (i * 37) % 5000 for i in range(PROMPT_TOKENS)]
    runs: dict[str, list[dict]] = {"grpc": [], "http": []}
    # The frontend's CPU per token, each path's own (less noisy than rates on a
    # busy machine: another process's load slows a stream, not this figure).
    frontend_s = {"grpc": 0.0, "http": 0.0}
    client_s = {"grpc": 0.0, "http": 0.0}  # this process's (the client's) CPU
    try:
        with Client(server.target) as client:
            server_single(client, ids, 8)  # warm both paths
            http_single(port, ids, 8)
            cpu = ProcCpu(server.cpu_groups())
            for rep in range(reps):
                order = ("grpc", "http") if rep % 2 == 0 else ("http", "grpc")
                for which in order:
                    cpu.lap()
                    mark = time.process_time()
                    if which == "grpc":
                        runs["grpc"].append(server_single(client, ids, new_tokens))
                    else:
                        runs["http"].append(http_single(port, ids, new_tokens))
                    client_s[which] += time.process_time() - mark
                    frontend_s[which] += cpu.lap()["frontend"]
    finally:
        server.stop()

    def median(which: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[which])

    tokens = {which: sum(r["tokens"] for r in runs[which]) for which in runs}
    out: dict[str, Any] = {"reps": reps, "prompt_tokens": PROMPT_TOKENS, "new_tokens": new_tokens}
    for which in runs:
        out[which] = {
            "decode_tok_s": median(which, "decode_tok_s"),
            "ttft_s": median(which, "ttft_s"),
            "decode_tok_s_all": [round(r["decode_tok_s"], 1) for r in runs[which]],
            "ttft_s_all": [round(r["ttft_s"], 4) for r in runs[which]],
            "frontend_cpu_ms_per_token": frontend_s[which] * 1e3 / tokens[which],
            "client_cpu_ms_per_token": client_s[which] * 1e3 / tokens[which],
        }
    out["decode_ratio"] = out["http"]["decode_tok_s"] / out["grpc"]["decode_tok_s"]
    out["ttft_ratio"] = out["http"]["ttft_s"] / out["grpc"]["ttft_s"]
    return out


def markdown(result: dict) -> list[str]:
    g, h = result["grpc"], result["http"]
    return [
        f"One stream, {result['prompt_tokens']}-token prompt, {result['new_tokens']} new tokens "
        f"(greedy, prefix cache off), median of {result['reps']} alternating reps.",
        "",
        "| path | decode tok/s | TTFT (ms) | frontend CPU (ms/token) | client CPU (ms/token) |",
        "|---|---|---|---|---|",
        f"| GenerateStream (gRPC) | {g['decode_tok_s']:.1f} | {g['ttft_s'] * 1e3:.1f} | "
        f"{g['frontend_cpu_ms_per_token']:.3f} | {g['client_cpu_ms_per_token']:.3f} |",
        f"| /v1/completions (HTTP/SSE) | {h['decode_tok_s']:.1f} | {h['ttft_s'] * 1e3:.1f} | "
        f"{h['frontend_cpu_ms_per_token']:.3f} | {h['client_cpu_ms_per_token']:.3f} |",
        f"| HTTP / gRPC | {result['decode_ratio']:.3f} | {result['ttft_ratio']:.3f} | | |",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    from genai_service.convert.default_model import resolve_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--new-tokens", type=int, default=256)
    args = p.parse_args(argv)
    model_dir = str(resolve_model(args.model))
    result = measure(model_dir, args.reps, args.threads, args.new_tokens)
    print(json.dumps(result, indent=2))
    print("\n".join(markdown(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
