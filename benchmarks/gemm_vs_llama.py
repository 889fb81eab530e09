"""Our batched quantized products (kernels/ggml_quants.c) against llama.cpp's, per weight type
and activation row count, on the same weight bytes (issue 41).

    python benchmarks/gemm_vs_llama.py --llama-cpp PATH/vendor/llama.cpp [--rows 1,4,16,64,512]
        [--threads 1,2] [--cases q4_k,q6_k] [--repeats 5] [--stream-mib 256]

PATH is a llama.cpp source tree with a CPU build in `build/` (BUILD_SHARED_LIBS=ON: libggml,
libggml-base and libggml-cpu in build/bin). A small C library (below) is compiled against it and
loaded into this process. It puts the weight where a user's llama.cpp does: in the CPU_REPACK
buffer type when the CPU backend has a repacked layout for the type here (repacked at load, as
llama.cpp's loader does; llama.cpp logs "repack: repack tensor ... with <layout>"), else in a
plain CPU buffer; and it times one ggml_mul_mat graph on the CPU backend with its own threads,
from fp32 activations as llama.cpp's graphs hand them. Which kernel then runs is llama.cpp's
choice; each line names it in brackets (on x86, from 0.3.36's code, confirmed with perf):
Q4_0 and Q4_K are repacked (repack.cpp's GEMV below 4 rows, GEMM from 4); plain Q5_K/Q6_K run
ggml-cpu/tiled from 8 rows and vec_dot below; plain Q5_0/Q8_0 run llamafile's tinyBLAS from 2
rows and vec_dot at one.

Both sides read the same bytes: our weight (random, quantized as a file holds it) goes to
llama.cpp as its GGUF bytes, ours in the layout our build holds the type in; each side's
output is checked against gguf's fp32 reference (max error relative to the largest output).
Passes alternate (ours, llama.cpp, ours, ...). Figures are GFLOP/s (2 * N * K * rows / time):
the median and the best pass by wall time, and the median by CPU time (the calling thread's
with one thread: both sides run their first thread on it; the process's per thread with
more), and the ratio ours / llama.cpp of each (> 1: ours is faster). On a shared machine the
one-thread CPU-time figure is the steady one; with more threads, set OMP_WAIT_POLICY=passive
there (both sides' OpenMP read it), or threads spinning for a descheduled partner swamp the
figures. Small weights are copied up to `--stream-mib` so that each call reads its weight
from memory (a decode's case), as far as a pass stays under PASS_FLOP. The last line is one
JSON object. Without `--llama-cpp` only our side runs.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ggml_kernels as K  # takes benchmarks/ off sys.path (gguf.py), puts the repo root on
import torch

from agentrt.kernels import ggml_linear as G
from agentrt.kernels.cpu_build import build_library

# (name, type, N, K): the weights of real Q4_K_M files (Qwen2.5-1.5B's FFN, Qwen2.5-0.5B's
# Q5_0 gate and tied Q8_0 output, Llama-3.2-1B's tied Q6_K output) and a Q4_0 on the gate_up
# shape (llama.cpp repacks Q4_0 too).
CASES = (
    ("qwen1.5b gate_up", "Q4_K", 17920, 1536),
    ("qwen1.5b down", "Q6_K", 1536, 8960),
    ("qwen0.5b gate", "Q5_0", 4864, 896),
    ("qwen0.5b output", "Q8_0", 151936, 896),
    ("llama1b output", "Q6_K", 128256, 2048),
    ("gate_up as Q4_0", "Q4_0", 17920, 1536),
)
PASS_FLOP = 4e9  # a pass's copies stop here: past it a product is compute-bound anyway

_LLAMA_SOURCE = r"""
#include <stdlib.h>
#include <string.h>
#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

/* One weight (`copies` copies of the same bytes) and the graph of `rows` activation rows
   times each copy, all writing one output. */
typedef struct {
    ggml_backend_t backend;
    struct ggml_context *wctx, *gctx;
    ggml_backend_buffer_t wbuf, gbuf;
    struct ggml_tensor *x, *y;
    struct ggml_cgraph *graph;
    int copies, repacked;
} mm_bench;

static ggml_backend_buffer_type_t repack_buffer_type(void) {
    ggml_backend_reg_t reg = ggml_backend_cpu_reg();
    ggml_backend_dev_get_extra_bufts_t get = (ggml_backend_dev_get_extra_bufts_t)
        ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    if (!get) return NULL;
    for (ggml_backend_buffer_type_t *b = get(ggml_backend_reg_dev_get(reg, 0)); b && *b; b++)
        if (strcmp(ggml_backend_buft_name(*b), "CPU_REPACK") == 0) return *b;
    return NULL;
}

