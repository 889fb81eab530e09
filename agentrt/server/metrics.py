"""Prometheus metrics through `prometheus_client`, in a registry of the server's own (no
process-global state: two servers in one process do not share counts).

Names follow vLLM's (`agentrt:` prefix), every series labelled with `model_name`. Gauges
(running / waiting requests, KV usage) and the engine's own counters (preemptions,
prefix-cache queries and hits) are read from the scheduler at scrape time; latencies and
token counts are observed by the serving code as requests stream.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from agentrt.engine.records import KVTransferStats, SchedulerStats, SpecDecodeStats

# generate_latest writes the classic text format (our names need no UTF-8 escaping).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip


@dataclass(slots=True)
class RequestTimer:
    """Latency bookkeeping of one engine request (times are `time.monotonic()`)."""

    metrics: ServerMetrics
    arrival: float
    last_token_time: float | None = None
    num_tokens: int = 0
    finished: bool = False

    def on_tokens(self, num_tokens: int) -> None:
        """Tokens arrived: the first gives the TTFT, later ones the inter-token latency (a
        delta with several tokens, e.g. accepted drafts, spreads its gap over them)."""
        if num_tokens <= 0:
            return
        now = time.monotonic()
        if self.last_token_time is None:
            self.metrics.ttft.observe(now - self.arrival)
        else:
            gap = (now - self.last_token_time) / num_tokens
            for _ in range(num_tokens):
                self.metrics.inter_token.observe(gap)
        self.last_token_time = now
        self.num_tokens += num_tokens

    def on_finish(self, finish_reason: str | None, num_prompt_tokens: int) -> None:
        """Count the request once (an abort after the end changes nothing)."""
        if self.finished:
            return
        self.finished = True
        self.metrics.e2e.observe(time.monotonic() - self.arrival)
        self.metrics.finished.labels(self.metrics.model_name, finish_reason or "unknown").inc()
        self.metrics.prompt_tokens.inc(num_prompt_tokens)
        self.metrics.generation_tokens.inc(self.num_tokens)


class ServerMetrics:
    """The server's metrics. `render(stats)` is the /metrics body for the scheduler's
    `stats` (None when the engine is dead: its series are left out)."""

    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._engine = _EngineStats(model_name)
        self.registry.register(self._engine)
        label, registry = ("model_name",), self.registry

        def histogram(name: str, help_text: str, buckets: tuple[float, ...]):
            metric = Histogram(name, help_text, label, buckets=buckets, registry=registry)
            return metric.labels(model_name)

        def counter(name: str, help_text: str):
            return Counter(name, help_text, label, registry=registry).labels(model_name)

        self.prompt_tokens = counter("agentrt:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("agentrt:generation_tokens", "Tokens generated.")
        self.finished = Counter(
            "agentrt:request_success",
            "Finished requests by finish reason.",
            ("model_name", "finished_reason"),
            registry=registry,
        )
        self.responses = Counter(
            "agentrt:http_responses",
            "API responses by status code.",
            ("model_name", "status"),
            registry=registry,
        )
        self.ttft = histogram(
            "agentrt:time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS
        )
        self.inter_token = histogram(
            "agentrt:inter_token_latency_seconds", "Time between tokens.", TOKEN_LATENCY_BUCKETS
        )
        self.e2e = histogram(
            "agentrt:e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS
        )

    def timer(self, arrival: float) -> RequestTimer:
        return RequestTimer(self, arrival)

    def count_response(self, status: int) -> None:
        self.responses.labels(self.model_name, str(status)).inc()

    def render(self, stats: SchedulerStats | None) -> bytes:
        self._engine.stats = stats
        return generate_latest(self.registry)


class _EngineStats:
    """The scheduler's gauges and counters, as of the last `stats` set before a scrape."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: SchedulerStats | None = None

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        if stats is None:
            return
        queried, hits = stats.prefix_cache_queried_tokens, stats.prefix_cache_hit_tokens
        for family, name, help_text, value in (
            (GaugeMetricFamily, "num_requests_running", "Requests running.", stats.num_running),
            (GaugeMetricFamily, "num_requests_waiting", "Requests waiting.", stats.num_waiting),
            (
                GaugeMetricFamily,
                "kv_cache_usage_perc",
                "Fraction of KV-cache blocks in use (1 = full).",
                stats.kv_cache_usage,
            ),
            (CounterMetricFamily, "num_preemptions", "Requests preempted.", stats.num_preemptions),
            (
                CounterMetricFamily,
                "prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                queried,
            ),
            (
                CounterMetricFamily,
                "prefix_cache_hits",
                "Prompt tokens found in the prefix cache.",
                hits,
            ),
            (
                GaugeMetricFamily,
                "prefix_cache_hit_rate",
                "Prefix-cache hits / queries since start.",
                hits / queried if queried else 0.0,
            ),
        ):
            metric = family(f"agentrt:{name}", help_text, labels=["model_name"])
            metric.add_metric([self.model_name], value)
            yield metric
        if stats.spec_decode is not None:
            yield from self._spec_decode(stats.spec_decode_method, stats.spec_decode)
        if stats.kv_transfer is not None:
            yield from self._kv_transfer(stats.kv_connector, stats.kv_transfer)

    def _kv_transfer(self, connector: str, kv: KVTransferStats) -> Iterator[Metric]:
        """The KV connector's counters, labelled with the connector."""
        for name, help_text, value in (
            ("kv_transfer_num_loads", "Requests whose prefix the connector loaded.", kv.num_loads),
            (
                "kv_transfer_num_loaded_tokens",
                "Prompt tokens loaded instead of computed.",
                kv.num_loaded_tokens,
            ),
            (
                "kv_transfer_num_load_failures",
                "Requests that computed their prefill themselves after a failed transfer.",
                kv.num_load_failures,
            ),
            (
                "kv_transfer_num_saved_blocks",
                "KV blocks stored, or sent to another instance.",
                kv.num_saved_blocks,
            ),
            (
                "kv_transfer_num_holds_refused",
                "do_remote_decode requests refused (429) or not held: the p2p producer's "
                "held blocks were at kv_max_held_fraction of its pool.",
                kv.num_holds_refused,
            ),
        ):
            metric = CounterMetricFamily(
                f"agentrt:{name}", help_text, labels=["model_name", "connector"]
            )
            metric.add_metric([self.model_name, connector], value)
            yield metric

    def _spec_decode(self, method: str, spec: SpecDecodeStats) -> Iterator[Metric]:
        """vLLM's spec_decode series (labelled with the method too), and the two ratios."""
        for family, name, help_text, value in (
            (
                CounterMetricFamily,
                "spec_decode_num_drafts",
                "Verification steps that had drafts.",
                spec.num_drafts,
            ),
            (
                CounterMetricFamily,
                "spec_decode_num_draft_tokens",
                "Draft tokens verified.",
                spec.num_draft_tokens,
            ),
            (
                CounterMetricFamily,
                "spec_decode_num_accepted_tokens",
                "Draft tokens accepted.",
                spec.num_accepted_tokens,
            ),
            (
                GaugeMetricFamily,
                "spec_decode_acceptance_rate",
                "Accepted / drafted tokens since start.",
                spec.acceptance_rate,
            ),
            (
                GaugeMetricFamily,
                "spec_decode_mean_accepted_length",
                "Tokens per drafting step since start: accepted drafts + 1.",
                spec.mean_accepted_length,
            ),
        ):
            metric = family(f"agentrt:{name}", help_text, labels=["model_name", "method"])
            metric.add_metric([self.model_name, method], value)
            yield metric

    def describe(self) -> Iterator[Metric]:
        return iter(())
