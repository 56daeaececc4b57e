"""The engine's metrics, counted once: `LLM.get_metrics()` returns them as vLLM's metric objects
(vllm.v1.metrics.reader's Counter, Gauge, Histogram, Vector) and the server's Prometheus /metrics renders the same
objects (entrypoints/openai/metrics.py), so the two cannot disagree.

Gauges and the engine's own running totals (preemptions, prefix-cache lookups, speculative decoding) are read from
an `LLMEngine.get_stats()` snapshot when asked for, costing nothing per step; token counts, finish reasons and
latencies come from each pass's IterationStats, which a RequestTimer builds from the outputs the caller sees.
Names are vLLM's under the `jaxpaged:` prefix, as /metrics has always served them.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import threading
from typing import Any

from jaxpaged.outputs import RequestOutput

PREFIX = "jaxpaged:"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)
FINISH_REASONS = ("stop", "length", "abort")  # always reported, at 0 until seen


# -- vLLM's metric objects (vllm/v1/metrics/reader.py) ---------------------------------------------------------


@dataclasses.dataclass
class Metric:
    """A metric's name and labels; one name may appear with several label sets."""

    name: str
    labels: dict[str, str]


@dataclasses.dataclass
class Counter(Metric):
    """A monotonically increasing integer."""

    value: int


@dataclasses.dataclass
class Vector(Metric):
    """An ordered array of integer counters (vLLM's, for per-position counts; none here yet)."""

    values: list[int]


@dataclasses.dataclass
class Gauge(Metric):
    """A value that can go up or down."""

    value: float


@dataclasses.dataclass
class Histogram(Metric):
    """Observations in buckets: `buckets` maps each upper bound ("0.1", ..., "+Inf") to the cumulative count at or
    below it, as Prometheus' `le` label; `count` equals the "+Inf" bucket, `sum` is the observations' total."""

    count: int
    sum: float
    buckets: dict[str, int]


# name (without the prefix) -> help text: Prometheus' HELP lines
HELP = {
    "num_requests_running": "Sequences in the running batch.",
    "num_requests_waiting": "Sequences waiting for a slot (new or preempted).",
    "kv_blocks_used": "KV-cache blocks held by sequences.",
    "kv_blocks_total": "KV-cache blocks in the pool.",
    "kv_cache_usage_perc": "Fraction of KV-cache blocks in use (1 = full).",
    "engine_alive": "1 while the engine loop runs, 0 once it has died.",
    "kv_blocks_cached": "Free KV-cache blocks still holding a reusable prompt prefix.",
    "spec_decode_acceptance_rate": "Accepted / proposed tokens so far.",
    "spec_decode_mean_accepted_length": "Tokens a verifying sequence gains per step (1 + accepted proposals), on average.",
    "spec_decode_proposals_per_step": "Sequences verifying proposals per verifying step, on average.",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache (not recomputed).",
    "spec_decode_num_drafts": "Speculative decoding: sequences' proposals verified.",
    "spec_decode_num_draft_tokens": "Speculative decoding: proposed tokens verified.",
    "spec_decode_num_accepted_tokens": "Speculative decoding: proposed tokens accepted.",
    "prompt_tokens": "Prompt tokens of admitted requests.",
    "generation_tokens": "Generated tokens.",
    "num_preemptions": "Sequences preempted (recomputed later).",
    "request_finished": "Finished sequences by reason (stop, length, abort).",
    "time_to_first_token_seconds": "Time from arrival to the first generated token.",
    "inter_token_latency_seconds": "Time between a request's consecutive steps that produced tokens.",
    "e2e_request_latency_seconds": "Time from arrival to the last token.",
}
_STATS_GAUGES = ("kv_blocks_cached", "spec_decode_acceptance_rate", "spec_decode_mean_accepted_length",
                 "spec_decode_proposals_per_step")  # fmt: skip
_STATS_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                   "spec_decode_num_accepted_tokens")  # fmt: skip


# -- what one pass did ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class IterationStats:
    """What one pass of the loop did, for metrics (observed on the engine thread)."""

    engine: dict[str, Any]  # LLMEngine.get_stats() after the pass
    prompt_tokens: int = 0  # of requests admitted in this pass
    generation_tokens: int = 0
    time_to_first_token: list[float] = dataclasses.field(default_factory=list)
    inter_token_latency: list[float] = dataclasses.field(default_factory=list)
    e2e_latency: list[float] = dataclasses.field(default_factory=list)
    finished_reasons: list[str] = dataclasses.field(default_factory=list)
    preemptions: int = 0


@dataclasses.dataclass
class _Timing:
    arrival: float
    tokens: int = 0
    last: float | None = None


