"""/metrics carries what an endpoint picker routes on: waiting and running
requests, KV-cache usage (0-1) and the prefix-cache hit rate, moving with the
load (docs/design.md, "Routing signals")."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from bench.procs import scrape_metrics
from genai_client import Client
from genai_service.config import CacheConfig, EngineConfig, SchedulerConfig, ServerConfig
from genai_service.server.metrics import VLLM_NAMES
from tests.server_harness import ServerThread, free_port


def wait_for(port: int, ok: Callable[[dict[str, float]], bool], timeout_s: float = 20) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        values = scrape_metrics(port)
        if ok(values) or time.monotonic() > deadline:
            return values
        time.sleep(0.1)


def test_routing_gauges_move_under_load(long_context_model_dir: Path) -> None:
    engine = EngineConfig(
        model_dir=str(long_context_model_dir),
        cache=CacheConfig(chunk_size=4),
        scheduler=SchedulerConfig(max_num_seqs=2, max_queue=8),
    )
    srv = ServerThread(ServerConfig(engine=engine, port=free_port(), metrics_port=0)).start()
    try:
        assert srv.server is not None and srv.server.metrics_port
        port = srv.server.metrics_port
        idle = wait_for(port, lambda v: "genai_kv_cache_usage_perc" in v)
        assert idle["genai_num_requests_running"] == idle["genai_num_requests_waiting"] == 0
        assert idle["genai_kv_cache_usage_perc"] == 0
        with Client(srv.target, timeout=60) as client:
            # Two slots, four long streams (seconds each): two run, two wait.
            streams = [
                client.stream(f"the cat sat {i}", max_new_tokens=4000, ignore_eos=True)
                for i in range(4)
            ]
            busy = wait_for(
                port,
                lambda v: (
                    v["genai_num_requests_running"] == 2 and v["genai_num_requests_waiting"] == 2
                ),
            )
            assert busy["genai_num_requests_running"] == 2, busy
            assert busy["genai_num_requests_waiting"] == 2, busy
            assert 0 < busy["genai_kv_cache_usage_perc"] <= 1, busy
            for stream in streams:
                stream.cancel()
            drained = wait_for(
                port,
                lambda v: v["genai_num_requests_running"] + v["genai_num_requests_waiting"] == 0,
            )
            assert drained["genai_num_requests_running"] == 0, drained
            assert drained["genai_kv_cache_usage_perc"] == 0, drained
            # The same 12-token prompt twice: the second reuses three chunks of four.
            prompt = "one two three four five six seven eight nine ten eleven twelve"
            first = client.generate(prompt, max_new_tokens=2)
            second = client.generate(prompt, max_new_tokens=2)
        assert second.usage.cached_tokens > 0
        expected = second.usage.cached_tokens / (
            first.usage.prompt_tokens + second.usage.prompt_tokens
        )
        hits = wait_for(port, lambda v: v.get("genai_prefix_cache_hit_rate", 0) > 0)
        # Only these two requests finished (the cancelled streams report no usage).
        assert abs(hits["genai_prefix_cache_hit_rate"] - expected) < 1e-9, hits
        # Every vLLM name of the mapping table has its genai_ counterpart exported.
        assert set(VLLM_NAMES) <= set(hits), set(VLLM_NAMES) - set(hits)
    finally:
        srv.stop()
