"""`agentrt bench`: every mode on the embedded model, with figures that add up.

The in-process modes share one engine (`run_benchmark_async(..., engine=...)`); the command
line is checked once end to end (latency, --result-json) and once against a real
`agentrt serve` subprocess.
"""

from __future__ import annotations

import json
import time

import anyio
import pytest

from agentrt.bench import (
    BenchConfigError,
    DatasetConfig,
    LoadConfig,
    make_requests,
    run_benchmark_async,
)
from agentrt.bench.results import is_valid
from agentrt.cli import main
from tests.agentrt.server.helpers import ServerProcess

# The embedded model as users run it (its Q4_1 blocks): these tests check figures, not
# numbers, and its decode steps cost about a tenth of dense fp32's.
ENGINE = ["--kv-cache-memory-gb", "0.1"]
TINY = ["--num-prompts", "4", "--input-len", "32", "--output-len", "8", "--no-progress"]


def small(name: str = "random", output_len: int = 8) -> DatasetConfig:
    return DatasetConfig(name=name, num_prompts=4, input_len=32, output_len=output_len)


@pytest.fixture(scope="module")
def results(smollm2_dir) -> dict:
    """Each in-process mode, run on one engine: (result, the wall time around the run)."""
    from agentrt.engine.client.async_engine import AsyncEngine

    async def run() -> dict:
        out = {}

        async def timed(name: str, *args, **kwargs) -> None:
            start = time.perf_counter()
            result = await run_benchmark_async(*args, engine=engine, **kwargs)
            out[name] = result, time.perf_counter() - start

        async with AsyncEngine(kv_cache_memory_gb=0.1) as engine:
            await timed("throughput", "throughput", small("shared-prefix"))
            await timed(
                "rate",
                "throughput",
                small(),
                LoadConfig(request_rate=50.0, max_concurrency=2, goodput_e2e_ms=1e-3),
            )
            for dataset in ("extraction", "tool-calls"):
                await timed(dataset, "structured", small(dataset, output_len=64))
        return out

    return anyio.run(run)


def check_consistent(result: dict, wall_s: float, output_tokens: int | None = None) -> None:
    """The figures against measures of their own: the run lies within the wall time the
    test measured around it and lasts at least its slowest request (that request's own
    timings); with `output_tokens` known (ignore_eos), the token count is that."""
    assert result["completed"] + result["failed"] == result["num_prompts"]
    assert result["failed"] == 0, result["errors"]
    duration = result["duration_s"]
    slowest_s = result["e2e_ms"]["p99"] / 1000  # nearest rank: the maximum of a few
    assert slowest_s * 0.99 <= duration <= wall_s, (slowest_s, duration, wall_s)
    if result["mode"] == "latency":  # one request after another: their times add up
        serial_s = result["e2e_ms"]["mean"] * result["completed"] / 1000
        assert serial_s * 0.99 <= duration, (serial_s, duration)
    if output_tokens is not None:
        assert result["total_output_tokens"] == output_tokens
    # A rate is a count over a time between the slowest request and the wall time.
    for key, count in (
        ("output_throughput", result["total_output_tokens"]),
        ("request_throughput", result["num_prompts"]),
        ("total_token_throughput", result["total_input_tokens"] + result["total_output_tokens"]),
    ):
        assert count / wall_s * 0.99 <= result[key] <= count / slowest_s * 1.01, key
    assert result["total_token_throughput"] > result["output_throughput"]  # prompts count
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        summary = result[key]
        if summary is not None:
            assert 0 <= summary["p50"] <= summary["p90"] <= summary["p99"], key
    assert 0 <= result["goodput"] <= result["request_throughput"] + 1e-9
    if result["valid_fraction"] is not None:
        assert 0.0 <= result["valid_fraction"] <= 1.0


