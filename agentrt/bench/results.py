"""What a benchmark measures: one `RequestRecord` per request, summed up into a `BenchResult`.

Invariants of a `BenchResult`: `completed + failed == num_prompts`; every latency summary
has `p50 <= p90 <= p99`; the throughputs are the token counts of completed requests divided
by `duration_s`; `goodput` counts completed requests that are valid (structured outputs:
they parse and validate against their schema; otherwise every completed request is) and
within the goodput bounds, per second.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import jsonschema


@dataclass(slots=True)
class RequestRecord:
    """The outcome of one request. Times are seconds; `itls` are the gaps between successive
    chunks of output tokens after the first."""

    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    e2e: float | None = None
    valid: bool | None = None  # None: the request had no schema
    error: str | None = None


@dataclass(frozen=True, slots=True)
class LatencySummary:
    mean: float
    p50: float
    p90: float
    p99: float


@dataclass(frozen=True, slots=True)
class BenchResult:
    mode: str
    config: dict[str, Any]
    num_prompts: int
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    total_input_tokens: int
    total_output_tokens: int
    goodput: float
    ttft_ms: LatencySummary | None = None
    itl_ms: LatencySummary | None = None
    e2e_ms: LatencySummary | None = None
    valid_fraction: float | None = None
    errors: list[str] = field(default_factory=list)  # the first few failure messages

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def is_valid(text: str, schema: dict) -> bool:
    """Whether `text` parses as JSON and validates against `schema`."""
    try:
        instance = json.loads(text)
    except json.JSONDecodeError:
        return False
    return jsonschema.validators.validator_for(schema)(schema).is_valid(instance)


def summarize_ms(values: list[float]) -> LatencySummary | None:
    """Mean and nearest-rank percentiles of `values` (seconds), in milliseconds."""
    if not values:
        return None
    ordered = sorted(values)

    def at(q: float) -> float:
        rank = min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.5) - 1))
        return round(ordered[rank] * 1000, 3)

    mean = round(sum(ordered) / len(ordered) * 1000, 3)
    return LatencySummary(mean=mean, p50=at(0.5), p90=at(0.9), p99=at(0.99))


def build_result(
    mode: str,
    config: dict[str, Any],
    records: list[RequestRecord],
    duration_s: float,
    *,
    goodput_e2e_ms: float | None = None,
    goodput_ttft_ms: float | None = None,
) -> BenchResult:
    completed = [r for r in records if r.ok]
    duration_s = max(duration_s, 1e-9)
    input_tokens = sum(r.prompt_tokens for r in completed)
    output_tokens = sum(r.output_tokens for r in completed)

    def good(r: RequestRecord) -> bool:
        if r.valid is False:
            return False
        if goodput_e2e_ms is not None and (r.e2e is None or r.e2e * 1000 > goodput_e2e_ms):
            return False
        return goodput_ttft_ms is None or (r.ttft is not None and r.ttft * 1000 <= goodput_ttft_ms)

    num_structured = sum(r.valid is not None for r in records)
    return BenchResult(
        mode=mode,
        config=config,
        num_prompts=len(records),
        completed=len(completed),
        failed=len(records) - len(completed),
        duration_s=round(duration_s, 4),
        request_throughput=round(len(completed) / duration_s, 4),
        output_throughput=round(output_tokens / duration_s, 4),
        total_token_throughput=round((input_tokens + output_tokens) / duration_s, 4),
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        goodput=round(sum(map(good, completed)) / duration_s, 4),
        ttft_ms=summarize_ms([r.ttft for r in completed if r.ttft is not None]),
        itl_ms=summarize_ms([gap for r in completed for gap in r.itls]),
        e2e_ms=summarize_ms([r.e2e for r in completed if r.e2e is not None]),
        # Over every structured request: a failed one counts as invalid.
        valid_fraction=round(sum(r.valid is True for r in records) / num_structured, 4)
        if num_structured
        else None,
        errors=[r.error for r in records if r.error][:5],
    )


def format_summary(result: BenchResult) -> str:
    """The result as an aligned table, vLLM style."""
    rows: list[tuple[str, Any]] = [
        ("Mode", result.mode),
        ("Prompts (completed / failed)", f"{result.completed} / {result.failed}"),
        ("Duration (s)", result.duration_s),
        ("Request throughput (req/s)", result.request_throughput),
        ("Output token throughput (tok/s)", result.output_throughput),
        ("Total token throughput (tok/s)", result.total_token_throughput),
        ("Goodput (req/s)", result.goodput),
    ]
    if result.valid_fraction is not None:
        rows.append(("Valid outputs (fraction)", result.valid_fraction))
    for name, summary in (("TTFT", result.ttft_ms), ("ITL", result.itl_ms)):
        if summary is not None:
            rows.append((f"{name} mean / p50 / p90 / p99 (ms)", _quad(summary)))
    if result.e2e_ms is not None:
        rows.append(("E2E mean / p50 / p90 / p99 (ms)", _quad(result.e2e_ms)))
    width = max(len(name) for name, _ in rows)
    bar = "=" * (width + 24)
    lines = [bar, f"{' agentrt bench ' + result.mode + ' ':=^{width + 24}}", bar]
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    lines += [f"error: {e}" for e in result.errors[:3]]
    return "\n".join([*lines, bar])


def _quad(s: LatencySummary) -> str:
    return f"{s.mean:.2f} / {s.p50:.2f} / {s.p90:.2f} / {s.p99:.2f}"
