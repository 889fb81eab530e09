"""A cold burst on one shared system prompt: C agent requests at once (serving_vs_llama.py's
agent prompt, ~1,100 tokens on the embedded model), with and without the scheduler's wait for
prefix blocks a running request computes (issue 41). The baseline is the same scheduler with
the wait switched off (`KVCacheManager.next_block_hash` answering None: no request ever waits,
each is admitted on the blocks scheduled so far and computes the rest itself).

Prints per round and side: prompt tokens computed, process CPU seconds, first-token CPU
seconds (p50, max) and cached tokens per request; then the medians, the CPU ratio, and
whether the greedy outputs are identical on both sides. CPU time, not wall time: the figure
holds on a loaded machine (run with AGENTRT_NUM_THREADS=1 for the cleanest CPU count).

    .venv/bin/python benchmarks/shared_prefix_burst.py --concurrency 8 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from serving_vs_llama import AGENT_TASKS, agent_system_prompt

from agentrt.engine.client.llm import LLM
from agentrt.engine.core.kv_cache_manager import KVCacheManager
from agentrt.engine.sampling_params import SamplingParams

WAIT = KVCacheManager.next_block_hash


def run_burst(llm: LLM, prompts: list[list[int]], wait: bool, tag: str) -> dict:
    """Every prompt at once from a cold cache; the burst's figures. Prompt tokens computed:
    each request's prompt less what it found cached at admission (no preemption here: the
    pool holds every request)."""
    engine = llm.engine
    KVCacheManager.next_block_hash = WAIT if wait else (lambda self, request, num_cached: None)
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=16)
    arrival, first, outputs = {}, {}, {}
    start = time.process_time()
    for i, ids in enumerate(prompts):
        engine.add_request(engine.processor.process(f"{tag}-{i}", ids, params), None)
        arrival[f"{tag}-{i}"] = time.process_time()
    try:
        while engine.has_unfinished_requests():
            for delta in engine.step():
                if delta.token_ids and delta.request_id not in first:
                    first[delta.request_id] = time.process_time()
                if delta.finished:
                    outputs[delta.request_id] = delta.output
    finally:
        KVCacheManager.next_block_hash = WAIT
    cpu_s = time.process_time() - start
    ttfts = sorted(first[r] - arrival[r] for r in arrival)
    cached = [outputs[r].num_cached_tokens for r in arrival]
    return {
        "computed": sum(len(p) for p in prompts) - sum(cached),
        "cpu_s": round(cpu_s, 3),
        "ttft_p50": round(statistics.median(ttfts), 3),
        "ttft_max": round(ttfts[-1], 3),
        "cached": cached,
        "tokens": [list(outputs[r].outputs[0].token_ids) for r in arrival],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="a GGUF file or checkpoint (default: embedded)"
    )
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="alternating, wait on / off")
    args = parser.parse_args()
    llm = LLM(args.model, kv_cache_memory_gb=1.0)
    system = agent_system_prompt()
    prompts = [
        llm.engine.processor.chat_token_ids(
            [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Ticket {1000 + i}: {AGENT_TASKS[i % 10]}"},
            ],
            add_generation_prompt=True,
        )
        for i in range(args.concurrency)
    ]
    print(f"{args.concurrency} requests of {len(prompts[0])} prompt tokens; load {os.getloadavg()}")
    sides: dict[bool, list[dict]] = {True: [], False: []}
    for round_ in range(args.rounds):
        for wait in (True, False) if round_ % 2 == 0 else (False, True):
            figures = run_burst(llm, prompts, wait, f"r{round_}{'w' if wait else 'n'}")
            sides[wait].append(figures)
            print(
                f"round {round_} {'wait' if wait else 'no wait (baseline)'}:"
                f" {figures['computed']} prompt tokens computed, {figures['cpu_s']:.2f} CPU s,"
                f" first token p50 {figures['ttft_p50']:.2f} max {figures['ttft_max']:.2f} CPU s,"
                f" cached {figures['cached']}, load {os.getloadavg()[0]:.1f}",
                flush=True,
            )

    def median(wait: bool, key: str) -> float:
        return statistics.median(f[key] for f in sides[wait])

    identical = all(a["tokens"] == b["tokens"] for a in sides[True] for b in sides[False])
    print(
        f"medians, wait vs baseline: {median(True, 'computed'):.0f} vs"
        f" {median(False, 'computed'):.0f} prompt tokens, {median(True, 'cpu_s'):.2f} vs"
        f" {median(False, 'cpu_s'):.2f} CPU s"
        f" ({median(False, 'cpu_s') / median(True, 'cpu_s'):.2f}x), first token p50"
        f" {median(True, 'ttft_p50'):.2f} vs {median(False, 'ttft_p50'):.2f} CPU s;"
        f" greedy outputs identical: {identical}"
    )


if __name__ == "__main__":
    main()
