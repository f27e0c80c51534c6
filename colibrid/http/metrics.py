"""`GET /metrics`: Prometheus text from prometheus_client, on a registry of our own.

Counters are bumped by the HTTP app as requests end; the daemon's gauges (queue, decode
speed, hit rate, bytes read, tier occupancy) are read from `DaemonState` at scrape time
by a collector, so they are never stale and cost nothing between scrapes.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from colibrid.serve.events import Done

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
        yield from _roofline(status["roofline"])
        plan = status.get("plan")
        if plan is not None:  # the loaded container's precision plan, as an info metric
            info = GaugeMetricFamily(
                "colibri_precision_plan_info",
                "the precision plan of the loaded model (store/precision_plan.py): 1",
                labels=["model", "plan", "uniform"],
            )
            info.add_metric([status["model"] or "", plan["id"], str(plan["uniform"]).lower()], 1)
            yield info


def _roofline(roofline: dict[str, Any]):  # noqa: ANN202 (metric families)
    """The ceilings the daemon measured for the loaded model and the last finished
    request's shares of them (serve.roofline; docs/performance.md "The live roofline")."""
    ceilings = roofline["ceilings"]
    if ceilings is not None:
        if ceilings["disk_gbs"] is not None:
            yield GaugeMetricFamily(
                "colibri_disk_probe_gbs",
                "O_DIRECT read speed of this model's experts, measured by the daemon (GB/s)",
                value=ceilings["disk_gbs"],
            )
        yield GaugeMetricFamily(
            "colibri_memory_probe_gbs",
            "memory read bandwidth, measured by the daemon (GB/s)",
            value=ceilings["memory_gbs"],
        )
        if ceilings["kernel_tok_s"] is not None:
            yield GaugeMetricFamily(
                "colibri_kernel_ceiling_tokens_per_second",
                "decode tok/s the CPU kernels could compute for this model with reading "
                "free (its matrix layouts timed cache-hot by the daemon)",
                value=ceilings["kernel_tok_s"],
            )
        yield CounterMetricFamily(
            "colibri_ceiling_probes",
            "disk, memory and kernel probes run since the daemon started (never during a request)",
            value=ceilings["probes"],
        )
    last = roofline["last"]
    if last is not None:
        share = GaugeMetricFamily(
            "colibri_last_request_roofline_share",
            "the last finished request's decode against the ceilings: disk (expert bytes/s "
            "over the disk probe), memory (weight bytes/s over the memory probe), kernel "
            "(tok/s over the kernel ceiling), roofline (tok/s over the lowest of the disk-, "
            "memory- and kernel-bound tok/s)",
            labels=["ceiling"],
        )
        for ceiling in ("disk", "memory", "kernel", "roofline"):
            if f"{ceiling}_share" in last:
                share.add_metric([ceiling], last[f"{ceiling}_share"])
        yield share
        yield GaugeMetricFamily(
            "colibri_last_request_read_bytes_per_token",
            "expert bytes the last finished request read from disk per decoded token",
            value=last["read_mb_tok"] * 1e6,
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
        # Prompt tokens computed; the rest came from kept KV: the prompt cache, or another
        # choice of the same request (OpenAI's `n` prefills its prompt once).
        self.prefill_tokens = Counter(
            "colibri_prefill_tokens",
            "prompt tokens prefilled (the others were taken from kept KV)",
            registry=self.registry,
        )
        self.registry.register(_DaemonCollector(state))  # type: ignore[arg-type]

    def finished(self, done: Done) -> None:
        """A request ended with an answer: count its tokens."""
        self.prompt_tokens.inc(done.prompt_tokens)
        self.generated_tokens.inc(done.generated_tokens)
        self.prefill_tokens.inc(done.prompt_tokens - done.cached_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
