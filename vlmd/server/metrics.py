"""Prometheus metrics: engine gauges read from the worker's stats snapshot at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _EngineCollector:
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        stats = self.engine.stats
        gauges = {
            "vlmd_num_requests_running": ("Requests in the running batch", stats.num_running),
            "vlmd_num_requests_waiting": ("Requests waiting to be scheduled", stats.num_waiting),
            "vlmd_kv_cache_usage_perc": ("Fraction of KV blocks in use", stats.kv_usage),
            "vlmd_kv_cache_free_blocks": ("KV blocks on the free list", stats.num_free_kv_blocks),
            "vlmd_kv_cache_total_blocks": ("KV blocks in the cache", stats.num_kv_blocks),
            "vlmd_encoder_cache_usage_perc": ("Fraction of encoder-cache slots in use", stats.encoder_cache_usage),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "vlmd_num_preemptions": ("Requests preempted (recomputed later)", stats.num_preemptions),
            "vlmd_encoder_forwards": ("Media items run through an encoder", stats.num_encoder_forwards),
            "vlmd_engine_steps": ("Engine steps run", stats.num_steps),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)


class Metrics:
    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.ttft = Histogram(
            "vlmd_time_to_first_token_seconds", "Time from request arrival to its first token",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=self.registry,
        )
        self.preprocess = Histogram(
            "vlmd_preprocess_seconds", "Chat template, media fetch, decode and processing per request",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5), registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
