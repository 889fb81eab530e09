"""Benchmarks of the engine and the server (`agentrt bench`), callable in-process:

    from agentrt.bench import DatasetConfig, LoadConfig, run_benchmark
    result = run_benchmark("throughput", DatasetConfig(num_prompts=64), engine_args=EngineArgs())

`run_benchmark(mode, dataset, load, engine_args=... | endpoint=...) -> BenchResult` is the
core; `agentrt bench` (cli.py) is a thin command line over it.
"""

from agentrt.bench.datasets import DATASETS, BenchRequest, DatasetConfig, make_requests
from agentrt.bench.errors import BenchConfigError
from agentrt.bench.http import Endpoint
from agentrt.bench.load import LoadConfig
from agentrt.bench.results import BenchResult, LatencySummary, RequestRecord
from agentrt.bench.runner import MODES, run_benchmark, run_benchmark_async

__all__ = [
    "DATASETS",
    "MODES",
    "BenchConfigError",
    "BenchRequest",
    "BenchResult",
    "DatasetConfig",
    "Endpoint",
    "LatencySummary",
    "LoadConfig",
    "RequestRecord",
    "make_requests",
    "run_benchmark",
    "run_benchmark_async",
]