class RequestTimer:
    """Each request's arrival and latest tokens, turned into the pass's IterationStats as its outputs are seen.
    streaming=False (LLM.generate, whose outputs arrive only when a request ends): no time to first token nor
    inter-token latency, which would only repeat the end-to-end time."""

    def __init__(self, streaming: bool = True):
        self.streaming = streaming
        self._timing: dict[str, _Timing] = {}
        self.pending = IterationStats(engine={})

    def added(self, request_id: str, num_prompt_tokens: int, now: float) -> None:
        self._timing[request_id] = _Timing(now)
        self.pending.prompt_tokens += num_prompt_tokens

    def output(self, out, now: float) -> None:
        """A request's cumulative output (RequestOutput or PoolingRequestOutput) as its caller gets it."""
        timing = self._timing.get(out.request_id)
        if timing is None:
            return
        stats = self.pending
        tokens = sum(len(c.token_ids) for c in out.outputs) if isinstance(out, RequestOutput) else 0
        if tokens > timing.tokens:
            stats.generation_tokens += tokens - timing.tokens
            if self.streaming:
                if timing.last is None:
                    stats.time_to_first_token.append(now - timing.arrival)
                else:
                    stats.inter_token_latency.append(now - timing.last)
            timing.tokens, timing.last = tokens, now
        if out.finished:
            stats.e2e_latency.append(now - timing.arrival)
            stats.finished_reasons.extend(finish_reasons(out))
            del self._timing[out.request_id]

    def forget(self, request_id: str) -> None:
        self._timing.pop(request_id, None)

    def clear(self) -> None:
        self._timing.clear()

    def take(self) -> IterationStats:
        stats, self.pending = self.pending, IterationStats(engine={})
        return stats


def finish_reasons(out) -> list[str]:
    """Each choice's; a pooled prompt (PoolingRequestOutput) has no choices: "stop", or "abort" unpooled."""
    if isinstance(out, RequestOutput):
        return [c.finish_reason or "abort" for c in out.outputs]
    return ["stop" if out.outputs is not None else "abort"]


# -- the one set of metrics ---------------------------------------------------------------------------------------


class _Buckets:
    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # le: a value on a bound is in that bucket
        self.sum += value

    def metric(self, name: str) -> Histogram:
        buckets, total = {}, 0
        for bound, count in zip((*self.bounds, math.inf), self.counts):
            total += count
            buckets["+Inf" if bound == math.inf else repr(float(bound))] = total
        return Histogram(name, {}, count=total, sum=self.sum, buckets=buckets)


class EngineMetrics:
    """Counters and histograms fed by IterationStats (from any one thread), read with an engine stats snapshot
    (from any thread)."""

    def __init__(self, streaming: bool = True):
        self._lock = threading.Lock()
        self._counts = {"prompt_tokens": 0, "generation_tokens": 0}
        self._finished = dict.fromkeys(FINISH_REASONS, 0)
        self._histograms = {"time_to_first_token_seconds": _Buckets(LATENCY_BUCKETS),
                            "inter_token_latency_seconds": _Buckets(LATENCY_BUCKETS)} if streaming else {}  # fmt: skip
        self._histograms["e2e_request_latency_seconds"] = _Buckets(E2E_BUCKETS)

    def observe(self, stats: IterationStats) -> None:
        observed = {"time_to_first_token_seconds": stats.time_to_first_token,
                    "inter_token_latency_seconds": stats.inter_token_latency,
                    "e2e_request_latency_seconds": stats.e2e_latency}  # fmt: skip
        with self._lock:
            self._counts["prompt_tokens"] += stats.prompt_tokens
            self._counts["generation_tokens"] += stats.generation_tokens
            for reason in stats.finished_reasons:
                self._finished[reason] = self._finished.get(reason, 0) + 1
            for name, values in observed.items():
                if name in self._histograms:
                    for value in values:
                        self._histograms[name].observe(value)

    def snapshot(self, stats: dict[str, Any], alive: bool = True) -> list[Metric]:
        """Every metric now, `stats` being the engine's get_stats()."""
        used, total = stats["kv_blocks_used"], stats["kv_blocks_total"]
        gauges = {"num_requests_running": stats["num_running"], "num_requests_waiting": stats["num_waiting"],
                  "kv_blocks_used": used, "kv_blocks_total": total, "kv_cache_usage_perc": used / total if total else 0.0,
                  "engine_alive": 1.0 if alive else 0.0}  # fmt: skip
        gauges |= {name: stats[name] for name in _STATS_GAUGES if name in stats}
        out: list[Metric] = [Gauge(PREFIX + name, {}, float(value)) for name, value in gauges.items()]
        out += [Counter(PREFIX + name, {}, int(stats[name])) for name in _STATS_COUNTERS if name in stats]
        with self._lock:
            out += [Counter(PREFIX + name, {}, value) for name, value in self._counts.items()]
            out.append(Counter(PREFIX + "num_preemptions", {}, int(stats["num_preemptions"])))
            out += [Counter(PREFIX + "request_finished", {"finished_reason": reason}, count)
                    for reason, count in self._finished.items()]  # fmt: skip
            out += [h.metric(PREFIX + name) for name, h in self._histograms.items()]
        return out
