"""Prometheus metrics in the text exposition format (version 0.0.4), written by hand: a few
counters and histograms need no client library and no process-global registry.

Names follow vLLM's (`agentrt:` prefix). Gauges (running / waiting requests, KV usage) and
the engine's own counters (preemptions, prefix-cache queries and hits) are read from the
scheduler at scrape time; latencies and token counts are observed by the serving code as
requests stream.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from dataclasses import dataclass, field

from agentrt.engine.scheduler import SchedulerStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip


class Histogram:
    """Cumulative buckets, a sum and a count (Prometheus semantics)."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last slot is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts, strict=True):
            cumulative += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{name}_bucket{{le="{le}"}} {cumulative}')
        lines += [f"{name}_sum {self.sum!r}", f"{name}_count {self.count}"]
        return lines


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
        self.metrics.finished[finish_reason or "unknown"] += 1
        self.metrics.prompt_tokens += num_prompt_tokens
        self.metrics.generation_tokens += self.num_tokens


@dataclass(slots=True)
class ServerMetrics:
    ttft: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    inter_token: Histogram = field(default_factory=lambda: Histogram(TOKEN_LATENCY_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: Counter = field(default_factory=Counter)  # finish_reason -> requests
    responses: Counter = field(default_factory=Counter)  # HTTP status -> responses

    def timer(self, arrival: float) -> RequestTimer:
        return RequestTimer(self, arrival)

    def render(self, stats: SchedulerStats | None, model_name: str) -> str:
        lines: list[str] = []
        label = f'model_name="{_escape(model_name)}"'

        def scalar(name: str, kind: str, help_text: str, value: float) -> None:
            lines.extend(
                (
                    f"# HELP {name} {help_text}",
                    f"# TYPE {name} {kind}",
                    f"{name}{{{label}}} {value}",
                )
            )

        if stats is not None:
            queried, hits = stats.prefix_cache_queried_tokens, stats.prefix_cache_hit_tokens
            scalar("agentrt:num_requests_running", "gauge", "Requests running.", stats.num_running)
            scalar("agentrt:num_requests_waiting", "gauge", "Requests waiting.", stats.num_waiting)
            scalar(
                "agentrt:kv_cache_usage_perc",
                "gauge",
                "Fraction of KV-cache blocks in use (1 = full).",
                stats.kv_cache_usage,
            )
            scalar(
                "agentrt:num_preemptions_total",
                "counter",
                "Requests preempted.",
                stats.num_preemptions,
            )
            scalar(
                "agentrt:prefix_cache_queries_total",
                "counter",
                "Prompt tokens looked up in the prefix cache.",
                queried,
            )
            scalar(
                "agentrt:prefix_cache_hits_total",
                "counter",
                "Prompt tokens found in the prefix cache.",
                hits,
            )
            scalar(
                "agentrt:prefix_cache_hit_rate",
                "gauge",
                "Prefix-cache hits / queries since start.",
                hits / queried if queried else 0.0,
            )
        scalar(
            "agentrt:prompt_tokens_total", "counter", "Prompt tokens processed.", self.prompt_tokens
        )
        scalar(
            "agentrt:generation_tokens_total",
            "counter",
            "Tokens generated.",
            self.generation_tokens,
        )
        lines += ["# HELP agentrt:request_success_total Finished requests by finish reason."]
        lines += ["# TYPE agentrt:request_success_total counter"]
        for reason, count in sorted(self.finished.items()):
            lines.append(
                f'agentrt:request_success_total{{{label},finished_reason="{_escape(reason)}"}} '
                f"{count}"
            )
        lines += ["# HELP agentrt:http_responses_total API responses by status code."]
        lines += ["# TYPE agentrt:http_responses_total counter"]
        for status, count in sorted(self.responses.items()):
            lines.append(f'agentrt:http_responses_total{{{label},status="{status}"}} {count}')
        for name, histogram, help_text in (
            ("agentrt:time_to_first_token_seconds", self.ttft, "Time to first token."),
            ("agentrt:inter_token_latency_seconds", self.inter_token, "Time between tokens."),
            ("agentrt:e2e_request_latency_seconds", self.e2e, "End-to-end request latency."),
        ):
            lines += histogram.render(name, help_text)
        return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
