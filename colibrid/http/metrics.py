"""`GET /metrics`: Prometheus text from prometheus_client, on a registry of our own.

Counters are bumped by the HTTP app as requests end; the daemon's gauges (queue, decode
speed, hit rate, bytes read, tier occupancy) are read from `DaemonState` at scrape time
by a collector, so they are never stale and cost nothing between scrapes.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _DaemonCollector:
    def __init__(self, state: Any) -> None:
        self.state = state

    def collect(self):  # noqa: ANN201 (prometheus_client protocol)
        status = self.state.status()
        tiers = status["tiers"]
        yield GaugeMetricFamily(
            "colibri_queued_requests", "requests waiting for a slot", value=status["queued"]
        )
        yield GaugeMetricFamily(
            "colibri_running_requests", "requests decoding", value=status["running"]
        )
        yield GaugeMetricFamily(
            "colibri_decode_tokens_per_second",
            "decode speed of the last finished request",
            value=status["last_tok_s"],
        )
        hit = status.get("hit_rate")
        yield GaugeMetricFamily(
            "colibri_expert_hit_rate",
            "share of expert lookups served from memory",
            value=1.0 if hit is None else hit,
        )
        vram_hit = tiers["vram"].get("hit_rate")
        if vram_hit is not None:
            yield GaugeMetricFamily(
                "colibri_vram_hit_rate",
                "share of weight uses served from the backend's device memory",
                value=vram_hit,
            )
        store = tiers.get("store") or {}
        yield CounterMetricFamily(
            "colibri_expert_bytes_read",
            "expert bytes read from disk",
            value=store.get("bytes_read", 0),
        )
        experts = GaugeMetricFamily(
            "colibri_tier_experts", "experts held per tier", labels=["tier"]
        )
        size = GaugeMetricFamily(
            "colibri_tier_bytes", "expert bytes held per tier", labels=["tier"]
        )
        for tier in ("vram", "ram", "disk"):
            experts.add_metric([tier], tiers[tier]["experts"])
            size.add_metric([tier], tiers[tier]["gb"] * 1024**3)
        yield experts
        yield size
        yield GaugeMetricFamily(
            "colibri_rss_bytes", "resident memory of the daemon", value=status["rss_gb"] * 1024**3
        )


class HttpMetrics:
    def __init__(self, state: Any) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "colibri_http_requests",
            "HTTP requests answered",
            ["route", "status"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "colibri_prompt_tokens", "prompt tokens processed", registry=self.registry
        )
        self.generated_tokens = Counter(
            "colibri_generated_tokens", "tokens generated", registry=self.registry
        )
        self.registry.register(_DaemonCollector(state))  # type: ignore[arg-type]

    def render(self) -> bytes:
        return generate_latest(self.registry)
