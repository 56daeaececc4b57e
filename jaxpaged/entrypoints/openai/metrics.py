"""Prometheus /metrics: the engine's metrics (engine/metrics.py, the same objects LLM.get_metrics() returns) in
Prometheus' text format, under vLLM's names with the `jaxpaged:` prefix.

Gauges (and the engine's own running totals) are read from its last stats snapshot when /metrics is scraped, so they
cost nothing per step; counters and histograms are updated from each loop pass's IterationStats. Each server owns its
registry, so several apps in one process (tests) do not collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from jaxpaged.engine import metrics as engine_metrics
from jaxpaged.engine.async_engine import AsyncLLMEngine, IterationStats

disable_created_metrics()  # the *_created series only double the scrape (vLLM drops them too)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def families(metrics: list[engine_metrics.Metric]):
    """vLLM's metric objects as Prometheus metric families, one per name (its label sets as samples)."""
    out: dict[str, object] = {}
    for m in metrics:
        stem = m.name.removeprefix(engine_metrics.PREFIX)
        doc, labels = engine_metrics.HELP.get(stem, stem), list(m.labels)
        if isinstance(m, engine_metrics.Gauge):
            family = out.setdefault(m.name, GaugeMetricFamily(m.name, doc, labels=labels))
            family.add_metric(list(m.labels.values()), m.value)
        elif isinstance(m, engine_metrics.Counter):
            family = out.setdefault(m.name, CounterMetricFamily(m.name, doc, labels=labels))
            family.add_metric(list(m.labels.values()), m.value)
        elif isinstance(m, engine_metrics.Histogram):
            family = out.setdefault(m.name, HistogramMetricFamily(m.name, doc, labels=labels))
            family.add_metric(list(m.labels.values()), list(m.buckets.items()), m.sum)
    return out.values()


class _Collector:
    def __init__(self, engine: AsyncLLMEngine, metrics: engine_metrics.EngineMetrics):
        self.engine, self.metrics = engine, metrics

    def collect(self):
        yield from families(self.metrics.snapshot(self.engine.get_stats(), alive=not self.engine.errored))


class ServerMetrics:
    def __init__(self, engine: AsyncLLMEngine):
        self.metrics = engine_metrics.EngineMetrics()
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(engine, self.metrics))

    def observe(self, stats: IterationStats) -> None:
        """The engine loop's listener (called on its thread; EngineMetrics takes a lock)."""
        self.metrics.observe(stats)

    def render(self) -> bytes:
        return generate_latest(self.registry)
