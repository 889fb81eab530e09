"""`agentrt bench throughput | latency | serve | structured` (vLLM's `vllm bench`): the flags
of `run_benchmark`, a printed summary and `--result-json`."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from agentrt.bench.datasets import DATASETS, DatasetConfig
from agentrt.bench.http import Endpoint
from agentrt.bench.load import LoadConfig
from agentrt.bench.runner import run_benchmark
from agentrt.bench.tune import MIN_GAIN
from agentrt.engine.args import EngineArgs

HELP = {
    "throughput": "every prompt through an in-process engine: requests/s, tokens/s",
    "latency": "one request at a time: end-to-end latency percentiles",
    "serve": "a running OpenAI-compatible server over HTTP: TTFT, ITL, E2E percentiles",
    "structured": "throughput on JSON-schema requests: validity and goodput",
}


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    """The `bench` command's modes, each with its flags."""
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
    run = add_workload_args(parser, mode)
    if mode == "latency":
        run.add_argument("--num-iters", type=int, default=10, help="measured requests")
        run.add_argument("--num-iters-warmup", type=int, default=2, help="unmeasured, first")
    run.add_argument("--goodput-e2e-ms", type=float, default=None, help="goodput: E2E bound")
    run.add_argument("--goodput-ttft-ms", type=float, default=None, help="goodput: TTFT bound")
    out = parser.add_argument_group("output")
    out.add_argument("--result-json", default=None, help="write the result here as JSON")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_workload_args(parser: argparse.ArgumentParser, mode: str):
    """The dataset's flags and how requests arrive (`bench` and `tune` share them); returns
    the "load" argument group."""
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
    return run


def dataset_from_args(args: argparse.Namespace, seed: int) -> DatasetConfig:
    return DatasetConfig(
        name=args.dataset,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        seed=seed,
        schema_dir=args.schema_dir,
    )


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark the flags describe, print its summary, write --result-json."""
    from agentrt.bench.results import format_summary

    mode = args.bench_mode
    engine_args = None if mode == "serve" else EngineArgs.from_cli_args(args)
    dataset = dataset_from_args(args, args.seed if engine_args is None else engine_args.seed)
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


# -- agentrt tune ---------------------------------------------------------------------------

DEFAULT_SPACE = {
    "max_num_seqs": (16, 128),
    "max_num_batched_tokens": (512, 2048),
    "speculative": ("off", "suffix"),
}


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(","))


def _switches(text: str) -> tuple[bool, ...]:
    values = {"on": True, "true": True, "off": False, "false": False}
    try:
        return tuple(values[v.strip().lower()] for v in text.split(","))
    except KeyError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected on/off values") from None


def add_tune_args(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser, "structured")
    search = parser.add_argument_group(
        "search space (comma-separated values; with none of these given: "
        + "; ".join(f"{k} {','.join(map(str, v))}" for k, v in DEFAULT_SPACE.items())
        + ")"
    )
    search.add_argument("--max-num-seqs-list", type=_ints, default=None, metavar="N,N,...")
    search.add_argument(
        "--max-num-batched-tokens-list", type=_ints, default=None, metavar="N,N,..."
    )
    search.add_argument(
        "--long-prefill-token-threshold-list",
        type=_ints,
        default=None,
        metavar="N,N,...",
        help="caps on one request's prefill chunk while others run (0: none)",
    )
    search.add_argument("--block-size-list", type=_ints, default=None, metavar="N,N,...")
    search.add_argument(
        "--speculative-list",
        type=_names,
        default=None,
        help="off or a method with options after ':', e.g. "
        "off,suffix,ngram:num_speculative_tokens=4,suffix:disable_by_batch_size=0",
    )
    search.add_argument("--jump-forward-list", type=_switches, default=None, help="on,off")
    goal = parser.add_argument_group("goal")
    bound = goal.add_mutually_exclusive_group(required=True)
    bound.add_argument("--max-p99-e2e-ms", type=float, help="P99 end-to-end latency bound")
    bound.add_argument("--max-p99-ttft-ms", type=float, help="P99 time-to-first-token bound")
    goal.add_argument(
        "--screen-prompts",
        type=int,
        default=None,
        help="first round: this many requests per configuration (default: num-prompts / 4)",
    )
    goal.add_argument("--keep", type=int, default=3, help="configurations in the final round")
    goal.add_argument(
        "--min-gain",
        type=float,
        default=MIN_GAIN,
        help="the goodput gain over the baseline a configuration needs to be chosen "
        f"(default {MIN_GAIN}: {MIN_GAIN * 100:g}%%)",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--output", default="tuned.json", help="the chosen configuration (JSON)")
    out.add_argument("--result-json", default=None, help="every run's figures (JSON)")
    out.add_argument("--plot", default=None, help="latency vs goodput chart (needs matplotlib)")
    EngineArgs.add_cli_args(parser.add_argument_group("engine (the baseline configuration)"))


def run_tune(args: argparse.Namespace) -> int:
    """Search, print the table, write --output (and --result-json, --plot)."""
    import json
    import sys

    from agentrt.bench.tune import SearchSpace, tune
    from agentrt.bench.tune_report import config_file, format_table, plot

    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("error: --plot needs matplotlib: pip install 'agentrt[plot]'", file=sys.stderr)
            return 2
    base = EngineArgs.from_cli_args(args)
    lists = {
        "max_num_seqs": args.max_num_seqs_list,
        "max_num_batched_tokens": args.max_num_batched_tokens_list,
        "long_prefill_token_threshold": args.long_prefill_token_threshold_list,
        "block_size": args.block_size_list,
        "speculative": args.speculative_list,
        "jump_forward": args.jump_forward_list,
    }
    space = SearchSpace(**(lists if any(lists.values()) else DEFAULT_SPACE))
    dataset = dataset_from_args(args, base.seed)
    load = LoadConfig(
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        temperature=args.temperature,
    )
    bound_on = "e2e" if args.max_p99_e2e_ms is not None else "ttft"

    def report(trial, round_name, result) -> None:
        print(
            f"[{round_name}] {trial.label}: goodput {result.goodput:.3f}/s, "
            f"{result.completed}/{result.num_prompts} completed",
            file=sys.stderr,
        )

    result = tune(
        base,
        space,
        dataset,
        load,
        bound_ms=args.max_p99_e2e_ms or args.max_p99_ttft_ms,
        bound_on=bound_on,
        screen_prompts=args.screen_prompts or max(1, dataset.num_prompts // 4),
        keep=args.keep,
        min_gain=args.min_gain,
        on_trial=report,
    )
    print(format_table(result))
    if args.result_json:
        trials = [
            {
                "configuration": t.label,
                "changes": {k: str(v) for k, v in t.changes.items()},
                "status": t.status,
                "screen": t.screen.to_dict() if t.screen else None,
                "final": t.final.to_dict() if t.final else None,
            }
            for t in result.trials
        ]
        Path(args.result_json).write_text(json.dumps(trials, indent=1) + "\n")
    if args.plot:
        plot(result, args.plot)
    if result.best is None:
        print("error: no configuration met the bound; nothing written", file=sys.stderr)
        return 1
    Path(args.output).write_text(json.dumps(config_file(result, dataset), indent=1) + "\n")
    print(f"wrote {args.output}: agentrt serve --config {args.output}")
    return 0
