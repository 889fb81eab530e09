"""Scale-out figures on this machine, side by side in one run.

1. Engine-core client overhead: the same greedy decode through `AsyncEngine` with the core on
   a thread of this process (in-process) and in its own process (`engine_process=True`), at
   batch 1 and batch 32 on the embedded model. Reports the time per engine step (wall time /
   output tokens per request), the multi-process overhead (target: under 5%), and how late the
   front end's event loop wakes a 10 ms sleeper during the batch-32 decode (the wait an HTTP
   server's requests see while the engine shares, or does not share, its process). Both
   engines stay loaded and take turns, so each pair of runs sees the same load of a shared
   machine; the overhead is the median of the paired ratios.
2. Data parallelism: `data_parallel_size=2` (two core processes, each with half the CPU
   threads) vs one core process with all of them, on a batch of concurrent requests:
   output tokens/s and their ratio. On a 2-core CPU the replicas share the cores a single
   engine already uses, so no gain is expected here: DP pays off with one accelerator (or
   socket) per replica.
3. Tensor parallelism: `tensor_parallel_figures` below is the place for TP=2 vs TP=1 figures;
   it reports nothing yet.

    python benchmarks/scale.py            # 5 rounds; a few minutes on 2 cores
    python benchmarks/scale.py --quick    # 1 repeat, shorter requests

Last line: a JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import anyio

from agentrt.engine.async_engine import AsyncEngine
from agentrt.engine.sampling_params import SamplingParams

FILLER = "The report lists owners, deadlines and risks for every part of the roadmap. "


def prompts(n: int) -> list[str]:
    """Distinct prompts of about 40 tokens (no shared prefix beyond the first words)."""
    return [f"Request {i}: summarize this. " + FILLER * 2 for i in range(n)]


async def decode(
    engine: AsyncEngine, batch: int, max_tokens: int, lag_s: list[float] | None = None
) -> tuple[float, int]:
    """Run `batch` requests at once to `max_tokens` each; (seconds, output tokens). With
    `lag_s`, a task meanwhile sleeps 10 ms at a time and records how late the event loop
    wakes it (what an HTTP front end on that loop would wait)."""
    await engine.reset_prefix_cache()  # every repeat prefills its prompts
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    done = anyio.Event()

    async def probe() -> None:
        while not done.is_set():
            start = time.perf_counter()
            await anyio.sleep(0.01)
            lag_s.append(time.perf_counter() - start - 0.01)

    async with anyio.create_task_group() as tg:
        if lag_s is not None:
            tg.start_soon(probe)
        start = time.perf_counter()
        streams = [engine.add_request(p, params) for p in prompts(batch)]
        outputs = [await s.result() for s in streams]
        elapsed = time.perf_counter() - start
        done.set()
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert num_tokens == batch * max_tokens
    return elapsed, num_tokens


async def paired(engines: dict, measure, repeats: int) -> dict[object, list[float]]:
    """`measure(engine)` on every engine in turn, `repeats` times, the order rotating each
    round; all engines stay loaded (an idle one costs nothing), so every round compares
    them under the same load of a shared machine."""
    results: dict[object, list[float]] = {key: [] for key in engines}
    keys = list(engines)
    for round_ in range(repeats):
        for key in keys[round_ % len(keys) :] + keys[: round_ % len(keys)]:
            results[key].append(await measure(engines[key]))
    return results


async def client_overhead(args) -> dict:
    """Step time at batch 1 and 32, in-process vs engine process, measured in turns."""
    options = {"kv_cache_memory_gb": 0.5}
    figures: dict = {}
    async with (
        AsyncEngine(None, engine_process=False, **options) as inproc,
        AsyncEngine(None, engine_process=True, **options) as process,
    ):
        engines = {False: inproc, True: process}
        for engine in engines.values():
            await decode(engine, 1, 8)  # warm-up
        for batch in (1, 32):
            lag_s: dict[AsyncEngine, list[float]] = {inproc: [], process: []}

            async def step_time(engine: AsyncEngine, batch: int = batch, lag_s=lag_s) -> float:
                lag = lag_s[engine] if batch == 32 else None
                elapsed, _ = await decode(engine, batch, args.max_tokens, lag)
                return elapsed / args.max_tokens

            step_s = await paired(engines, step_time, args.repeats)
            ratios = [p / i for p, i in zip(step_s[True], step_s[False], strict=True)]
            inproc_s, process_s = statistics.median(step_s[False]), statistics.median(step_s[True])
            overhead = statistics.median(ratios) - 1
            figures[f"batch_{batch}"] = {
                "in_process_step_ms": round(inproc_s * 1000, 2),
                "engine_process_step_ms": round(process_s * 1000, 2),
                "in_process_tok_s": round(batch / inproc_s, 1),
                "engine_process_tok_s": round(batch / process_s, 1),
                "overhead": round(overhead, 4),  # median of the paired ratios, minus 1
            }
            print(
                f"batch {batch:>2}: step {inproc_s * 1000:7.2f} ms in-process, "
                f"{process_s * 1000:7.2f} ms engine process -> overhead {overhead:+.1%} "
                "(median of paired runs)"
            )
        for engine_process, engine in engines.items():
            name = "engine_process" if engine_process else "in_process"
            lags = sorted(lag_s[engine])
            p50, p99 = lags[len(lags) // 2], lags[min(len(lags) - 1, int(len(lags) * 0.99))]
            figures[f"{name}_loop_lag_ms"] = {
                "p50": round(p50 * 1000, 2),
                "p99": round(p99 * 1000, 2),
            }
            print(
                f"event-loop lag at batch 32, {name}: p50 {p50 * 1000:.2f} ms, p99 {p99 * 1000:.2f} ms"
            )
    return figures


async def data_parallel(args) -> dict:
    """Output tokens/s of one batch of concurrent requests: DP=1 vs DP=2 (core processes),
    measured in turns."""
    options = {"engine_process": True, "kv_cache_memory_gb": 0.5}
    async with (
        AsyncEngine(None, data_parallel_size=1, **options) as dp1,
        AsyncEngine(None, data_parallel_size=2, **options) as dp2,
    ):
        engines = {1: dp1, 2: dp2}
        for engine in engines.values():
            await decode(engine, 2, 8)  # warm-up (both replicas with DP=2)

        async def tok_s(engine: AsyncEngine) -> float:
            elapsed, num_tokens = await decode(engine, args.dp_batch, args.max_tokens)
            return num_tokens / elapsed

        results = await paired(engines, tok_s, args.repeats)
    one, two = statistics.median(results[1]), statistics.median(results[2])
    ratio = statistics.median([b / a for a, b in zip(results[1], results[2], strict=True)])
    print(f"DP=1 {one:7.1f} tok/s, DP=2 {two:7.1f} tok/s -> x{ratio:.2f} (median of paired runs)")
    return {
        "batch": args.dp_batch,
        "dp1_tok_s": round(one, 1),
        "dp2_tok_s": round(two, 1),
        "dp2_over_dp1": round(ratio, 3),
    }


def tensor_parallel_figures(args) -> dict:
    """TENSOR PARALLELISM: TP=2 vs TP=1 (tokens/s, step time, all-reduce share) goes here,
    measured by whoever owns tensor parallelism; reported as an empty object until then."""
    return {}


async def main_async(args) -> dict:
    result = {"cpus": len(os.sched_getaffinity(0)), "max_tokens": args.max_tokens}
    if "client" in args.only:
        result["client_overhead"] = await client_overhead(args)
    if "dp" in args.only:
        result["data_parallel"] = await data_parallel(args)
    result["tensor_parallel"] = tensor_parallel_figures(args)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="rounds of paired runs")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--dp-batch", type=int, default=64, help="concurrent requests for DP")
    parser.add_argument("--only", default="client,dp", help="client, dp (comma-separated)")
    parser.add_argument("--quick", action="store_true", help="2 rounds, 16 tokens, DP batch 16")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.max_tokens, args.dp_batch = 2, 16, 16
    args.only = set(args.only.split(","))
    result = anyio.run(main_async, args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
