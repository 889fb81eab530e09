"""KV blocks a request holds with sliding-window layers, every layer keeping its history
(one block table: before) vs KV cache groups that free blocks behind the window (after),
side by side in one run. No weights: the KV cache manager and the runner's block size on
the shape of Gemma 3 1B (26 layers, a global one every 6th, 1 KV head of 256, window 512,
bf16), blocks of 16.

One request: a 4,096-token prompt prefilled in chunks of 512, then decoded to 4,352
tokens. Prints the blocks it holds and their bytes in its first decode step, the most
during the run (a prefill chunk's: a sliding group holds the window and the chunk), how many such requests a 2 GiB pool holds, and the manager's time per decode step of
64 requests at 4k context (median of alternating rounds), with the machine's load.
Last line: a JSON object with the figures.

    python -m benchmarks.sliding_window_kv    (benchmarks/gguf.py shadows the gguf package
                                               when the script's folder is on the path)
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import time

import torch

from agentrt.engine.core.kv_cache_groups import kv_cache_layout
from agentrt.engine.core.kv_cache_manager import KVCacheManager
from agentrt.engine.core.request import Request
from agentrt.engine.model.arch import FULL_ATTENTION, SLIDING_ATTENTION, ModelArchConfig
from agentrt.engine.sampling_params import SamplingParams
from agentrt.engine.worker.model_runner import kv_block_bytes

BLOCK_SIZE = 16
CONTEXT = 4096
CHUNK = 512
POOL_BYTES = 2 << 30
NUM_DECODES = 64


def gemma3_1b(sliding: bool) -> ModelArchConfig:
    """Gemma 3 1B's KV shape; `sliding=False` is the same model with every layer kept whole
    (one block table: what the cache did before KV cache groups)."""
    types = tuple(FULL_ATTENTION if i % 6 == 5 else SLIDING_ATTENTION for i in range(26))
    base = ModelArchConfig(
        "Gemma3ForCausalLM", 262144, 1152, 6912, 26, 4, 1, 256, 1e-6, 1e6, None, 32768,
        True, False, True, (1,),
    )  # fmt: skip
    if not sliding:
        return base
    return dataclasses.replace(base, layer_types=types, sliding_window=512)


def manager(arch: ModelArchConfig, num_blocks: int) -> KVCacheManager:
    windows = kv_cache_layout(arch).sliding_windows
    return KVCacheManager(num_blocks, BLOCK_SIZE, sliding_windows=windows)


def new_request(req_id: str, num_tokens: int) -> Request:
    prompt = [(7 * i + len(req_id)) % 30000 for i in range(num_tokens)]
    params = SamplingParams(max_tokens=1024, ignore_eos=True)
    return Request(req_id, prompt, params, max_tokens=1024, eos_token_ids=frozenset())


def prefill(kv: KVCacheManager, req: Request) -> int:
    """The request's prompt in CHUNK-token chunks; returns the most blocks it held."""
    most = 0
    while req.num_computed_tokens < req.num_tokens:
        num_new = min(CHUNK, req.num_tokens - req.num_computed_tokens)
        assert kv.allocate_slots(req, num_new) is not None
        req.num_computed_tokens += num_new
        most = max(most, kv.num_held_blocks(req.req_id))
    return most


def one_request(arch: ModelArchConfig) -> dict:
    """Blocks held decoding at CONTEXT tokens and the most held (the prefill's chunks)."""
    kv = manager(arch, 4096)
    req = new_request("a", CONTEXT)
    most = prefill(kv, req)
    at_context = None
    for step in range(256):
        req.append_output_token(step)
        assert kv.allocate_slots(req, 1) is not None
        if req.num_computed_tokens == CONTEXT:
            at_context = kv.num_held_blocks("a")
        req.num_computed_tokens += 1
        most = max(most, kv.num_held_blocks("a"))
    kv.check_invariants()
    block_bytes = kv_block_bytes(arch, BLOCK_SIZE, torch.bfloat16)
    pool_blocks = POOL_BYTES // block_bytes
    return {
        "blocks_at_4k": at_context,
        "most_blocks": most,
        "block_kib": block_bytes / 1024,
        "mib_at_4k": at_context * block_bytes / 2**20,
        "requests_in_2gib": pool_blocks // most,
    }


def decode_step_seconds(arch: ModelArchConfig, rounds: int) -> list[float]:
    """The manager's allocate_slots for one decode step of NUM_DECODES requests at 4k."""
    kv = manager(arch, 700 * NUM_DECODES)
    requests = [new_request(f"r{i}", CONTEXT) for i in range(NUM_DECODES)]
    for req in requests:
        prefill(kv, req)
    times = []
    for step in range(rounds):
        start = time.perf_counter()
        for req in requests:
            req.append_output_token(step)
            assert kv.allocate_slots(req, 1) is not None
            req.num_computed_tokens += 1
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    cpu = platform.processor() or platform.machine()
    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    before, after = one_request(gemma3_1b(False)), one_request(gemma3_1b(True))
    print(f"CPU: {cpu}; load {os.getloadavg()[0]:.2f}")
    print(f"Gemma 3 1B shape, window 512, blocks of {BLOCK_SIZE}, bf16; one request")
    print(f"{'':28}{'before':>12}{'after':>12}{'after/before':>14}")
    for key, label in (
        ("blocks_at_4k", "blocks held decoding at 4k"),
        ("block_kib", "KiB per block"),
        ("mib_at_4k", "MiB held decoding at 4k"),
        ("most_blocks", "most blocks (prefill chunk)"),
        ("requests_in_2gib", "such requests in 2 GiB"),
    ):
        ratio = after[key] / before[key]
        print(f"{label:28}{before[key]:>12.1f}{after[key]:>12.1f}{ratio:>13.2f}x")
    full, hybrid = [], []
    for _ in range(5):  # alternate rounds: the machine is shared
        full += decode_step_seconds(gemma3_1b(False), 20)
        hybrid += decode_step_seconds(gemma3_1b(True), 20)
    full_us, hybrid_us = statistics.median(full) * 1e6, statistics.median(hybrid) * 1e6
    print(
        f"manager time per decode step of {NUM_DECODES} requests at 4k: one table "
        f"{full_us:.0f} us, 7 groups {hybrid_us:.0f} us ({hybrid_us / full_us:.2f}x)"
    )
    figures = {"before": before, "after": after, "step_us": [full_us, hybrid_us], "cpu": cpu}
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
