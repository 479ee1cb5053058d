"""Prometheus metrics of the server: requests, tokens, latency, KV-pool use, prefix-cache queries
and hits, graph programs and the speculative counters (named as vLLM's `prefix_cache_*` and
`spec_decode_*`), in a registry of the app's own."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from metrale.server.engine_loop import EngineLoop

# No `_created` series: they double the output and no dashboard reads them (vLLM drops them too).
disable_created_metrics()

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _EngineCollector:
    """Reads the engine's telemetry at scrape time (under the engine loop's lock)."""

    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop

    def collect(self):
        engine = self.loop.engine
        with self.loop.lock:
            tel, spec, alloc = engine.telemetry, engine.telemetry.spec, engine.allocator
            graphs = engine.runner.graphs
            yield CounterMetricFamily(
                "metrale:prompt_tokens", "Prompt rows run", value=tel.prefill_tokens
            )
            yield CounterMetricFamily(
                "metrale:generation_tokens", "Tokens emitted", value=tel.decode_tokens
            )
            yield CounterMetricFamily(
                "metrale:num_preemptions", "Sequences preempted", value=tel.preemptions
            )
            yield GaugeMetricFamily(
                "metrale:kv_cache_usage_perc",
                "Share of KV pages in use",
                value=1.0 - alloc.num_free / alloc.num_usable,
            )
            # vLLM's names: tokens queried at admission, and the ones cached pages covered
            cache = tel.prefix_cache
            yield CounterMetricFamily(
                "metrale:prefix_cache_queries",
                "Prefix cache queries, in tokens (prompt tokens at each admission)",
                value=cache.queries,
            )
            yield CounterMetricFamily(
                "metrale:prefix_cache_hits",
                "Prefix cache hits, in tokens (prompt tokens taken from cached pages)",
                value=cache.hits,
            )
            yield GaugeMetricFamily(
                "metrale:num_requests_running",
                "Sequences running",
                value=len(engine.scheduler.running),
            )
            yield GaugeMetricFamily(
                "metrale:num_requests_waiting",
                "Sequences waiting",
                value=len(engine.scheduler.waiting),
            )
            for name, value, doc in (
                ("num_drafts", spec.num_drafts, "Sequence-verifies with drafts"),
                ("num_draft_tokens", spec.num_draft_tokens, "Draft tokens verified"),
                ("num_accepted_tokens", spec.num_accepted_tokens, "Draft tokens accepted"),
            ):
                yield CounterMetricFamily(f"metrale:spec_decode_{name}", doc, value=value)
            per_pos = CounterMetricFamily(
                "metrale:spec_decode_num_accepted_tokens_per_pos",
                "Accepted draft tokens by position",
                labels=["position"],
            )
            for pos, count in enumerate(spec.accepted_per_pos):
                per_pos.add_metric([str(pos)], count)
            yield per_pos
            yield from _request_histograms(tel.request, self.loop.model_name)
            reasons = CounterMetricFamily(
                "metrale:request_success",
                "Finished requests' sequences by finish reason",
                labels=["model_name", "finished_reason"],
            )
            for reason, count in tel.requests_finished.items():
                reasons.add_metric([self.loop.model_name, str(reason)], count)
            yield reasons
            if graphs is not None:
                stats = graphs.cache.stats()
                for key in ("hits", "misses", "evictions"):
                    yield CounterMetricFamily(
                        f"metrale:graph_{key}", f"Graph program {key}", value=stats[key]
                    )


_REQUEST_HISTOGRAMS = (
    ("ttft", "time_to_first_token_seconds", "Time from arrival to the first token"),
    ("inter_token", "inter_token_latency_seconds", "Gap per output token after the first"),
    ("e2e", "e2e_request_latency_seconds", "Arrival to the last token, at the engine"),
    ("queue", "request_queue_time_seconds", "Arrival to first scheduled"),
    ("prefill", "request_prefill_time_seconds", "First scheduled to the first token"),
    ("decode", "request_decode_time_seconds", "First token to the last"),
    ("prompt_tokens", "request_prompt_tokens", "Prompt length"),
    ("generation_tokens", "request_generation_tokens", "Generated tokens"),
)


def _request_histograms(requests, model_name: str):
    """vLLM's request histograms (named after `metrale:`), from the engine's telemetry."""
    for attr, name, doc in _REQUEST_HISTOGRAMS:
        hist = getattr(requests, attr)
        family = HistogramMetricFamily(f"metrale:{name}", doc, labels=["model_name"])
        cumulative, buckets = 0, []
        for bound, count in zip(hist.bounds, hist.counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else str(bound), cumulative))
        family.add_metric([model_name], buckets, sum_value=hist.total)
        yield family


class ServerMetrics:
    def __init__(self, loop: EngineLoop) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "metrale:requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "metrale:http_request_latency_seconds",
            "HTTP latency to the response's start, by route",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(loop))

    def render(self) -> bytes:
        return generate_latest(self.registry)
