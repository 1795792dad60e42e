"""TTFT of a long prompt computed cold vs. with its prefix served from the kvstore.

Engine A computes a 2,048-token prompt (cold) and pushes its complete chunks
to a ``genai-kvstore`` child process; engine B is a fresh engine (empty
in-process caches, like a restarted or second replica) that sends the same
prompt and fetches the chunks. TTFT is measured in-process from
``add_request`` to the first token. Repeated with fresh engines; median.

    .venv/bin/python -m bench.kv_reuse [--prompt-tokens 2048] [--reps 3]

Prints one JSON object; asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import time
from typing import Any

import numpy as np

from genai_service.config import CacheConfig, EngineConfig, RunnerConfig
from genai_service.contract.request import GenerationRequest, StoppingCriteria
from genai_service.engine.engine import LLMEngine


def ttft(engine: LLMEngine, rid: str, ids: list[int]) -> tuple[float, int]:
    """Seconds to the first token, and the cached tokens the request reported."""
    engine.add_request(
        GenerationRequest(
            rid, tuple(ids), stopping=StoppingCriteria(max_new_tokens=1, ignore_eos=True)
        )
    )
    start = time.perf_counter()
    first = None
    cached = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.token_ids and first is None:
                first = time.perf_counter() - start
            if out.finished and out.usage is not None:
                cached = out.usage.cached_tokens
        if engine.last_step_idle:
            time.sleep(0.0005)
    assert first is not None
    return first, cached


def measure(
    model_dir: str, prompt_tokens: int, reps: int, threads: int, chunk: int
) -> dict[str, Any]:
    from tests.kvstore_harness import KvStoreProcess

    kv = KvStoreProcess("--log-format", "console", "--memory-bytes", str(4 << 30)).start()
    secret = secrets.token_bytes(32)  # engine B trusts what engine A wrote
    try:

        def engine() -> LLMEngine:
            eng = LLMEngine(
                EngineConfig(
                    model_dir=model_dir,
                    runner=RunnerConfig(intra_op_threads=threads),
                    cache=CacheConfig(chunk_size=chunk),
                    kvstore=kv.config(timeout_s=10.0, integrity_key=secret),
                )
            )
            # Warm up as genai-server does before it reports SERVING, so neither
            # measurement pays for ONNX Runtime's lazy first-run set-up.
            ttft(eng, "warmup", [1, 2, 3])
            eng.prefix_index.clear()
            return eng

        vocab = engine().vocab_size
        cold, warm, cached = [], [], 0
        for rep in range(reps):
            # distinct prompts per rep, so every cold run is really cold
            rng = np.random.default_rng(rep)
            ids = [int(t) for t in rng.integers(100, vocab - 100, prompt_tokens)]
            a = engine()
            t_cold, c = ttft(a, f"cold{rep}", ids)
            assert c == 0
            assert a.remote is not None and a.remote.flush(60)
            a.close()
            b = engine()
            t_warm, cached = ttft(b, f"warm{rep}", ids)
            b.close()
            cold.append(t_cold)
            warm.append(t_warm)
        return {
            "prompt_tokens": prompt_tokens,
            "chunk_size": chunk,
            "cached_tokens": cached,
            "ttft_cold_s": statistics.median(cold),
            "ttft_from_kvstore_s": statistics.median(warm),
            "ratio": statistics.median(warm) / statistics.median(cold),
            "reps": reps,
        }
    finally:
        kv.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="default")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--chunk-size", type=int, default=256)
    args = p.parse_args()
    from genai_service.convert.default_model import resolve_model

    model_dir = str(resolve_model(args.model))
    print(
        json.dumps(measure(model_dir, args.prompt_tokens, args.reps, args.threads, args.chunk_size))
    )


if __name__ == "__main__":
    main()
