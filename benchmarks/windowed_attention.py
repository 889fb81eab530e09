"""Sliding-window and soft-capped attention on the CPU: the C paged kernel's window and cap
(the 'cpu' backend, what a Gemma 2/3 layer runs now) vs worker/windowed_attention.py's torch
path (what every CPU run of those layers took before, and the torch backend still does),
side by side on the same steps, in alternating rounds, medians.

One layer's attention per step, metadata built by the model runner's own functions, the
cache bf16 (the engine's CPU default for dense models; --dtype float32 for quantized ones).
Shapes:
- gemma3-local: Gemma 3 1B's sliding layer (4 query heads over 1 KV head of 256, window 512);
- gemma2-capped: Gemma 2 2B's layer (8 over 4 KV heads of 256, window 4096, scores capped
  at 50).
Steps: one decode after 4,096 tokens; 16 decodes after 2,048 each; a prefill chunk of 256
after 1,024 cached tokens. Prints ms per step and the ratio torch / C, the CPU model and the
load average beside them. Last line: a JSON object.

    python -m benchmarks.windowed_attention [--dtype float32] [--threads N] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from agentrt.engine.records import ScheduledChunk
from agentrt.engine.worker.attention import get_attention_backend
from agentrt.engine.worker.model_runner import attention_metadata, prepare_input
from agentrt.engine.worker.windowed_attention import windowed_attention

BLOCK, HEAD_DIM = 16, 256
CPU = torch.device("cpu")
# name: (query heads, KV heads, window, softcap)
SHAPES = {"gemma3-local": (4, 1, 512, None), "gemma2-capped": (8, 4, 4096, 50.0)}
STEPS = {
    "1 decode @4096": [(4096, 1)],
    "16 decodes @2048": [(2048, 1)] * 16,
    "prefill 256 @1024": [(1024, 256)],
}


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if "model name" in line), "?")


def make_step(chunks: list[tuple[int, int]]):
    """chunks: (context length, query length), each request on blocks of its own."""
    scheduled, next_block = [], 0
    for i, (context, num) in enumerate(chunks):
        count = -(-(context + num) // BLOCK)
        blocks = list(range(next_block, next_block + count))
        next_block += count
        scheduled.append(ScheduledChunk(str(i), [0] * num, context, blocks, True))
    return scheduled, next_block


def timer(shape, step, num_blocks, dtype, path: str, seconds: float):
    """A callable that runs `path` ('c' or 'torch') on this step for `seconds` and returns the
    mean ms per call (prepare included, as the engine calls it once per step)."""
    heads, kv_heads, window, softcap = shape
    torch.manual_seed(0)
    cache = torch.randn(num_blocks, 2, BLOCK, kv_heads, HEAD_DIM).to(dtype)
    inp = prepare_input(step, BLOCK, CPU)
    tokens = inp.input_ids.shape[0]
    q = torch.randn(tokens, heads, HEAD_DIM).to(dtype)
    k, v = (torch.randn(tokens, kv_heads, HEAD_DIM).to(dtype) for _ in range(2))
    backend = get_attention_backend("cpu" if path == "c" else "torch", CPU)
    scale = HEAD_DIM**-0.5

    def run():
        meta = attention_metadata(inp, BLOCK)
        backend.prepare(meta)
        if path == "c":
            return backend.forward(q, k, v, cache, meta, scale, window, softcap)
        return windowed_attention(q, k, v, cache, meta, scale, window, softcap)

    def measure() -> float:
        run()
        calls, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            run()
            calls += 1
        return (time.perf_counter() - start) / calls * 1e3

    return measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=0.5, help="per path, step and round")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(
        f"CPU: {cpu_model()} ({platform.machine()}), {torch.get_num_threads()} threads, "
        f"{args.dtype}; load before: {os.getloadavg()[0]:.1f}"
    )
    result: dict = {"cpu": cpu_model(), "dtype": args.dtype, "threads": torch.get_num_threads()}
    for name, shape in SHAPES.items():
        for label, chunks in STEPS.items():
            step, num_blocks = make_step(chunks)
            paths = {
                p: timer(shape, step, num_blocks, dtype, p, args.seconds) for p in ("c", "torch")
            }
            ms: dict[str, list[float]] = {"c": [], "torch": []}
            for _ in range(args.rounds):  # alternate, so both see the same load
                for path, measure in paths.items():
                    ms[path].append(measure())
            c, t = statistics.median(ms["c"]), statistics.median(ms["torch"])
            print(
                f"{name:14s} {label:18s} C {c:8.3f} ms  torch {t:8.3f} ms  {t / c:5.2f}x  "
                f"(load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
            result[f"{name} {label}"] = {"c_ms": round(c, 3), "torch_ms": round(t, 3)}
    result["load_after"] = os.getloadavg()[0]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
