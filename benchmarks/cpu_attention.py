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

With --against REV: this checkout's kernel against REV's (its cpu_attention.c and headers,
built alike), on one layer of a --tokens prefill (fp32 cache, blocks of 16) at real models'
heads, or with --decode of one token decoded after --tokens - 1. The two kernels' calls
alternate; each is measured in the process's CPU time (all threads), the median of the
rounds. Reported: ms per layer each, the ratio REV / this, and whether the outputs are
bitwise equal.

    python benchmarks/cpu_attention.py [--dtype bfloat16|float32] [--threads N]
    python benchmarks/cpu_attention.py --against dda3c9a [--tokens 512] [--rounds 7]
    python benchmarks/cpu_attention.py --against HEAD --decode --tokens 160
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from agentrt.engine.records import ScheduledChunk
from agentrt.engine.worker.attention import get_attention_backend
from agentrt.engine.worker.model_runner import attention_metadata, prepare_input
from agentrt.kernels.cpu_attention import SOURCE, CpuAttention
from agentrt.kernels.cpu_build import build_library

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


# (query heads, KV heads, head_dim, sliding window) of the models benchmarks/gguf.py runs.
MODEL_SHAPES = {
    "smollm2-135m": (9, 3, 64, None),
    "llama-3.2-1b": (32, 8, 64, None),
    "qwen2.5-0.5b": (14, 2, 64, None),
    "qwen2.5-1.5b": (12, 2, 128, None),
    "qwen3-0.6b": (16, 8, 128, None),
    "phi3.5-mini": (32, 32, 96, None),
    "gemma3-1b": (4, 1, 256, 512),
}


def kernel_at(rev: str, build_dir: Path) -> CpuAttention:
    """The CPU attention kernel of git revision `rev` (its source and the headers beside it),
    built in `build_dir`."""

    def git(*args: str) -> bytes:
        return subprocess.run(
            ["git", *args], cwd=SOURCE.parent, capture_output=True, check=True
        ).stdout

    names = git("ls-tree", "--name-only", rev).decode().split()  # kernels/'s, as ./ paths
    for name in [SOURCE.name] + [n for n in names if n.endswith(".h")]:
        (build_dir / name).write_bytes(git("show", f"{rev}:./{name}"))
    return CpuAttention(build_library(build_dir / SOURCE.name, build_dir / "build"))


def cpu_ms(kernel: CpuAttention, args: tuple, out, window, calls: int = 1) -> float:
    """ms of the process's CPU per call of kernel.paged_attention(*args, out, window), over
    `calls` calls (the clock may tick in ms: make them ~0.2 s)."""
    start = time.process_time()
    for _ in range(calls):
        kernel.paged_attention(*args, out, window)
    return (time.process_time() - start) * 1e3 / calls


def compare_kernels(rev: str, tokens: int, rounds: int, decode: bool = False) -> dict:
    """ms of CPU per prefill layer (`decode`: per decode of the last of `tokens`), REV's
    kernel vs this checkout's, alternated."""
    with tempfile.TemporaryDirectory() as tmp:
        kernels = {
            rev: kernel_at(rev, Path(tmp)),
            "this": CpuAttention(build_library(SOURCE, Path(tmp) / "this")),
        }
        blocks = -(-tokens // BLOCK)
        queries = 1 if decode else tokens
        starts = torch.tensor([0, queries], dtype=torch.int32)
        seq_lens = torch.tensor([tokens], dtype=torch.int32)
        table = torch.randperm(blocks, dtype=torch.int32)[None]
        result = {}
        for model, (heads, kv_heads, dim, window) in MODEL_SHAPES.items():
            torch.manual_seed(0)
            query = torch.randn(queries, heads, dim)
            cache = torch.randn(blocks, 2, BLOCK, kv_heads, dim)
            outs = {name: torch.empty_like(query) for name in kernels}
            args = (query, cache, starts, seq_lens, table, dim**-0.5)
            calls = max(1, int(200 / max(cpu_ms(kernels["this"], args, outs["this"], window), 0.1)))
            times: dict[str, list[float]] = {name: [] for name in kernels}
            for r in range(rounds):
                for name in list(kernels)[:: 1 if r % 2 else -1]:
                    times[name].append(cpu_ms(kernels[name], args, outs[name], window, calls))
            ms = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
            same = torch.equal(outs[rev], outs["this"])
            ratio = ms[rev] / ms["this"]
            print(
                f"{model:14s} {rev} {ms[rev]:7.2f} ms  this {ms['this']:7.2f} ms  {ratio:5.2f}x"
                f"  {'bit-identical' if same else 'outputs differ'}"
            )
            result[model] = {"base_ms": round(ms[rev], 3), "ms": round(ms["this"], 3)}
            result[model] |= {"ratio": round(ratio, 3), "bit_identical": same}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seconds", type=float, default=2.0, help="per backend and step")
    parser.add_argument("--against", metavar="REV", help="compare the kernel with REV's")
    parser.add_argument("--tokens", type=int, default=512, help="tokens (--against)")
    parser.add_argument("--rounds", type=int, default=7, help="alternated rounds (--against)")
    parser.add_argument(
        "--decode", action="store_true", help="--against: a decode after --tokens - 1"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.against:
        result = compare_kernels(args.against, args.tokens, args.rounds, args.decode)
        figures = {"threads": torch.get_num_threads(), "tokens": args.tokens}
        print(json.dumps(figures | {"decode": args.decode} | result))
        return
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