@pytest.mark.slow
def test_throughput_counts_and_rates_add_up(results) -> None:
    bench, wall_s = results["throughput"]
    result = bench.to_dict()
    check_consistent(result, wall_s, output_tokens=4 * 8)  # ignore_eos: output_len each
    assert result["ttft_ms"] is not None and result["itl_ms"] is not None
    assert result["ttft_ms"]["p99"] <= result["e2e_ms"]["p99"]
    assert result["valid_fraction"] is None
    json.loads(bench.to_json())  # strict JSON (no Infinity)


def test_request_rate_concurrency_and_goodput_bound(results) -> None:
    bench, wall_s = results["rate"]
    result = bench.to_dict()
    check_consistent(result, wall_s, output_tokens=4 * 8)
    assert result["config"]["load"]["max_concurrency"] == 2
    assert result["goodput"] == 0.0  # no request ends within 1 microsecond


@pytest.mark.parametrize("dataset", ["extraction", "tool-calls"])
def test_structured_outputs_are_valid(results, dataset) -> None:
    bench, wall_s = results[dataset]
    result = bench.to_dict()
    check_consistent(result, wall_s)
    assert result["valid_fraction"] == 1.0
    assert result["goodput"] == result["request_throughput"]


def test_datasets_are_deterministic_and_carry_schemas() -> None:
    for name in ("random", "shared-prefix", "extraction", "tool-calls"):
        config = DatasetConfig(name=name, num_prompts=6, input_len=64, seed=3)
        assert make_requests(config) == make_requests(config)
        assert make_requests(config) != make_requests(DatasetConfig(name=name, num_prompts=6))
    shared = make_requests(DatasetConfig(name="shared-prefix", num_prompts=3))
    assert len({r.messages[0]["content"] for r in shared}) == 1  # one system prompt
    for request in make_requests(DatasetConfig(name="extraction", num_prompts=8)):
        assert request.schema is not None and request.schema_name
    assert is_valid(
        '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}',
        make_requests(DatasetConfig(name="tool-calls", num_prompts=1))[0].schema,
    )


def test_cli_latency_writes_result_json(smollm2_dir, tmp_path, capsys) -> None:
    path = tmp_path / "latency.json"
    argv = ["bench", "latency", *ENGINE, *TINY, "--num-iters", "3", "--num-iters-warmup", "1"]
    start = time.perf_counter()
    assert main([*argv, "--result-json", str(path)]) == 0
    wall_s = time.perf_counter() - start
    assert "agentrt bench latency" in capsys.readouterr().out
    result = json.loads(path.read_text())
    check_consistent(result, wall_s, output_tokens=3 * 8)
    assert result["mode"] == "latency" and result["num_prompts"] == 3
    assert result["config"]["engine_args"]["kv_cache_memory_gb"] == 0.1


def test_cli_serve_against_a_server(smollm2_dir, tmp_path) -> None:
    path = tmp_path / "serve.json"
    with ServerProcess(*ENGINE, "--api-key", "k") as server:
        argv = ["bench", "serve", "--base-url", server.url, "--api-key", "k", *TINY]
        start = time.perf_counter()
        assert main([*argv, "--request-rate", "20", "--result-json", str(path)]) == 0
        wall_s = time.perf_counter() - start
    result = json.loads(path.read_text())
    check_consistent(result, wall_s, output_tokens=4 * 8)
    assert result["ttft_ms"] is not None and result["itl_ms"] is not None
    assert result["config"]["endpoint"]["model"] == "SmolLM2-135M-Instruct"


def test_bad_options_are_clear_errors(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "throughput", "--dataset", "nope"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err
    assert main(["bench", "throughput", "--request-rate", "0", *TINY]) == 2
    assert "request_rate=0.0 is invalid" in capsys.readouterr().err
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", *TINY]) == 2
    assert "cannot reach" in capsys.readouterr().err
    with pytest.raises(BenchConfigError, match="structured dataset"):
        anyio.run(lambda: run_benchmark_async("structured", small("random")))
    with pytest.raises(BenchConfigError, match="num_prompts=0"):
        DatasetConfig(num_prompts=0)
