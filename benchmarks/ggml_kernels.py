"""GGML block-type kernels (kernels/ggml_linear.py) per type and step size, side by side with
torch's int4 / int8 CPU kernels where the embedded model uses them today.

    python benchmarks/ggml_kernels.py                 # all types, T = 1, 16, 64
    python benchmarks/ggml_kernels.py --types Q4_1,Q8_0 --rows 1,16 --threads 2

Shapes: the embedded model's (SmolLM2-135M: hidden 576, FFN 1536; its projections are Q4_1,
its output projection 49152 x 576 Q8_0), run against torch's `_weight_int4pack_mm_for_cpu`
(Q4_1, the file's blocks) and `_weight_int8pack_mm` (Q8_0 requantized per channel), each
with bf16 rows in and out as the engine calls them; and TinyLlama-1.1B's projections
(hidden 2048, FFN 5632: K-quants need K % 256 == 0) for every type. Each line: type, shape,
T, us/call (best of the repeats) in the layout the engine holds (rows interleaved by 16 where
this build runs the type so), weight GB/s (the weight's bytes / time), the torch kernel's
us/call and the ratio (torch / ours, > 1 is faster), the file layout's us/call and ratio
(file / interleaved) where interleaved, and the max error relative to the largest output of
gguf's fp32 reference. Timings on a shared machine are noisy: the two
sides of a ratio run interleaved in one process. The last line is one JSON object.

    python benchmarks/ggml_kernels.py --real --baseline HEAD~1 [--isa avx2] [--threads 1]

`--real` runs the types and shapes of real Q4_K_M files instead (Qwen2.5-0.5B: Q5_0 896x896,
4864x896, 896x4864 and its tied 151936x896 Q8_0 output; Qwen2.5-1.5B: Q4_K 17920x1536
gate_up, Q6_K 151936x1536 output and 1536x8960 ffn_down; Llama-3.2-1B: Q4_K 16384x2048
gate_up, Q6_K 2048x8192 ffn_down and its tied 128256x2048 output; Qwen3-0.6B: Q4_K
4096x1024 qkv and 6144x1024 gate_up, Q6_K 1024x3072 ffn_down), one activation row (a decode
step) and 16 by default (`--rows 1,4,16,64,512`: batches and a prefill), the weights
streamed from memory as in a decode step (copies of each weight, ~`--stream-mib` MiB in all,
each called once a pass), against the same source at another git revision (`--baseline`):
the two builds' passes alternate, each in the layout its build holds the type in (rows
interleaved where it does), and the figures are medians over `--repeats` passes: GB/s of
weight read by wall time, and with one thread also by the thread's CPU time (less moved by
the other processes of a shared machine). The CPU model is printed with the figures.

    python benchmarks/ggml_kernels.py --bandwidth [--gguf FILE ...]

`--real --decode-step` runs the products of one whole Llama-3.2-1B Q4_K_M decode step (its
16 layers' type mix and its tied Q6_K output, ~810 MB) on each build, beside a plain read of
the same bytes: how far from the memory roofline a decode's products run, in all and per part
(the layers' Q4_K, their Q6_K v and down, the output), each beside the read of its bytes.

`--bandwidth` measures the memory roofline instead: the rate 1 and `--threads` threads read a
buffer of `--bandwidth-mib` MiB (far past the last-level cache); then, for each `--gguf` file,
the bytes one decoded token reads, each tensor in a buffer of its own plus agentrt's fp32 KV
cache at `--positions` (a 128-token decode after a short prompt ends near 160), read on 1 and
`--threads` threads by one team, and by a team forked per tensor as the step's products are,
the ways alternating: tokens/s and GB/s by wall time (best and median) and by CPU time a
thread (the rate with a core each). That is a bound on any engine that reads every weight
once a token, llama.cpp included (its f16 KV is half of ours, a few MB).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# benchmarks/gguf.py beside this script would shadow the gguf package.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.kernels.ggml_helpers

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from agentrt.kernels import ggml_linear as G  # noqa: E402
from agentrt.kernels.cpu_build import build_library  # noqa: E402
from agentrt.kernels.ggml_library import EXTRA_FLAGS, SOURCE  # noqa: E402
from agentrt.kernels.quantized_linear import (  # noqa: E402
    Int4Weight,
    pack_int4,
    quantize_int8,
)
from tests.kernels.ggml_helpers import random_weight  # noqa: E402

Q = gguf.GGMLQuantizationType
SMOL = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
SMOL_HEAD = {"lm_head": (49152, 576)}
TINYLLAMA = {"qkv": (2560, 2048), "o": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632)}
ALL_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def realistic_weight(qtype: int, n: int, k: int, seed: int = 0) -> G.GGMLWeight:
    """Random weights quantized by gguf-py where it can (legacy types); K-quants as random
    blocks with finite scales (gguf-py has no K-quant quantizer): the kernels' cost does not
    depend on the values."""
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0):
        rng = np.random.default_rng(seed)
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        data = gguf.quants.quantize(w, Q(qtype))
        return G.GGMLWeight(torch.from_numpy(np.ascontiguousarray(data)), int(qtype), k)
    return random_weight(qtype, n, k, seed)


def timed(fn, repeats: int) -> float:
    """Seconds of one call: the best of `repeats` (on a shared machine the best is the
    reproducible figure; the median moves with the neighbours' load)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def torch_baseline(qtype: int, weight: G.GGMLWeight, dense: torch.Tensor):
    """The torch kernel the embedded model runs for this type, as a bf16 -> bf16 callable."""
    if qtype == Q.Q4_1:
        n, k = dense.shape
        raw = weight.data.view(n, k // 32, 20)
        scale = raw[..., 0:2].contiguous().view(torch.float16).float().view(n, -1)
        mins = raw[..., 2:4].contiguous().view(torch.float16).float().view(n, -1)
        qs = raw[..., 4:]
        q = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(n, k)
        packed, sz = pack_int4(Int4Weight(q, scale, mins))
        return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz)
    if qtype == Q.Q8_0:
        q, scale = quantize_int8(dense)
        scale = scale.bfloat16()
        return lambda x: torch.ops.aten._weight_int8pack_mm(x, q, scale)
    return None


def run(types: list[str], rows_list: list[int], repeats: int, projs: set[str]) -> list[dict]:
    results = []
    cases = [(t, "smol", SMOL) for t in ("Q4_1",) if t in types]
    cases += [(t, "smol", SMOL_HEAD) for t in ("Q8_0",) if t in types]
    cases += [(t, "tinyllama", TINYLLAMA) for t in types]
    for type_name, model, shapes in cases:
        qtype = int(Q[type_name])
        for proj, (n, k) in shapes.items():
            if projs and proj not in projs:
                continue
            file_weight = realistic_weight(qtype, n, k)
            dense = G.dequantize_ref(file_weight)
            # The layout the engine holds: interleaved by 16 rows where this build runs it so.
            interleaves = G.default_kernels().interleaves(qtype) and n % G.ROWS_INTERLEAVED == 0
            weight = G.interleave(file_weight) if interleaves else file_weight
            baseline = torch_baseline(qtype, weight, dense) if model == "smol" else None
            for rows in rows_list:
                x = torch.randn(rows, k).bfloat16()
                ref = x.float() @ dense.T
                err = (G.ggml_linear(x, weight) - ref).abs().max() / ref.abs().max()
                ours = timed(lambda: G.ggml_linear_bf16(x, weight), repeats)  # noqa: B023
                theirs = timed(lambda: baseline(x), repeats) if baseline else None  # noqa: B023
                file_layout = (
                    timed(lambda: G.ggml_linear_bf16(x, file_weight), repeats)  # noqa: B023
                    if interleaves
                    else None
                )
                row = {
                    "type": type_name,
                    "model": model,
                    "proj": proj,
                    "shape": [n, k],
                    "rows": rows,
                    "us": round(ours * 1e6, 1),
                    "gb_s": round(weight.nbytes / ours / 1e9, 2),
                    "torch_us": None if theirs is None else round(theirs * 1e6, 1),
                    "ratio": None if theirs is None else round(theirs / ours, 2),
                    "interleaved": interleaves,
                    "file_layout_us": None if file_layout is None else round(file_layout * 1e6, 1),
                    "max_rel_err": float(f"{err.item():.2e}"),
                }
                results.append(row)
                torch_part = (
                    ""
                    if theirs is None
                    else f"  torch {row['torch_us']:8.1f} us  x{row['ratio']:.2f}"
                )
                if file_layout is not None:
                    torch_part += (
                        f"  file layout {row['file_layout_us']:8.1f} us  x{file_layout / ours:.2f}"
                    )
                print(
                    f"{type_name:5} {model:9} {proj:8} {n:6}x{k:<5} T={rows:<3} "
                    f"{row['us']:8.1f} us {row['gb_s']:6.2f} GB/s{torch_part}  err {err:.1e}",
                    flush=True,
                )
    return results


# (name, type, N, K): the types and shapes of real Q4_K_M files (issue 39).
REAL = (
    ("qwen0.5b o", "Q5_0", 896, 896),
    ("qwen0.5b gate_up", "Q5_0", 9728, 896),
    ("qwen0.5b down", "Q5_0", 896, 4864),
    ("qwen0.5b output", "Q8_0", 151936, 896),
    ("qwen1.5b gate_up", "Q4_K", 17920, 1536),
    ("qwen1.5b down", "Q6_K", 1536, 8960),
    ("qwen1.5b output", "Q6_K", 151936, 1536),
    ("llama1b gate_up", "Q4_K", 16384, 2048),
    ("llama1b down", "Q6_K", 2048, 8192),
    ("llama1b output", "Q6_K", 128256, 2048),
    ("qwen3 qkv", "Q4_K", 4096, 1024),
    ("qwen3 gate_up", "Q4_K", 6144, 1024),
    ("qwen3 down", "Q6_K", 1024, 3072),
)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("model name")), "")
    except OSError:
        line = ""
    return line.split(":", 1)[-1].strip() or "unknown CPU"


