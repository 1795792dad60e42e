"""Prometheus metrics of the frontend and the engine (``--metrics-port``).

Besides the RPC and token counters, the gauges that an inference gateway's
endpoint picker schedules on (docs/design.md, "Routing signals"): requests
waiting and running, KV-cache usage as a 0-1 fraction, and the prefix-cache
hit rate of recent requests.
"""

from __future__ import annotations

import collections
import re
import time
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

# The prefix-cache hit rate gauge covers this many of the latest finished requests.
HIT_RATE_WINDOW = 256

# Our routing gauges and counters, and the vLLM names that endpoint pickers
# default to (docs/design.md, "Routing signals").
VLLM_NAMES = {
    "genai_num_requests_waiting": "vllm:num_requests_waiting",
    "genai_num_requests_running": "vllm:num_requests_running",
    "genai_kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "genai_prompt_tokens_total": "vllm:prefix_cache_queries_total",
    "genai_cached_prompt_tokens_total": "vllm:prefix_cache_hits_total",
}


# Engine counters kept per label value as "name.value": the label's name.
_LABELS = {
    "spec_guesses": "proposer",
    "spec_draft_tokens": "proposer",
    "spec_accepted_tokens": "proposer",
}


class _EngineStats(Collector):
    """Exposes the engine's latest counters (polled over IPC) as gauges."""

    def __init__(self) -> None:
        self.snapshot: Mapping[str, Any] = {}
        self.updated = 0.0

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labelled: dict[str, GaugeMetricFamily] = {}
        for key, value in sorted(self.snapshot.items()):
            if not isinstance(value, int | float) or isinstance(value, bool):
                continue
            base, _, label = key.partition(".")
            name = "genai_engine_" + re.sub(r"[^a-zA-Z0-9_]", "_", base)
            if label:  # "spec_draft_tokens.draft": the per-proposer counts
                family = labelled.get(name)
                if family is None:
                    family = labelled[name] = GaugeMetricFamily(
                        name, f"engine counter {base}, by {_LABELS[base]}", labels=[_LABELS[base]]
                    )
                family.add_metric([label], float(value))
            elif not any(k.startswith(key + ".") for k in self.snapshot):
                yield GaugeMetricFamily(name, f"engine counter {key}", value=float(value))
        yield from labelled.values()
        yield from self._routing()

    def _routing(self) -> Iterator[GaugeMetricFamily]:
        s = self.snapshot
        yield GaugeMetricFamily(
            "genai_num_requests_waiting",
            "requests queued in the engine, not yet running",
            value=float(s.get("waiting", 0)),
        )
        yield GaugeMetricFamily(
            "genai_num_requests_running",
            "requests decoding or prefilling in the engine",
            value=float(s.get("running", 0)),
        )
        capacity = s.get("kv_cache_capacity_tokens", 0)
        yield GaugeMetricFamily(
            "genai_kv_cache_usage_perc",
            "fraction (0-1) of the runner's KV slots' token positions in use",
            value=s.get("kv_cache_tokens", 0) / capacity if capacity else 0.0,
        )


class _HitRate(Collector):
    """Cached over prompt tokens of the latest ``HIT_RATE_WINDOW`` requests."""

    def __init__(self) -> None:
        self.recent: collections.deque[tuple[int, int]] = collections.deque(maxlen=HIT_RATE_WINDOW)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        recent = list(self.recent)
        prompt = sum(p for p, _ in recent)
        cached = sum(c for _, c in recent)
        yield GaugeMetricFamily(
            "genai_prefix_cache_hit_rate",
            f"cached / prompt tokens over the latest {HIT_RATE_WINDOW} requests",
            value=cached / prompt if prompt else 0.0,
        )


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
        self.http_refused = Counter(
            "genai_http_connections_refused",
            "HTTP connections closed before a request: header_timeout, body_timeout, "
            "max_connections",
            ["reason"],
            registry=r,
        )
        self.engine = _EngineStats()
        r.register(self.engine)
        self.hit_rate = _HitRate()
        r.register(self.hit_rate)

    def serve(self, host: str, port: int) -> int:
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(server.server_port)

    def observe_usage(self, prompt: int, cached: int, completion: int) -> None:
        """A finished request's token counts."""
        self.prompt_tokens.inc(prompt)
        self.cached_tokens.inc(cached)
        self.completion_tokens.inc(completion)
        self.hit_rate.recent.append((prompt, cached))

    def observe_rpc(self, rpc: str, code: str, started: float) -> None:
        self.requests.labels(rpc, code).inc()
        self.duration.labels(rpc).observe(time.monotonic() - started)
