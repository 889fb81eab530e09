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
3. Tensor parallelism: TP=3 vs TP=1 (the embedded model's 9 query / 3 KV heads divide by 3
   only) at batch 1 and 16, in turns; and a paper estimate of TP=8 for an 8B model on one
   NVLink GPU node, where each rank has its own device and memory bandwidth.

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

from agentrt.engine.client.async_engine import AsyncEngine
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
    """TP=3 vs TP=1 output tokens/s on the embedded model (9 query / 3 KV heads: 3 is the only
    size above 1 that divides them), fp32, greedy, one request and a batch of 16. Both engines
    stay loaded and take turns. On this machine the 3 ranks share 2 cores with one thread each
    and meet 2 all-reduces per layer (60 per step) over gloo: TP pays for itself only where
    each rank has its own device. Also a paper estimate of that case."""
    from agentrt.engine.client.llm import LLM

    engines = {
        n: LLM(None, dtype="float32", kv_cache_memory_gb=0.25, tensor_parallel_size=n)
        for n in (1, 3)
    }
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    figures: dict = {}
    try:
        for batch in (1, 16):
            runs: dict[int, list[float]] = {1: [], 3: []}
            for _ in range(args.repeats):
                for n, llm in engines.items():
                    llm.engine.reset_prefix_cache()
                    start = time.perf_counter()
                    outs = llm.generate(prompts(batch), params)
                    num_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                    runs[n].append(num_tokens / (time.perf_counter() - start))
            tp1, tp3 = statistics.median(runs[1]), statistics.median(runs[3])
            print(
                f"batch {batch:2d}: TP=1 {tp1:7.1f} tok/s, TP=3 {tp3:7.1f} tok/s -> x{tp3 / tp1:.2f}"
            )
            figures[f"batch{batch}"] = {
                "tp1_tok_s": round(tp1, 1),
                "tp3_tok_s": round(tp3, 1),
                "tp3_over_tp1": round(tp3 / tp1, 3),
            }
    finally:
        for llm in engines.values():
            llm.engine.shutdown()
    figures["gpu_node_estimate"] = gpu_node_estimate()
    return figures


def gpu_node_estimate(
    num_params: float = 8e9, hidden: int = 4096, num_layers: int = 32, tp: int = 8
) -> dict:
    """A paper estimate for an 8B Llama at TP=8 on one NVLink node (H100/H200 class): decode
    of one token reads the weights once (bf16: 2 bytes each, split over the ranks, at ~3 TB/s
    per GPU) and does 2 all-reduces per layer of `hidden` bf16 values (NCCL on NVLink: ~10 us
    each at this size, latency-bound). Batch 1 decode step, ms: the TP speedup is bounded by
    the all-reduce time, which does not shrink with more ranks."""
    read_ms = num_params * 2 / 3e12 * 1e3  # one GPU reads every weight
    allreduce_ms = 2 * num_layers * 10e-3
    step_tp = read_ms / tp + allreduce_ms
    return {
        "model": f"{num_params / 1e9:.0f}B, hidden {hidden}, {num_layers} layers",
        "tp": tp,
        "tp1_step_ms": round(read_ms, 2),
        "tp_step_ms": round(step_tp, 2),
        "speedup": round(read_ms / step_tp, 2),
        "allreduce_share": round(allreduce_ms / step_tp, 2),
    }


async def main_async(args) -> dict:
    result = {"cpus": len(os.sched_getaffinity(0)), "max_tokens": args.max_tokens}
    if "client" in args.only:
        result["client_overhead"] = await client_overhead(args)
    if "dp" in args.only:
        result["data_parallel"] = await data_parallel(args)
    if "tp" in args.only:
        result["tensor_parallel"] = tensor_parallel_figures(args)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="rounds of paired runs")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--dp-batch", type=int, default=64, help="concurrent requests for DP")
    parser.add_argument("--only", default="client,dp,tp", help="client, dp, tp (comma-separated)")
    parser.add_argument("--quick", action="store_true", help="2 rounds, 16 tokens, DP batch 16")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.max_tokens, args.dp_batch = 2, 16, 16
    args.only = set(args.only.split(","))
    result = anyio.run(main_async, args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