def baseline_kernels(rev: str, isa: str) -> G.GGMLKernels:
    """The library built from kernels/ggml_quants.c and its headers at git revision `rev`."""
    root = SOURCE.parent
    top = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--show-toplevel"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    folder = Path(tempfile.mkdtemp(prefix="ggml-baseline-"))
    for path in [SOURCE, *sorted(root.glob("*.h"))]:
        rel = path.resolve().relative_to(top)
        text = subprocess.run(
            ["git", "-C", top, "show", f"{rev}:{rel}"], capture_output=True, check=False
        )
        if text.returncode == 0:
            (folder / path.name).write_bytes(text.stdout)
    flags = G.ISAS[isa][1] + EXTRA_FLAGS
    return G.GGMLKernels(build_library(folder / SOURCE.name, folder / "build", flags), isa)


def held(weight: G.GGMLWeight, kernels: G.GGMLKernels) -> G.GGMLWeight:
    """The weight in the layout `kernels`' build holds its type in."""
    if kernels.interleaves(weight.qtype) and weight.out_features % G.ROWS_INTERLEAVED == 0:
        return G.interleave(weight, kernels)
    return weight


def compare(cases, builds, rows_list, repeats, stream_mib, threads) -> list[dict]:
    """Each case (REAL's) on each build (name -> kernels), passes alternating; medians."""
    results = []
    for name, type_name, n, k in cases:
        qtype = int(Q[type_name])
        weight = realistic_weight(qtype, n, k)
        dense = G.dequantize_ref(weight)
        copies = max(1, -(-stream_mib * 2**20 // weight.nbytes)) if stream_mib else 1
        held_by = {b: [held(weight, kern)] for b, kern in builds.items()}
        for b, kern in builds.items():  # fresh bytes per copy: each call reads from memory
            held_by[b] += [
                held(realistic_weight(qtype, n, k, seed=1 + c), kern) for c in range(copies - 1)
            ]
        for rows in rows_list:
            x = torch.randn(rows, k).bfloat16()
            ref = x.float() @ dense.T
            errs = {
                b: float(
                    (G.ggml_linear(x, held_by[b][0], kernels=kern) - ref).abs().max()
                    / ref.abs().max()
                )
                for b, kern in builds.items()
            }
            outs = {b: torch.empty(rows, n, dtype=torch.bfloat16) for b in builds}
            wall = {b: [] for b in builds}
            cpu = {b: [] for b in builds}
            for _ in range(repeats + 1):  # the first pass of each warms up, not counted
                for b, kern in builds.items():
                    t0, c0 = time.perf_counter(), time.thread_time()
                    for w in held_by[b]:
                        G.ggml_linear_bf16(x, w, outs[b], kern)
                    wall[b].append(time.perf_counter() - t0)
                    cpu[b].append(time.thread_time() - c0)
            total = weight.nbytes * copies
            row = {"case": name, "type": type_name, "shape": [n, k], "rows": rows, "copies": copies}
            parts = []
            for b in builds:
                t, c = statistics.median(wall[b][1:]), statistics.median(cpu[b][1:])
                row[b] = {
                    "us_per_call": round(t / copies * 1e6, 1),
                    "gb_s": round(total / t / 1e9, 2),
                    "cpu_gb_s": round(total / c / 1e9, 2) if threads == 1 and c > 0 else None,
                    "max_rel_err": float(f"{errs[b]:.2e}"),
                }
                cpu_part = f" (cpu {row[b]['cpu_gb_s']:6.2f})" if row[b]["cpu_gb_s"] else ""
                parts.append(
                    f"{b} {row[b]['us_per_call']:9.1f} us {row[b]['gb_s']:6.2f} GB/s"
                    f"{cpu_part} err {errs[b]:.1e}"
                )
            if len(builds) == 2:
                old, new = (row[b]["us_per_call"] for b in builds)
                row["speedup"] = round(old / new, 2)
                parts.append(f"x{row['speedup']:.2f}")
            results.append(row)
            print(
                f"{type_name:5} {name:17} {n:6}x{k:<5} T={rows:<3} " + "  ".join(parts), flush=True
            )
    return results


# The memory roofline (--bandwidth): threads read buffers far larger than the last-level cache
# with 64-byte loads into four accumulators (the loop the hardware prefetcher streams best here:
# software prefetches 1 or 4 KiB ahead measured 0-10% slower), each thread its contiguous share
# of every buffer. `per_buffer` 1 forks and joins a team for each buffer, whose threads take it
# in chunks as each is free, as a decode step's products do (ggml_quants.c's ggml_linear: at
# most ~8 a thread); 0 runs one team over all of them.
_READ_SOURCE = r"""
#include <stdint.h>
#include <omp.h>
typedef uint64_t v8 __attribute__((vector_size(64), aligned(1)));

static v8 read_range(const uint8_t *p, int64_t n) {
    v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    int64_t i = 0;
    for (; i + 256 <= n; i += 256) {
        a0 ^= *(const v8 *)(p + i);
        a1 ^= *(const v8 *)(p + i + 64);
        a2 ^= *(const v8 *)(p + i + 128);
        a3 ^= *(const v8 *)(p + i + 192);
    }
    for (; i + 64 <= n; i += 64) a0 ^= *(const v8 *)(p + i);
    return a0 ^ a1 ^ a2 ^ a3;
}

// Thread t's share of buffer i (whole lines), XORed into acc.
static v8 read_share(const uint8_t *p, int64_t bytes, v8 acc) {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t lines = bytes / 64, s = lines * t / nt * 64, e = lines * (t + 1) / nt * 64;
    return acc ^ read_range(p + s, e - s);
}

uint64_t read_set(const int64_t *ptrs, const int64_t *bytes, int64_t n, int threads,
                  int per_buffer) {
    uint64_t total = 0;
    if (per_buffer) {
        for (int64_t i = 0; i < n; i++) {
            const int64_t lines = bytes[i] / 64;
            const int64_t grab = lines / (8 * threads) > 1024 ? lines / (8 * threads) : 1024;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(^ : total)
            for (int64_t s = 0; s < lines; s += grab) {
                const int64_t e = s + grab < lines ? s + grab : lines;
                const v8 acc = read_range((const uint8_t *)ptrs[i] + 64 * s, 64 * (e - s));
                for (int j = 0; j < 8; j++) total ^= acc[j];
            }
        }
        return total;
    }
#pragma omp parallel num_threads(threads) reduction(^ : total)
    {
        v8 acc = {0};
        for (int64_t i = 0; i < n; i++) acc = read_share((const uint8_t *)ptrs[i], bytes[i], acc);
        for (int j = 0; j < 8; j++) total ^= acc[j];
    }
    return total;
}
"""


@functools.cache
def read_library():
    """The read of _READ_SOURCE, built once per process."""
    import ctypes

    folder = Path(tempfile.mkdtemp(prefix="read-bandwidth-"))
    (folder / "read_set.c").write_text(_READ_SOURCE)
    lib = ctypes.CDLL(str(build_library(folder / "read_set.c", folder / "build")))
    lib.read_set.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    lib.read_set.restype = ctypes.c_uint64
    return lib


def read_buffers(buffers: list[torch.Tensor], threads: int, per_buffer: bool = False):
    """(wall s, CPU s) of one read of every byte of `buffers` on `threads` threads: the CPU
    time of this thread with one (a team's idle thread spinning on would count in the
    process's), of the process with more."""
    import ctypes

    ptrs = (ctypes.c_int64 * len(buffers))(*(b.data_ptr() for b in buffers))
    sizes = (ctypes.c_int64 * len(buffers))(*(b.nbytes for b in buffers))
    clock = time.thread_time if threads == 1 else time.process_time
    wall, cpu = time.perf_counter(), clock()
    read_library().read_set(ptrs, sizes, len(buffers), threads, int(per_buffer))
    return time.perf_counter() - wall, clock() - cpu


def touched(nbytes: int) -> torch.Tensor:
    """A buffer of at least `nbytes` (whole 64-byte lines), every page written."""
    return torch.ones((nbytes + 63) // 64 * 8, dtype=torch.int64)


def read_bandwidth(threads: int, mib: int, repeats: int) -> tuple[float, float]:
    """(best, median) GB/s of reading `mib` MiB once on `threads` threads."""
    buf = touched(mib * 2**20)
    walls = [read_buffers([buf], threads)[0] for _ in range(repeats + 1)]
    rates = [buf.nbytes / t / 1e9 for t in walls[1:]]  # the first pass warms up
    return max(rates), statistics.median(rates)


def llama1b_step() -> list[tuple[str, int, int, str]]:
    """The products of one Llama-3.2-1B Q4_K_M decode step, in order: (type, N, K, part) of
    each layer's q+k, v, o, gate+up and down (v and down Q6_K in llama.cpp's use_more_bits
    layers, Q4_K in the others), then the tied 128,256-row Q6_K output. `part` names the
    group a step's time is broken down by: the layers' Q4_K products, their Q6_K v (512 rows)
    and down (K = 8,192), the output."""
    more = lambda i: i < 2 or i >= 14 or (i - 2) % 3 == 2  # noqa: E731
    step = []
    for i in range(16):
        big = "Q6_K" if more(i) else "Q4_K"
        v, down = ("Q6_K v", "Q6_K down") if more(i) else ("Q4_K layers",) * 2
        step += [("Q4_K", 2560, 2048, "Q4_K layers"), (big, 512, 2048, v)]
        step += [("Q4_K", 2048, 2048, "Q4_K layers"), ("Q4_K", 16384, 2048, "Q4_K layers")]
        step += [(big, 2048, 8192, down)]
    return [*step, ("Q6_K", 128256, 2048, "Q6_K output")]


def decode_step(builds, threads: int, repeats: int) -> dict:
    """A whole decode step's products (one activation row, every weight streamed from memory
    once) on each build, and a plain read of the same bytes (the roofline), alternating;
    medians of wall time (thread CPU time with one thread), of the step and of each part
    (llama1b_step's: each product or read timed on its own, summed by part), so each part's
    GB/s stands beside the read's of the same bytes."""
    shapes = llama1b_step()
    parts = [part for *_, part in shapes]
    held_by = {b: [] for b in builds}
    for seed, (type_name, n, k, _) in enumerate(shapes):
        weight = realistic_weight(int(Q[type_name]), n, k, seed=seed)
        for b, kern in builds.items():
            held_by[b].append(held(weight, kern))
    xs = {k: torch.randn(1, k).bfloat16() for k in {k for _, _, k, _ in shapes}}
    outs = [torch.empty(1, n, dtype=torch.bfloat16) for _, n, _, _ in shapes]
    clock = time.thread_time if threads == 1 else time.perf_counter

    def products(b) -> list[float]:
        times = []
        for w, out in zip(held_by[b], outs, strict=True):
            t0 = clock()
            G.ggml_linear_bf16(xs[w.in_features], w, out, builds[b])
            times.append(clock() - t0)
        return times

    def read() -> list[float]:
        times = []
        for w in next(iter(held_by.values())):
            t0 = clock()
            read_buffers([w.data], threads)
            times.append(clock() - t0)
        return times

    runs = {b: (lambda b=b: products(b)) for b in builds} | {"read": read}
    totals = {name: [] for name in runs}
    by_part = {name: {part: [] for part in dict.fromkeys(parts)} for name in runs}
    for _ in range(repeats + 1):  # the first pass of each warms up, not counted
        for name, fn in runs.items():
            times = fn()
            totals[name].append(sum(times))
            sums = dict.fromkeys(by_part[name], 0.0)
            for t, part in zip(times, parts, strict=True):
                sums[part] += t
            for part, t in sums.items():
                by_part[name][part].append(t)
    weights = next(iter(held_by.values()))
    total = sum(w.nbytes for w in weights)
    part_bytes = dict.fromkeys(parts, 0)
    for w, part in zip(weights, parts, strict=True):
        part_bytes[part] += w.nbytes
    result = {"bytes": total, "part_bytes": part_bytes}
    for name, ts in totals.items():
        t = statistics.median(ts[1:])
        result[name] = {"ms": round(t * 1e3, 2), "gb_s": round(total / t / 1e9, 2), "parts": {}}
        line = f"{name:5} {t * 1e3:8.2f} ms  {total / t / 1e9:6.2f} GB/s |"
        for part, pts in by_part[name].items():
            pt = statistics.median(pts[1:])
            gb_s = part_bytes[part] / pt / 1e9
            result[name]["parts"][part] = {"ms": round(pt * 1e3, 2), "gb_s": round(gb_s, 2)}
            line += f" {part} {pt * 1e3:6.2f} ms {gb_s:6.2f} GB/s |"
        print(line, flush=True)
    for b in builds:
        share = result["read"]["ms"] / result[b]["ms"]
        result[b]["of_read"] = round(share, 2)
        line = f"{b}: {share:.2f} of the plain read's rate;"
        for part, r in result[b]["parts"].items():
            of = result["read"]["parts"][part]["ms"] / r["ms"]
            r["of_read"] = round(of, 2)
            line += f" {part} {of:.2f}"
        print(line, flush=True)
    if len(builds) == 2:
        old, new = (result[b]["ms"] for b in builds)
        result["speedup"] = round(old / new, 2)
        print(f"new / old x{old / new:.2f}")
    return result


def decode_reads(path: str, positions: int) -> list[int]:
    """Bytes one decoded token of a GGUF reads, a buffer each: every weight tensor once (an
    untied embedding only for its one row: negligible, left out), then agentrt's fp32 KV
    cache of `positions` tokens (keys and values of every layer)."""
    reader = gguf.GGUFReader(path)
    untied = "output.weight" in {t.name for t in reader.tensors}
    embedding = "token_embd.weight" if untied else None
    sizes = [int(t.n_bytes) for t in reader.tensors if t.name != embedding]
    field = lambda key: reader.fields[key].contents() if key in reader.fields else None  # noqa: E731
    arch = field("general.architecture")
    layers, kv_heads = field(f"{arch}.block_count"), field(f"{arch}.attention.head_count_kv")
    head_dim = field(f"{arch}.attention.key_length") or (
        field(f"{arch}.embedding_length") // field(f"{arch}.attention.head_count")
    )
    return [*sizes, layers * 2 * kv_heads * head_dim * 4 * positions]


def bandwidth(args) -> None:
    """The roofline of a decode step: module docstring."""
    repeats = args.repeats or 9
    print(f"{cpu_model()}; read of {args.bandwidth_mib} MiB, best / median of {repeats}")
    results = {}
    for threads in sorted({1, args.threads}):
        best, median = read_bandwidth(threads, args.bandwidth_mib, repeats)
        results[threads] = {"best_gb_s": round(best, 2), "median_gb_s": round(median, 2)}
        print(f"{threads} thread(s): best {best:6.2f} GB/s, median {median:6.2f} GB/s", flush=True)
    out = {"cpu": cpu_model(), "read": results}
    ways = {f"{t} thread(s), one team": (t, False) for t in sorted({1, args.threads})}
    ways[f"{args.threads} threads, a team a tensor"] = (args.threads, True)
    for path in args.gguf:
        sizes = decode_reads(path, args.positions)
        total = sum(sizes)
        print(
            f"{Path(path).name}: {len(sizes) - 1} tensors {(total - sizes[-1]) / 1e6:.1f} MB + "
            f"KV {sizes[-1] / 1e6:.1f} MB at {args.positions} positions = {total / 1e6:.1f} MB "
            f"a decoded token; the ways alternate, {repeats} rounds after one to warm up",
            flush=True,
        )
        buffers = [touched(n) for n in sizes]
        times = {way: [] for way in ways}
        for _ in range(repeats + 1):
            for way, (threads, per_buffer) in ways.items():
                times[way].append(read_buffers(buffers, threads, per_buffer))
        out[path] = {"bytes_per_token": total, "positions": args.positions}
        for way, ts in times.items():
            threads = ways[way][0]
            walls, cpus = [w for w, _ in ts[1:]], [c / threads for _, c in ts[1:]]
            rates = {
                "best_tok_s": 1 / min(walls),
                "median_tok_s": 1 / statistics.median(walls),
                "cpu_tok_s": 1 / statistics.median(cpus),  # CPU time a thread: a core each
            }
            out[path][way] = {k: round(v, 1) for k, v in rates.items()}
            gb = {k: v * total / 1e9 for k, v in rates.items()}
            print(
                f"  {way:28s} tok/s best {rates['best_tok_s']:5.1f} ({gb['best_tok_s']:5.1f} "
                f"GB/s), median {rates['median_tok_s']:5.1f} ({gb['median_tok_s']:5.1f}), by "
                f"CPU time a thread {rates['cpu_tok_s']:5.1f} ({gb['cpu_tok_s']:5.1f})",
                flush=True,
            )
        del buffers
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--types", default=",".join(ALL_TYPES))
    parser.add_argument("--rows", default=None, help="default 1,16,64 (--real: 1,16)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=None, help="default 30 (--real: 9)")
    parser.add_argument("--projs", default="", help="only these projections, e.g. qkv,lm_head")
    parser.add_argument("--real", action="store_true", help="real Q4_K_M types and shapes")
    parser.add_argument("--baseline", default=None, help="--real: a git revision to compare")
    parser.add_argument("--isa", default=None, help="--real: scalar | avx2 | avx512")
    parser.add_argument("--stream-mib", type=int, default=256, help="--real: 0 = in cache")
    parser.add_argument("--cases", default="", help="--real: only cases containing these")
    parser.add_argument("--bandwidth", action="store_true", help="the read roofline instead")
    parser.add_argument(
        "--decode-step", action="store_true", help="--real: Llama-3.2-1B's step against a read"
    )
    parser.add_argument("--bandwidth-mib", type=int, default=1024)
    parser.add_argument("--gguf", nargs="*", default=[], help="--bandwidth: bytes per token of")
    parser.add_argument(
        "--positions", type=int, default=160, help="--bandwidth: KV cache positions a step reads"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.bandwidth:
        bandwidth(args)
        return
    if args.real:
        isa = args.isa or G.selected_isa()
        rows_list = [int(r) for r in (args.rows or "1,16").split(",")]
        builds = {"new": G.load_ggml_kernels(G.default_build_dir(), isa)}
        if args.baseline:
            builds = {"old": baseline_kernels(args.baseline, isa), **builds}
        keys = [c.strip() for c in args.cases.split(",") if c.strip()]
        cases = [r for r in REAL if not keys or any(key in f"{r[0]} {r[1]}" for key in keys)]
        print(
            f"{cpu_model()}; isa {isa}, {args.threads} threads, baseline {args.baseline}, "
            f"torch {torch.__version__}",
            flush=True,
        )
        if args.decode_step:
            step = decode_step(builds, args.threads, args.repeats or 9)
            print(json.dumps({"cpu": cpu_model(), "threads": args.threads, "step": step}))
            return
        results = compare(
            cases, builds, rows_list, args.repeats or 9, args.stream_mib, args.threads
        )
        print(
            json.dumps(
                {
                    "cpu": cpu_model(),
                    "isa": isa,
                    "threads": args.threads,
                    "baseline": args.baseline,
                    "results": results,
                }
            )
        )
        return
    args.rows = args.rows or "1,16,64"
    args.repeats = args.repeats or 30
    types = [t.strip().upper() for t in args.types.split(",") if t.strip()]
    rows_list = [int(r) for r in args.rows.split(",")]
    print(
        f"{cpu_model()}; isa {G.selected_isa()}, {args.threads} threads, torch {torch.__version__}"
    )
    projs = {p.strip() for p in args.projs.split(",") if p.strip()}
    results = run(types, rows_list, args.repeats, projs)
    print(
        json.dumps(
            {
                "cpu": cpu_model(),
                "isa": G.selected_isa(),
                "threads": args.threads,
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