/* The weight in the buffer a user's llama.cpp puts it: CPU_REPACK when that buffer type
   has a layout for the type and shape here (its init_tensor leaves `extra` NULL otherwise,
   and llama.cpp's loader then keeps the weight in a plain CPU buffer), repacked from `data`
   (GGUF bytes) by set_tensor; a plain CPU buffer always with `repack` 0 (llama.cpp's
   --no-repack). NULL if out of memory. */
mm_bench *mm_new(int type, long n, long k, int copies, int repack, const void *data) {
    mm_bench *b = calloc(1, sizeof *b);
    struct ggml_init_params params = {ggml_tensor_overhead() * (copies + 1), NULL, true};
    b->wctx = ggml_init(params);
    b->copies = copies;
    for (int c = 0; c < copies; c++) ggml_new_tensor_2d(b->wctx, type, k, n);
    ggml_backend_buffer_type_t buft = repack ? repack_buffer_type() : NULL;
    if (buft) {
        b->wbuf = ggml_backend_alloc_ctx_tensors_from_buft(b->wctx, buft);
        if (b->wbuf && ggml_get_first_tensor(b->wctx)->extra != NULL) {
            b->repacked = 1;
        } else if (b->wbuf) {
            ggml_backend_buffer_free(b->wbuf);
            b->wbuf = NULL;
        }
    }
    if (!b->repacked) {
        struct ggml_context *fresh = ggml_init(params); /* tensors not yet bound to a buffer */
        ggml_free(b->wctx);
        b->wctx = fresh;
        for (int c = 0; c < copies; c++) ggml_new_tensor_2d(b->wctx, type, k, n);
        b->wbuf = ggml_backend_alloc_ctx_tensors_from_buft(b->wctx, ggml_backend_cpu_buffer_type());
    }
    if (!b->wbuf) {
        ggml_free(b->wctx);
        free(b);
        return NULL;
    }
    for (struct ggml_tensor *t = ggml_get_first_tensor(b->wctx); t; t = ggml_get_next_tensor(b->wctx, t))
        ggml_backend_tensor_set(t, data, 0, ggml_nbytes(t));
    b->backend = ggml_backend_cpu_init();
    return b;
}

int mm_repacked(const mm_bench *b) { return b->repacked; }

void mm_set_threads(mm_bench *b, int threads) { ggml_backend_cpu_set_n_threads(b->backend, threads); }

/* The graph of `rows` fp32 activation rows times each of the first `copies` copies; x set
   from `x` (rows x k). */
int mm_prepare(mm_bench *b, int rows, int copies, const float *x) {
    if (copies < 1 || copies > b->copies) return 2;
    if (b->gctx) { ggml_backend_buffer_free(b->gbuf); ggml_free(b->gctx); }
    struct ggml_init_params params = {ggml_tensor_overhead() * (b->copies + 2) +
                                      ggml_graph_overhead(), NULL, true};
    b->gctx = ggml_init(params);
    struct ggml_tensor *w = ggml_get_first_tensor(b->wctx);
    b->x = ggml_new_tensor_2d(b->gctx, GGML_TYPE_F32, w->ne[0], rows);
    b->graph = ggml_new_graph(b->gctx);
    struct ggml_tensor *ys[copies];
    for (int c = 0; c < copies; c++, w = ggml_get_next_tensor(b->wctx, w)) {
        ys[c] = ggml_mul_mat(b->gctx, w, b->x);
        ggml_build_forward_expand(b->graph, ys[c]);
    }
    b->y = ys[0];
    size_t x_bytes = GGML_PAD(ggml_nbytes(b->x), 64);
    b->gbuf = ggml_backend_alloc_buffer(b->backend, x_bytes + ggml_nbytes(b->y));
    if (!b->gbuf) return 1;
    char *base = ggml_backend_buffer_get_base(b->gbuf);
    ggml_backend_tensor_alloc(b->gbuf, b->x, base);
    for (int c = 0; c < copies; c++) ggml_backend_tensor_alloc(b->gbuf, ys[c], base + x_bytes);
    ggml_backend_tensor_set(b->x, x, 0, ggml_nbytes(b->x));
    return 0;
}

int mm_compute(mm_bench *b) { return ggml_backend_graph_compute(b->backend, b->graph); }

