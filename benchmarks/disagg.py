"""Disaggregated prefill/decode and the storage connector, measured on this machine.

1. Mixed load, colocated vs disaggregated. Decoding requests stream tokens while long
   prompts arrive; we report the long prompts' time to first token (TTFT) and the decoding
   requests' inter-token latency (ITL, p50 and p99). Colocated: one `agentrt serve` with every
   thread. Disaggregated: a producer (`--kv-connector p2p --kv-role producer`) and a consumer
   (`--kv-role consumer`) with half the threads each, behind `agentrt proxy`; every request
   goes through the proxy (prefill on the producer, KV fetched, decode on the consumer).
   What disaggregation buys is ITL: the consumer never runs a long prefill, so its decodes are
   not stalled by one. On 2 cores the two instances share the cores one instance had, so
   TTFT pays for it; with a GPU per instance each side keeps its own compute.
2. Restoring a 4,000-token session from the storage connector (blocks saved by another
   engine) vs recomputing its prefill: time to first token, and whether the first tokens
   after it are the same (greedy, fp32).

    python benchmarks/disagg.py            # about 3 minutes on 2 cores
    python benchmarks/disagg.py --quick    # fewer, shorter requests

Last line: a JSON object with every figure.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import anyio
import httpx

from agentrt.engine.client.llm import LLM
from agentrt.engine.loader.checkpoint import resolve_model
from agentrt.engine.loader.tokenizer import load_tokenizer
from agentrt.engine.sampling_params import SamplingParams

FILLER = (
    "The quarterly report lists owners, deadlines, budgets and open risks for every part of "
    "the roadmap, and the appendix repeats the figures by region and by month. "
)
INSTANCE = ["--served-model-name", "bench", "--dtype", "float32", "--kv-cache-memory-gb", "0.5"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


SECRET = secrets.token_hex(16)


@contextmanager
def process(command: str, *args: str, threads: int | None = None):
    """`python -m agentrt <command>` on a free port; yields its URL once /health answers."""
    port = free_port()
    env = dict(os.environ)
    # The KV secret the p2p instances share, in the environment (not in the process list).
    env.setdefault("AGENTRT_KV_SECRET", SECRET)
    if threads is not None:
        env.update(AGENTRT_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentrt", command, "--port", str(port), *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"agentrt {command} exited: {proc.stderr.read().decode()}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"agentrt {command} did not start")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


async def stream(http: httpx.AsyncClient, prompt: str, max_tokens: int) -> list[float]:
    """One streamed greedy completion; the arrival time of each chunk with text."""
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    times = []
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                times.append(time.perf_counter())
    return times


async def mixed_load(url: str, num_decodes: int, long_prompts: list[str], gap_s: float) -> dict:
    """`num_decodes` streams of 96 tokens start at once; the long prompts arrive one every
    `gap_s` seconds after the first second. TTFT of the long prompts, ITL of the decodes."""
    itls: list[float] = []
    ttfts: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:

        async def decode(i: int) -> None:
            times = await stream(http, f"Decode request {i}: " + FILLER, 96)
            itls.extend(b - a for a, b in itertools.pairwise(times))

        async def long(i: int, prompt: str) -> None:
            await anyio.sleep(1.0 + i * gap_s)
            start = time.perf_counter()
            times = await stream(http, prompt, 8)
            ttfts.append(times[0] - start)

        async with anyio.create_task_group() as tg:
            for i in range(num_decodes):
                tg.start_soon(decode, i)
            for i, prompt in enumerate(long_prompts):
                tg.start_soon(long, i, prompt)
    itls.sort()
    return {
        "ttft_s_mean": statistics.mean(ttfts),
        "ttft_s_max": max(ttfts),
        "itl_ms_p50": 1000 * itls[len(itls) // 2],
        "itl_ms_p99": 1000 * itls[min(len(itls) - 1, int(len(itls) * 0.99))],
    }


def run_mixed(num_decodes: int, long_prompts: list[str], gap_s: float) -> dict:
    threads = os.cpu_count() or 2
    with process("serve", *INSTANCE, threads=threads) as url:
        colocated = anyio.run(mixed_load, url, num_decodes, long_prompts, gap_s)
    with ExitStack() as stack:
        half = max(1, threads // 2)
        p2p = [*INSTANCE, "--kv-connector", "p2p"]
        producer = stack.enter_context(
            process("serve", *p2p, "--kv-role", "producer", threads=half)
        )
        consumer = stack.enter_context(
            process("serve", *p2p, "--kv-role", "consumer", threads=half)
        )
        proxy = stack.enter_context(process("proxy", "--prefill", producer, "--decode", consumer))
        disagg = anyio.run(mixed_load, proxy, num_decodes, long_prompts, gap_s)
        loaded = httpx.get(consumer + "/metrics").text
    fetched = [
        float(line.split()[-1])
        for line in loaded.splitlines()
        if line.startswith("agentrt:kv_transfer_num_loaded_tokens_total")
    ]
    return {"colocated": colocated, "disaggregated": disagg, "tokens_fetched": sum(fetched)}


def run_restore(num_tokens: int, repeats: int) -> dict:
    """TTFT of a `num_tokens` session: loaded from storage vs computed."""
    options = {"dtype": "float32", "kv_cache_memory_gb": 0.5}
    tokenizer = load_tokenizer(resolve_model(None))
    ids = tokenizer.encode(FILLER * (num_tokens // 30 + 1))[:num_tokens]
    first = SamplingParams(temperature=0, max_tokens=1)
    more = SamplingParams(temperature=0, max_tokens=16)
    with tempfile.TemporaryDirectory() as path:
        saver = LLM(None, **options, kv_connector="storage", kv_storage_path=path)
        saver.generate(ids, first)
        saver.engine.shutdown()  # every block written
        stored_mb = sum(f.stat().st_size for f in Path(path).rglob("*.safetensors")) / 2**20
        restorer = LLM(
            None, **options, kv_connector="storage", kv_role="consumer", kv_storage_path=path
        )
        computer = LLM(None, **options)
        times: dict[str, list[float]] = {"storage": [], "recompute": []}
        for _ in range(repeats):
            for name, llm in (("storage", restorer), ("recompute", computer)):
                llm.engine.reset_prefix_cache()  # nothing from the last round
                start = time.perf_counter()
                llm.generate(ids, first)
                times[name].append(time.perf_counter() - start)
        outputs = {}
        for name, llm in (("storage", restorer), ("recompute", computer)):
            llm.engine.reset_prefix_cache()
            outputs[name] = llm.generate(ids, more)[0].outputs[0].token_ids
        loaded = restorer.engine.stats().kv_transfer
        restorer.engine.shutdown()
    storage, recompute = statistics.median(times["storage"]), statistics.median(times["recompute"])
    return {
        "num_tokens": num_tokens,
        "stored_mb": stored_mb,
        "ttft_s_storage": storage,
        "ttft_s_recompute": recompute,
        "speedup": recompute / storage,
        "tokens_loaded_per_restore": loaded.num_loaded_tokens // (repeats + 1),
        "load_failures": loaded.num_load_failures,
        "greedy_16_tokens_equal": outputs["storage"] == outputs["recompute"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter requests")
    args = parser.parse_args()
    num_long, long_len, num_decodes = (2, 600, 4) if args.quick else (3, 1500, 6)
    long_prompts = [f"Document {i}. " + FILLER * (long_len // 30) for i in range(num_long)]

    print(
        f"1. mixed load: {num_decodes} decodes of 96 tokens, {num_long} prompts of "
        f"~{long_len} tokens arriving meanwhile (cores: {os.cpu_count()})"
    )
    mixed = run_mixed(num_decodes, long_prompts, gap_s=2.0)
    print(f"{'':16}{'TTFT mean':>11}{'TTFT max':>10}{'ITL p50':>10}{'ITL p99':>10}")
    for name in ("colocated", "disaggregated"):
        m = mixed[name]
        print(
            f"{name:16}{m['ttft_s_mean']:10.2f}s{m['ttft_s_max']:9.2f}s"
            f"{m['itl_ms_p50']:8.0f}ms{m['itl_ms_p99']:8.0f}ms"
        )
    co, dis = mixed["colocated"], mixed["disaggregated"]
    mixed["itl_p99_ratio"] = co["itl_ms_p99"] / dis["itl_ms_p99"]
    mixed["ttft_ratio"] = co["ttft_s_mean"] / dis["ttft_s_mean"]
    print(
        f"disaggregated vs colocated: ITL p99 {mixed['itl_p99_ratio']:.2f}x better, TTFT "
        f"{mixed['ttft_ratio']:.2f}x ({mixed['tokens_fetched']:.0f} prompt tokens fetched "
        "from the producer)"
    )

    num_tokens = 1000 if args.quick else 4000
    print(f"\n2. restoring a {num_tokens}-token session (fp32)")
    restore = run_restore(num_tokens, repeats=1 if args.quick else 3)
    print(
        f"from storage {restore['ttft_s_storage']:.2f}s vs recomputed "
        f"{restore['ttft_s_recompute']:.2f}s: {restore['speedup']:.1f}x "
        f"({restore['stored_mb']:.0f} MB on disk; {restore['tokens_loaded_per_restore']} "
        f"tokens loaded; next 16 greedy tokens equal: {restore['greedy_16_tokens_equal']})"
    )
    print(json.dumps({"mixed_load": mixed, "restore": restore}))


if __name__ == "__main__":
    main()
