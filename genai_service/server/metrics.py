"""Prometheus metrics of the frontend and the engine (``--metrics-port``)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _EngineStats(Collector):
    """Exposes the engine's latest counters (polled over IPC) as gauges."""

    def __init__(self) -> None:
        self.snapshot: Mapping[str, Any] = {}
        self.updated = 0.0

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for key, value in sorted(self.snapshot.items()):
            if isinstance(value, int | float) and not isinstance(value, bool):
                name = "genai_engine_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
                yield GaugeMetricFamily(name, f"engine counter {key}", value=float(value))


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "genai_rpc_requests", "RPCs by method and status code", ["rpc", "code"], registry=r
        )
        self.duration = Histogram(
            "genai_rpc_duration_seconds",
            "RPC wall time",
            ["rpc"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "genai_time_to_first_token_seconds",
            "submit to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inflight = Gauge("genai_inflight_generations", "generations running", registry=r)
        self.prompt_tokens = Counter("genai_prompt_tokens", "prompt tokens", registry=r)
        self.cached_tokens = Counter(
            "genai_cached_prompt_tokens", "prompt tokens whose KV was reused", registry=r
        )
        self.completion_tokens = Counter("genai_completion_tokens", "generated tokens", registry=r)
        self.engine_up = Gauge("genai_engine_ready", "1 when the engine serves", registry=r)
        self.engine_restarts = Counter(
            "genai_engine_restarts", "engine process restarts", registry=r
        )
        self.engine = _EngineStats()
        r.register(self.engine)

    def serve(self, host: str, port: int) -> int:
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(server.server_port)

    def observe_rpc(self, rpc: str, code: str, started: float) -> None:
        self.requests.labels(rpc, code).inc()
        self.duration.labels(rpc).observe(time.monotonic() - started)