void mm_output(const mm_bench *b, float *out) { ggml_backend_tensor_get(b->y, out, 0, ggml_nbytes(b->y)); }

void mm_free(mm_bench *b) {
    if (b->gctx) { ggml_backend_buffer_free(b->gbuf); ggml_free(b->gctx); }
    ggml_backend_buffer_free(b->wbuf);
    ggml_free(b->wctx);
    ggml_backend_free(b->backend);
    free(b);
}
"""


def load_llama(root: Path):
    """The C library above, built against the llama.cpp tree `root` (its build/bin)."""
    lib_dir = root / "build" / "bin"
    if not (lib_dir / "libggml-cpu.so").exists():
        sys.exit(f"no {lib_dir / 'libggml-cpu.so'}: build llama.cpp with BUILD_SHARED_LIBS=ON")
    folder = Path(tempfile.gettempdir()) / "agentrt-llama-mm"  # built once: keyed by a hash
    folder.mkdir(exist_ok=True)
    (folder / "llama_mm.c").write_text(_LLAMA_SOURCE)
    flags = (
        f"-I{root / 'ggml' / 'include'}",
        f"-L{lib_dir}",
        f"-Wl,-rpath,{lib_dir}",
        "-Wl,--no-as-needed",
        "-lggml-cpu",
        "-lggml-base",
        "-lggml",
    )
    lib = ctypes.CDLL(str(build_library(folder / "llama_mm.c", folder / "build", flags)))
    vp, i, long = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    lib.mm_new.argtypes = [i, long, long, i, i, vp]
    lib.mm_new.restype = vp
    for name, args in (
        ("mm_repacked", [vp]),
        ("mm_set_threads", [vp, i]),
        ("mm_prepare", [vp, i, i, vp]),
        ("mm_compute", [vp]),
        ("mm_output", [vp, vp]),
        ("mm_free", [vp]),
    ):
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = i
    return lib


def llama_kernel(type_name: str, repacked: bool, rows: int) -> str:
    """The kernel llama.cpp's CPU backend runs for the type at `rows` on x86 (read from
    ggml-cpu.c's mul_mat, repack.cpp, tiled/ and llamafile/sgemm.cpp of 0.3.36's tree)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return "repacked" if repacked else "plain"
    if repacked:
        return "repack gemv" if rows < 4 else "repack gemm"
    if type_name.endswith("_K"):
        return "tiled" if rows >= 8 else "vec_dot"
    return "tinyBLAS" if rows >= 2 else "vec_dot"


