"""`agentrt bench throughput | latency | serve | structured` (vLLM's `vllm bench`): the flags
of `run_benchmark`, a printed summary and `--result-json`."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from agentrt.bench.datasets import DATASETS, DatasetConfig
from agentrt.bench.runner import Endpoint, LoadConfig, run_benchmark
from agentrt.engine.args import EngineArgs

HELP = {
    "throughput": "every prompt through an in-process engine: requests/s, tokens/s",
    "latency": "one request at a time: end-to-end latency percentiles",
    "serve": "a running OpenAI-compatible server over HTTP: TTFT, ITL, E2E percentiles",
    "structured": "throughput on JSON-schema requests: validity and goodput",
}


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    """The `bench` command's modes, each with its flags."""
    from agentrt.engine.args import EngineArgs

    modes = parser.add_subparsers(dest="bench_mode", required=True)
    for mode, help_text in HELP.items():
        sub = modes.add_parser(mode, help=help_text, description=help_text)
        _add_common_args(sub, mode)
        if mode == "serve":
            target = sub.add_argument_group("endpoint")
            target.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
            target.add_argument("--api-key", default=None)
            target.add_argument("--model", default=None, help="default: the server's first")
            target.add_argument("--seed", type=int, default=0, help="dataset and arrivals")
        else:  # the engine's --seed also seeds the dataset and the arrivals
            EngineArgs.add_cli_args(sub.add_argument_group("engine"))


def _add_common_args(parser: argparse.ArgumentParser, mode: str) -> None:
    workload = parser.add_argument_group("workload")
    default_dataset = "extraction" if mode == "structured" else "random"
    workload.add_argument(
        "--dataset", choices=DATASETS, default=default_dataset, help="(default: %(default)s)"
    )
    workload.add_argument("--num-prompts", type=int, default=100 if mode != "latency" else 1)
    workload.add_argument("--input-len", type=int, default=256, help="prompt tokens, about")
    workload.add_argument("--output-len", type=int, default=128, help="output tokens (a cap)")
    workload.add_argument(
        "--schema-dir", default=None, help="extraction: maskbench-style JSON schema files"
    )
    run = parser.add_argument_group("load")
    run.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s with Poisson arrivals (default: inf, all at once)",
    )
    run.add_argument("--max-concurrency", type=int, default=None, help="requests in flight")
    run.add_argument("--temperature", type=float, default=0.0)
    if mode == "latency":
        run.add_argument("--num-iters", type=int, default=10, help="measured requests")
        run.add_argument("--num-iters-warmup", type=int, default=2, help="unmeasured, first")
    run.add_argument("--goodput-e2e-ms", type=float, default=None, help="goodput: E2E bound")
    run.add_argument("--goodput-ttft-ms", type=float, default=None, help="goodput: TTFT bound")
    out = parser.add_argument_group("output")
    out.add_argument("--result-json", default=None, help="write the result here as JSON")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark the flags describe, print its summary, write --result-json."""
    from agentrt.bench.results import format_summary

    mode = args.bench_mode
    engine_args = None if mode == "serve" else EngineArgs.from_cli_args(args)
    dataset = DatasetConfig(
        name=args.dataset,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        seed=args.seed if engine_args is None else engine_args.seed,
        schema_dir=args.schema_dir,
    )
    iters = {n: getattr(args, n) for n in ("num_iters", "num_iters_warmup") if hasattr(args, n)}
    load = LoadConfig(
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        **iters,
        temperature=args.temperature,
        goodput_e2e_ms=args.goodput_e2e_ms,
        goodput_ttft_ms=args.goodput_ttft_ms,
        progress=not args.no_progress,
    )
    if mode == "serve":
        endpoint = Endpoint(args.base_url, api_key=args.api_key, model=args.model)
        result = run_benchmark(mode, dataset, load, endpoint=endpoint)
    else:
        result = run_benchmark(mode, dataset, load, engine_args=engine_args)
    print(format_summary(result))
    if args.result_json:
        Path(args.result_json).write_text(result.to_json() + "\n")
    return 0 if result.failed == 0 else 1
