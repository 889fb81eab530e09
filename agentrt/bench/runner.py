"""The benchmark core: `run_benchmark(mode, dataset, load, engine_args=... | endpoint=...)`
returns a `BenchResult`. `agentrt bench` is a thin command line over it, and `agentrt tune`
calls it in-process.

Modes:
- `throughput`: every request through one `AsyncEngine` in this process (all at once by
  default, else at `request_rate` / `max_concurrency`), streamed.
- `latency`: one request at a time, `num_iters` of them after `num_iters_warmup`.
- `structured`: `throughput` on a structured dataset (`extraction` by default), scoring
  validity against each request's JSON schema.
- `serve`: the requests over HTTP to a running OpenAI-compatible server (`http.py`).

In-process, TTFT and E2E come from the engine's per-request metrics (`RequestMetrics`: arrival,
first token, finish); ITL is the gap between successive token chunks of a stream.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import anyio

from agentrt.bench.datasets import BenchRequest, DatasetConfig, make_requests
from agentrt.bench.errors import BenchConfigError
from agentrt.bench.http import Endpoint, run_http
from agentrt.bench.load import LoadConfig, drive
from agentrt.bench.results import BenchResult, RequestRecord, build_result, is_valid
from agentrt.engine.args import EngineArgs

MODES = ("throughput", "latency", "serve", "structured")


def run_benchmark(
    mode: str,
    dataset: DatasetConfig,
    load: LoadConfig | None = None,
    *,
    engine_args: EngineArgs | None = None,
    endpoint: Endpoint | None = None,
) -> BenchResult:
    """Run one benchmark to the end (synchronous wrapper of `run_benchmark_async`)."""
    return anyio.run(
        lambda: run_benchmark_async(mode, dataset, load, engine_args=engine_args, endpoint=endpoint)
    )


async def run_benchmark_async(
    mode: str,
    dataset: DatasetConfig,
    load: LoadConfig | None = None,
    *,
    engine_args: EngineArgs | None = None,
    endpoint: Endpoint | None = None,
    engine: Any = None,
) -> BenchResult:
    """Run one benchmark. In-process modes build an engine from `engine_args` (or run on a
    started `AsyncEngine` passed as `engine`, which stays open); `serve` needs `endpoint`."""
    load = load or LoadConfig()
    if mode not in MODES:
        raise BenchConfigError(f"mode {mode!r} is unknown: expected one of {', '.join(MODES)}.")
    if mode == "serve":
        if endpoint is None:
            raise BenchConfigError("mode 'serve' needs an endpoint (--base-url).")
        target = {"base_url": _without_userinfo(endpoint.base_url), "model": endpoint.model}
        return await run_http(
            endpoint, dataset, load, _config(mode, dataset, load, endpoint=target)
        )
    if mode == "structured" and not dataset.structured:
        raise BenchConfigError(
            f"mode 'structured' needs a structured dataset (extraction or tool-calls), got "
            f"{dataset.name!r}."
        )
    if engine is not None:
        config = _config(mode, dataset, load, engine_args=public_options(engine.args))
        return await _run_inprocess(engine, mode, dataset, load, config)
    from agentrt.engine.client.async_engine import AsyncEngine

    engine_args = engine_args or EngineArgs()
    options = {k: v for k, v in dataclasses.asdict(engine_args).items() if k != "model"}
    async with AsyncEngine(engine_args.model, **options) as started:
        config = _config(mode, dataset, load, engine_args=public_options(engine_args))
        return await _run_inprocess(started, mode, dataset, load, config)


def public_options(args: EngineArgs) -> dict:
    """`args` as a dict without its secrets (the fields kept out of its repr: kv_secret):
    result files are shared, pasted into issues and checked in."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.repr}


def _without_userinfo(url: str) -> str:
    """`url` without a `user:password@` part."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


def _config(mode: str, dataset: DatasetConfig, load: LoadConfig, **target: dict) -> dict:
    """The result's `config`: the mode, the dataset, the load and the engine or endpoint."""
    plain = (int, float, str, bool, type(None))
    return {
        "mode": mode,
        "dataset": dataclasses.asdict(dataset),
        # JSON has no infinity: an unbounded rate is written "inf", as vLLM does.
        "load": {k: "inf" if v == math.inf else v for k, v in dataclasses.asdict(load).items()},
        **{
            name: {k: v if isinstance(v, plain) else str(v) for k, v in values.items()}
            for name, values in target.items()
        },
    }


async def _run_inprocess(
    engine, mode: str, dataset: DatasetConfig, load: LoadConfig, config: dict
) -> BenchResult:
    if mode == "latency":
        total = load.num_iters_warmup + load.num_iters
        requests = make_requests(dataclasses.replace(dataset, num_prompts=total))
        for request in requests[: load.num_iters_warmup]:
            await _send_inprocess(engine, request, load)
        requests = requests[load.num_iters_warmup :]
        load = dataclasses.replace(load, request_rate=math.inf, max_concurrency=1)
    else:
        requests = make_requests(dataset)
    cap = engine.config.scheduler.max_num_seqs * engine.config.parallel.data_parallel_size
    cap += engine.max_waiting_requests  # past it the engine refuses new requests
    load = dataclasses.replace(load, max_concurrency=min(load.max_concurrency or cap, cap))
    records, duration = await drive(
        requests, load, lambda request: _send_inprocess(engine, request, load), dataset.seed
    )
    return build_result(
        mode,
        config,
        records,
        duration,
        goodput_e2e_ms=load.goodput_e2e_ms,
        goodput_ttft_ms=load.goodput_ttft_ms,
    )


async def _send_inprocess(engine, request: BenchRequest, load: LoadConfig) -> RequestRecord:
    from agentrt.engine.errors import EngineError
    from agentrt.engine.sampling_params import SamplingParams, StructuredOutputsParams

    record = RequestRecord(valid=False if request.schema is not None else None)
    try:
        params = SamplingParams(
            temperature=load.temperature,
            max_tokens=request.max_tokens,
            ignore_eos=request.ignore_eos,
            structured_outputs=StructuredOutputsParams(json=request.schema)
            if request.schema is not None
            else None,
        )
        last = None
        output = None
        async with engine.add_request(request.prompt, params, messages=request.messages) as stream:
            async for delta in stream:
                if delta.token_ids:
                    now = time.monotonic()
                    if last is not None:
                        record.itls.append(now - last)
                    last = now
                output = delta.output or output
    except EngineError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    completion = output.outputs[0]
    if completion.finish_reason not in ("stop", "length"):
        record.error = output.error or f"finish_reason {completion.finish_reason}"
        return record
    metrics = output.metrics
    record.ok = True
    record.prompt_tokens = len(output.prompt_token_ids)
    record.output_tokens = len(completion.token_ids)
    record.ttft = metrics.time_to_first_token
    record.e2e = metrics.finished_time - metrics.arrival_time
    if request.schema is not None:
        record.valid = is_valid(completion.text, request.schema)
    return record