def copies_for(nbytes: int, flop: float, stream_mib: int) -> int:
    """Copies of a weight a pass calls: enough to pass `stream_mib` MiB (each call reads its
    weight from memory), but no more than keep the pass under PASS_FLOP; at least one."""
    streamed = -(-stream_mib * 2**20 // nbytes) if stream_mib else 1
    return max(1, min(streamed, int(PASS_FLOP // flop)))


def ours_pass(x: torch.Tensor, weights: list, out: torch.Tensor, kernels) -> None:
    for w in weights:
        G.ggml_linear_bf16(x, w, out, kernels)


def alternate(sides: dict, repeats: int, threads: int) -> dict[str, tuple[float, float, float]]:
    """side -> seconds of a pass (median wall, best wall, median CPU) over `repeats` passes
    after a warm-up, the sides' passes alternating. CPU: the calling thread's with one thread,
    else the process's divided by the threads (spin-waits included: on a loaded machine, a
    thread spinning for its descheduled partner; see OMP_WAIT_POLICY above)."""
    clock = time.thread_time if threads == 1 else time.process_time
    wall = {side: [] for side in sides}
    cpu = {side: [] for side in sides}
    for _ in range(repeats + 1):
        for side, fn in sides.items():
            t0, c0 = time.perf_counter(), clock()
            fn()
            wall[side].append(time.perf_counter() - t0)
            cpu[side].append((clock() - c0) / threads)
    return {
        s: (statistics.median(wall[s][1:]), min(wall[s][1:]), statistics.median(cpu[s][1:]))
        for s in sides
    }


def compare(cases, rows_list, threads_list, repeats, stream_mib, lib, repack) -> list[dict]:
    """Each case at each thread count and row count: ours and llama.cpp's passes alternating,
    each side's output checked against gguf's fp32 reference."""
    kernels = G.default_kernels()
    results = []
    for name, type_name, n, k in cases:
        qtype = int(K.Q[type_name])
        weight = K.realistic_weight(qtype, n, k)
        dense = G.dequantize_ref(weight)
        most = max(copies_for(weight.nbytes, 2 * n * k * r, stream_mib) for r in rows_list)
        ours = [K.held(G.GGMLWeight(weight.data.clone(), qtype, k), kernels) for _ in range(most)]
        llama = lib.mm_new(qtype, n, k, most, repack, weight.data.data_ptr()) if lib else None
        if lib and not llama:
            sys.exit(f"llama.cpp could not allocate {most} copies of {name}")
        repacked = bool(lib.mm_repacked(llama)) if llama else False
        for threads, rows in ((t, r) for t in threads_list for r in rows_list):
            torch.set_num_threads(threads)
            flop = 2 * n * k * rows
            copies = copies_for(weight.nbytes, flop, stream_mib)
            x = torch.randn(rows, k).bfloat16()
            xf = x.float()  # llama.cpp's graphs hand fp32 rows to mul_mat
            ref = xf @ dense.T
            got = {"ours": G.ggml_linear(x, ours[0], kernels=kernels)}
            out = torch.empty(rows, n, dtype=torch.bfloat16)
            sides = {"ours": functools.partial(ours_pass, x, ours[:copies], out, kernels)}
            if llama:
                lib.mm_set_threads(llama, threads)
                if lib.mm_prepare(llama, rows, copies, xf.data_ptr()):
                    sys.exit(f"llama.cpp could not allocate the graph of {name} T={rows}")
                lib.mm_compute(llama)
                got["llama"] = torch.empty(rows, n)
                lib.mm_output(llama, got["llama"].data_ptr())
                sides["llama"] = functools.partial(lib.mm_compute, llama)
            times = alternate(sides, repeats, threads)
            row = {"case": name, "type": type_name, "shape": [n, k], "rows": rows}
            row |= {"threads": threads, "copies": copies}
            figures = ("gflops", "best_gflops", "cpu_gflops")
            for side, seconds in times.items():
                err = (got[side] - ref).abs().max() / ref.abs().max()
                row[side] = {
                    f: round(flop * copies / t / 1e9, 1)
                    for f, t in zip(figures, seconds, strict=True)
                }
                row[side]["max_rel_err"] = float(f"{err:.2e}")
            line = f"{type_name:5} {name:16} {n:6}x{k:<5} T={rows:<3} th={threads} GFLOP/s"
            line += "".join(
                f"  {s} {row[s]['gflops']:6.1f} best {row[s]['best_gflops']:6.1f}"
                f" cpu {row[s]['cpu_gflops']:6.1f} err {row[s]['max_rel_err']:.0e}"
                for s in times
            )
            if llama:
                row["llama"]["kernel"] = llama_kernel(type_name, repacked, rows)
                for f in figures:
                    ratio = row["ours"][f] / row["llama"][f]
                    row[f.replace("gflops", "ratio")] = round(ratio, 2)
                line += f"  [{row['llama']['kernel']}] ours/llama x{row['ratio']:.2f}"
                line += f" best x{row['best_ratio']:.2f} cpu x{row['cpu_ratio']:.2f}"
            results.append(row)
            print(line, flush=True)
        if llama:
            lib.mm_free(llama)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-cpp", type=Path, default=None, help="llama.cpp tree, built")
    parser.add_argument("--rows", default="1,4,16,64,512")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--cases", default="", help="only cases whose name or type has these")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--stream-mib", type=int, default=256, help="0 = the weight in cache")
    parser.add_argument("--no-repack", action="store_true", help="llama.cpp's plain buffers")
    args = parser.parse_args()
    keys = [c.strip().lower() for c in args.cases.split(",") if c.strip()]
    cases = [c for c in CASES if not keys or any(key in f"{c[0]} {c[1]}".lower() for key in keys)]
    rows_list = [int(r) for r in args.rows.split(",")]
    threads_list = [int(t) for t in args.threads.split(",")]
    lib = load_llama(args.llama_cpp) if args.llama_cpp else None
    repack = "off" if args.no_repack else "on"
    print(f"{K.cpu_model()}; isa {G.selected_isa()}; llama.cpp {args.llama_cpp}, repack {repack}")
    results = compare(
        cases, rows_list, threads_list, args.repeats, args.stream_mib, lib, not args.no_repack
    )
    print(json.dumps({"cpu": K.cpu_model(), "isa": G.selected_isa(), "results": results}))


if __name__ == "__main__":
    main()
