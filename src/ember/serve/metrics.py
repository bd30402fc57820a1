"""Prometheus metrics of one server, in a registry of its own (two apps in one process do not collide).

Counters and histograms are fed by the routes as requests finish; the engine's gauges (running batch, queue,
KV usage) are read from `EngineCore.stats()` when /metrics is scraped, so they are never stale.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ember.engine.core import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self):
        s = self._stats()
        gauges = {
            "ember_num_requests_running": ("requests in the running batch", s.running),
            "ember_num_requests_waiting": ("requests queued for the running batch", s.waiting),
            "ember_kv_cache_usage_ratio": ("fraction of KV-cache blocks owned by requests", s.kv_usage),
            "ember_kv_cache_blocks_total": ("KV-cache blocks a request can use", s.kv_blocks_total),
            "ember_kv_cache_blocks_used": ("KV-cache blocks owned by requests", s.kv_blocks_used),
            "ember_kv_cache_blocks_cached": (
                "unowned KV-cache blocks kept for prefix reuse",
                s.kv_blocks_cached,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily(
            "ember_num_preemptions", "requests preempted (recomputed later)", s.num_preemptions
        )


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.registry = r = CollectorRegistry()
        r.register(_EngineCollector(stats))
        self.http_requests = Counter(
            "ember_http_requests", "HTTP responses by route and status code", ["route", "code"], registry=r
        )
        self.finished = Counter(
            "ember_request_success", "completions finished, by finish reason", ["finish_reason"], registry=r
        )
        self.prompt_tokens = Counter("ember_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("ember_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram(
            "ember_time_to_first_token_seconds",
            "from request arrival to the first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "ember_time_per_output_token_seconds",
            "mean time between generated tokens after the first, per completion",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5),
            registry=r,
        )
        self.e2e = Histogram(
            "ember_e2e_request_latency_seconds",
            "from request arrival to the last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
