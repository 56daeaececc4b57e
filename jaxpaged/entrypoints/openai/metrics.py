"""Prometheus metrics (vLLM's names under `jaxpaged:`), fed by the engine loop and read at scrape time.

Gauges (and the engine's own running totals) are read from its last stats snapshot when /metrics
is scraped, so they cost nothing per step; counters and histograms are updated from each loop pass's IterationStats.
Each server owns its registry, so several apps in one process (tests) do not collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxpaged.engine.async_engine import AsyncLLMEngine, IterationStats

disable_created_metrics()  # the *_created series only double the scrape (vLLM drops them too)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class _EngineGauges:
    """Current state, from the engine's latest snapshot."""

    def __init__(self, engine: AsyncLLMEngine):
        self.engine = engine

    def collect(self):
        stats = self.engine.get_stats()
        values = {
            "num_requests_running": ("Sequences in the running batch.", stats["num_running"]),
            "num_requests_waiting": ("Sequences waiting for a slot (new or preempted).", stats["num_waiting"]),
            "kv_blocks_used": ("KV-cache blocks held by sequences.", stats["kv_blocks_used"]),
            "kv_blocks_total": ("KV-cache blocks in the pool.", stats["kv_blocks_total"]),
            "kv_cache_usage_perc": (
                "Fraction of KV-cache blocks in use (1 = full).",
                stats["kv_blocks_used"] / stats["kv_blocks_total"] if stats["kv_blocks_total"] else 0.0,
            ),
            "engine_alive": ("1 while the engine loop runs, 0 once it has died.", 0.0 if self.engine.errored else 1.0),
        }
        if "kv_blocks_cached" in stats:
            values["kv_blocks_cached"] = ("Free KV-cache blocks still holding a reusable prompt prefix.", stats["kv_blocks_cached"])
        if "spec_decode_acceptance_rate" in stats:  # with speculative_config
            values["spec_decode_acceptance_rate"] = ("Accepted / proposed tokens so far.", stats["spec_decode_acceptance_rate"])
            values["spec_decode_mean_accepted_length"] = (
                "Tokens a verifying sequence gains per step (1 + accepted proposals), on average.",
                stats["spec_decode_mean_accepted_length"],
            )
            values["spec_decode_proposals_per_step"] = (
                "Sequences verifying proposals per verifying step, on average.", stats["spec_decode_proposals_per_step"])  # fmt: skip
        for name, (doc, value) in values.items():
            yield GaugeMetricFamily(f"jaxpaged:{name}", doc, value=float(value))
        counters = {
            "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
            "prefix_cache_hits": "Prompt tokens found in the prefix cache (not recomputed).",
            "spec_decode_num_drafts": "Speculative decoding: sequences' proposals verified.",
            "spec_decode_num_draft_tokens": "Speculative decoding: proposed tokens verified.",
            "spec_decode_num_accepted_tokens": "Speculative decoding: proposed tokens accepted.",
        }
        for name, doc in counters.items():
            if name in stats:
                yield CounterMetricFamily(f"jaxpaged:{name}", doc, value=float(stats[name]))


class ServerMetrics:
    def __init__(self, engine: AsyncLLMEngine):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineGauges(engine))
        r = self.registry
        self.prompt_tokens = Counter("jaxpaged:prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter("jaxpaged:generation_tokens", "Generated tokens.", registry=r)
        self.preemptions = Counter("jaxpaged:num_preemptions", "Sequences preempted (recomputed later).", registry=r)
        self.finished = Counter(
            "jaxpaged:request_finished", "Finished sequences by reason (stop, length, abort).", ["finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "jaxpaged:time_to_first_token_seconds", "Time from arrival to the first generated token.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.itl = Histogram(
            "jaxpaged:inter_token_latency_seconds", "Time between a request's consecutive steps that produced tokens.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "jaxpaged:e2e_request_latency_seconds", "Time from arrival to the last token.", buckets=_E2E_BUCKETS, registry=r
        )
        for reason in ("stop", "length", "abort"):
            self.finished.labels(reason)

    def observe(self, stats: IterationStats) -> None:
        """The engine loop's listener (called on its thread; prometheus_client is thread-safe)."""
        if stats.prompt_tokens:
            self.prompt_tokens.inc(stats.prompt_tokens)
        if stats.generation_tokens:
            self.generation_tokens.inc(stats.generation_tokens)
        if stats.preemptions:
            self.preemptions.inc(stats.preemptions)
        for value in stats.time_to_first_token:
            self.ttft.observe(value)
        for value in stats.inter_token_latency:
            self.itl.observe(value)
        for value in stats.e2e_latency:
            self.e2e.observe(value)
        for reason in stats.finished_reasons:
            self.finished.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
