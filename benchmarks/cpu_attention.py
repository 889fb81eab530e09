"""CPU attention: the `cpu` backend (the C paged-attention kernel) vs the `torch` backend
(gathered blocks + SDPA, flash for prefills), side by side on the same steps.

One layer's attention per step, as the engine calls it (metadata built by the model
runner's own functions), at SmolLM2-135M shapes (9 query heads over 3 KV heads, head_dim
64, block 16). Steps:
- decode: 128 decodes over 300 private tokens each;
- jump-forward: 128 requests of 3 query tokens (a decode plus 2 forced) over 600 tokens;
- shared prefix: 128 decodes after the same 288-token system prompt plus 300 own tokens;
- prefill: 8 prefills of 260 tokens, each after 300 cached tokens of its own.
Reported: ms per step for each backend and the ratio torch / cpu. Last line: a JSON object.

    python benchmarks/cpu_attention.py [--dtype bfloat16|float32] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from agentrt.engine.records import ScheduledChunk
from agentrt.engine.worker.attention import get_attention_backend
from agentrt.engine.worker.model_runner import attention_metadata, prepare_input

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
CPU = torch.device("cpu")


def make_step(chunks: list[tuple[int, int, int]]):
    """chunks: (shared prefix blocks, context length, query length). Requests with a shared
    prefix reuse the same first blocks; every other block is their own."""
    next_block = 1000
    scheduled = []
    for i, (shared, context, num) in enumerate(chunks):
        blocks = list(range(shared))
        while len(blocks) * BLOCK < context + num:
            blocks.append(next_block)
            next_block += 1
        scheduled.append(ScheduledChunk(str(i), [0] * num, context, blocks, True))
    return scheduled, next_block


def bench(backend, step, num_blocks, dtype, seconds: float) -> float:
    """Mean ms of backend.forward on this step (prepare included, as the engine calls it
    once per step and forward once per layer)."""
    torch.manual_seed(0)
    cache = torch.randn(num_blocks, 2, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)
    inp = prepare_input(step, BLOCK, CPU)
    tokens = inp.input_ids.shape[0]
    q = torch.randn(tokens, HEADS, HEAD_DIM).to(dtype)
    k, v = (torch.randn(tokens, KV_HEADS, HEAD_DIM).to(dtype) for _ in range(2))

    def run():
        meta = attention_metadata(inp, BLOCK)
        backend.prepare(meta)
        return backend.forward(q, k, v, cache, meta, HEAD_DIM**-0.5)

    run()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        run()
        calls += 1
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seconds", type=float, default=2.0, help="per backend and step")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    steps = {
        "decode": [(0, 300, 1)] * 128,
        "jump-forward": [(0, 600, 3)] * 128,
        "shared prefix": [(18, 588, 1)] * 128,
        "prefill": [(0, 300, 260)] * 8,
    }
    backends = {name: get_attention_backend(name, CPU) for name in ("cpu", "torch")}
    result: dict = {"dtype": args.dtype, "threads": torch.get_num_threads()}
    for label, chunks in steps.items():
        step, num_blocks = make_step(chunks)
        ms = {name: bench(b, step, num_blocks, dtype, args.seconds) for name, b in backends.items()}
        ratio = ms["torch"] / ms["cpu"]
        print(f"{label:14s} cpu {ms['cpu']:7.2f} ms  torch {ms['torch']:7.2f} ms  {ratio:5.2f}x")
        result[label] = {"cpu_ms": round(ms["cpu"], 3), "torch_ms": round(ms["torch"], 3)}
        result[label]["ratio"] = round(ratio, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
