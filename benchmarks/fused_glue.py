"""One request's decode on a GGUF file: the layers one C call per step (the default for
Llama's math, and for Qwen2's qkv bias and Qwen3's q/k norms since issue 39) against the
layer-by-layer torch path (~10 Python calls a layer: what Qwen2/Qwen3 files ran before),
side by side in one run, each round a fresh process per path in turn (one path's rate moves
15-30% between runs on a shared machine), the medians and their ratio. Also whether the
two paths' greedy tokens agree (they need not: the fused path rounds the products' inputs
and outputs to bf16 where the torch path keeps fp32, so a near-tie may flip).

    AGENTRT_CACHE_DIR=/tmp/cache AGENTRT_NUM_THREADS=2 .venv/bin/python \
        benchmarks/fused_glue.py ~/.cache/agentrt-bench/gguf/qwen2.5-0.5b-v2-s0-Q4_K_M.gguf

Paths (--paths): `one-call` the default engine; `glue` the fused C glue layer by layer
(three C calls and four products a layer from Python); `layers` the model's torch path; `torch-attention` the default engine with the torch
attention backend (Gemma's sliding-window and soft-capped layers then take
worker/windowed_attention.py's torch path, as every CPU run did before the C kernel took
windows: compare it with `one-call` on a Gemma file).
The CPU model is printed first; last line: JSON with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# benchmarks/gguf.py would shadow the gguf package that the engine imports.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

DECODE_TOKENS = 128
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if "model name" in line), "?")


def worker(path: str, mode: str, threads: int, num_tokens: int) -> dict:
    import torch

    from agentrt.engine.client.llm import LLM
    from agentrt.engine.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    backend = "torch" if mode == "torch-attention" else "auto"
    llm = LLM(path, kv_cache_memory_gb=0.25, attention_backend=backend)
    model = llm.engine.runner.model
    if mode in ("glue", "layers"):
        model.cpu_decoder = None
    if mode == "layers":
        model.cpu_ops = None
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    prompt = llm.tokenizer.encode(PROMPT)
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
    start, cpu = time.perf_counter(), time.process_time()
    out = llm.generate([prompt], params)[0]
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {
        "decode_tok_s": 1 / out.metrics.time_per_output_token,
        "e2e_tok_s": num_tokens / wall,
        # CPU time of the request (all threads): less moved by other load than the wall time
        "cpu_ms_per_token": 1e3 * cpu / num_tokens,
        "token_ids": out.outputs[0].token_ids,
        "one_call": model.cpu_decoder is not None,
        "fused_glue": model.cpu_ops is not None,
    }


def run(path: str, mode: str, threads: int, num_tokens: int) -> dict:
    cmd = [sys.executable, __file__, path, "--worker", mode, "--threads", str(threads)]
    cmd += ["--tokens", str(num_tokens)]
    for _ in range(2):
        done = subprocess.run(cmd, capture_output=True, text=True)
        lines = done.stdout.strip().splitlines()
        if lines and lines[-1].startswith("{"):  # measured (even if the exit then failed)
            if done.returncode:
                print(f"{mode} worker exited {done.returncode} after its result", flush=True)
            return json.loads(lines[-1])
        print(f"{mode} worker failed ({done.returncode}):\n{done.stderr[-3000:]}", flush=True)
    raise RuntimeError(f"the {mode} worker failed twice")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file")
    parser.add_argument("--paths", default="layers,one-call")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=int(os.environ.get("AGENTRT_NUM_THREADS", 2))
    )
    parser.add_argument("--tokens", type=int, default=DECODE_TOKENS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.file, args.worker, args.threads, args.tokens)))
        return
    modes = args.paths.split(",")
    print(f"CPU: {cpu_model()}, {args.threads} threads; {os.path.basename(args.file)}")
    results: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes:
            res = run(args.file, mode, args.threads, args.tokens)
            results[mode].append(res)
            print(
                f"round {r + 1} {mode:9s} {res['decode_tok_s']:6.2f} tok/s decode, "
                f"{res['cpu_ms_per_token']:6.1f} CPU ms/token",
                flush=True,
            )
    medians = {m: statistics.median(x["decode_tok_s"] for x in results[m]) for m in modes}
    cpu_ms = {m: statistics.median(x["cpu_ms_per_token"] for x in results[m]) for m in modes}
    base = medians[modes[0]]
    for mode in modes:
        ids = [x["token_ids"] for x in results[mode]]
        same = all(i == ids[0] for i in ids)
        first = results[modes[0]][0]["token_ids"]
        agree = next(
            (i for i, (a, b) in enumerate(zip(first, ids[0], strict=True)) if a != b), len(first)
        )
        print(
            f"{mode:9s} median {medians[mode]:6.2f} tok/s  x{medians[mode] / base:.2f}, "
            f"{cpu_ms[mode]:6.1f} CPU ms/token  x{cpu_ms[modes[0]] / cpu_ms[mode]:.2f}  "
            f"greedy: same every round {same}, equal to {modes[0]}'s for {agree} tokens"
        )
        ratios = [
            x["decode_tok_s"] / y["decode_tok_s"]
            for x, y in zip(results[mode], results[modes[0]], strict=True)
        ]
        listed = ", ".join(f"{r:.2f}" for r in ratios)
        print(f"{'':9s} per-round ratios {listed}; median {statistics.median(ratios):.2f}")
    summary = {
        m: {"median_tok_s": medians[m], "median_cpu_ms": cpu_ms[m], "rounds": results[m]}
        for m in modes
    }
    print(json.dumps({"cpu": cpu_model(), "file": args.file, "paths": summary}))


if __name__ == "__main__":
    main()
