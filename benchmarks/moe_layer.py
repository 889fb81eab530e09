"""One sparse MoE layer on the fused CPU path: the one-call C kernel (kernels/ggml_experts.c:
router, the chosen experts' products and the glue in one call) against engine/model/moe.py's
per-expert path (torch routing and glue, one product call per expert and projection), side
by side in one process, rounds alternating, and the ratio of the medians.

The shape is Qwen3-30B-A3B's layer (benchmarks/gguf_models.py's qwen3-moe-48e): hidden
2048, 48 experts of 768, top 8, Q4_K gate_up and Q6_K down in the kernels' layout (16 rows
interleaved on AVX-512), random valid blocks. `--layers` of them rotate, so the experts'
bytes stream from memory as in a model (4 layers: ~590 MiB). Both paths give the same bits
for the same routing (tests/kernels/test_ggml_experts.py); the kernel routes with its own
fp32 router sums, so the check printed is the largest difference over a round's outputs,
relative to their largest value.

    .venv/bin/python benchmarks/moe_layer.py --tokens 1 --threads 1

CPU time is the steadier figure on a shared machine (wall time counts waiting for a core);
the 1-minute load average is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.kernels.ggml_helpers

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from agentrt.engine import envs  # noqa: E402
from agentrt.engine.model.ggml_linear import GGMLLinear  # noqa: E402
from agentrt.engine.model.moe import SparseMoE  # noqa: E402
from agentrt.kernels import load_cpu_ops  # noqa: E402
from agentrt.kernels.ggml_linear import GGMLType, default_kernels, interleave  # noqa: E402
from tests.kernels.ggml_helpers import random_weight  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 48, 8


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if "model name" in line), "?")


def layer(seed: int) -> SparseMoE:
    moe = SparseMoE(HIDDEN, INTER, EXPERTS, TOP_K, True, F.silu)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        moe.gate.weight.copy_(torch.randn(EXPERTS, HIDDEN, generator=g) * 0.05)

    def layout(w):
        return interleave(w) if default_kernels().interleaves(w.qtype) else w

    for e, expert in enumerate(moe.experts):
        up = random_weight(GGMLType.Q4_K, 2 * INTER, HIDDEN, seed * 1000 + e, 0.002)
        down = random_weight(GGMLType.Q6_K, HIDDEN, INTER, seed * 1000 + 500 + e, 0.002)
        expert.gate_up_proj = GGMLLinear([layout(up)])
        expert.down_proj = GGMLLinear([layout(down)])
    return moe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1, help="tokens a step (1: a decode)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--calls", type=int, default=100, help="layer calls a round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = load_cpu_ops(envs.cache_dir() / "kernels")
    layers = [layer(s) for s in range(args.layers)]
    g = torch.Generator().manual_seed(100)
    xs = [torch.randn(args.tokens, HIDDEN, generator=g).bfloat16() for _ in range(32)]
    paths = {
        "per-expert": lambda gate_up: ops.silu_mul(gate_up),  # a Python callable: moe.py
        "one-call": ops.silu_mul,  # the fused glue's own function: the C kernel
    }
    print(f"CPU: {cpu_model()}, {args.threads} threads; {args.tokens} tokens a step")

    def run(gated) -> tuple[float, float, list[torch.Tensor]]:
        outs = []
        start, cpu = time.perf_counter(), time.process_time()
        for i in range(args.calls):
            outs.append(layers[i % args.layers](xs[i % len(xs)], gated=gated))
        calls = args.calls
        return (time.perf_counter() - start) / calls, (time.process_time() - cpu) / calls, outs

    times: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
    with torch.inference_mode():
        for gated in paths.values():
            run(gated)  # warm-up (and the kernel's build)
        for _ in range(args.rounds):
            outs = {}
            for name, gated in paths.items():
                wall, cpu, outs[name] = run(gated)
                times[name].append((wall, cpu))
        diff = max(
            ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
            for a, b in zip(outs["one-call"], outs["per-expert"], strict=True)
        )
    summary = {}
    for name, figures in times.items():
        wall = statistics.median(w for w, _ in figures) * 1e6
        cpu = statistics.median(c for _, c in figures) * 1e6
        summary[name] = {"wall_us": round(wall), "cpu_us": round(cpu)}
        print(f"{name:10s}  wall {wall:8.0f} us  cpu {cpu:8.0f} us  a layer (medians)")
    base, new = summary["per-expert"], summary["one-call"]
    ratio_wall, ratio_cpu = base["wall_us"] / new["wall_us"], base["cpu_us"] / new["cpu_us"]
    load = os.getloadavg()[0]
    print(f"one-call vs per-expert: {ratio_wall:.2f}x wall, {ratio_cpu:.2f}x CPU time")
    print(f"largest output difference (own router): {diff:.2e} of the largest value")
    print(f"1-min load {load:.1f}")
    record = {"cpu": cpu_model(), "threads": args.threads, "tokens": args.tokens, "load": load}
    print(json.dumps(record | {"paths": summary, "ratio_cpu": ratio_cpu, "max_rel_diff": diff}))


if __name__ == "__main__":
    main()
