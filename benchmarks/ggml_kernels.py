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
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# benchmarks/gguf.py beside this script would shadow the gguf package.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from agentrt.kernels import ggml_linear as G  # noqa: E402
from agentrt.kernels.quantized_linear import (  # noqa: E402
    Int4Weight,
    pack_int4,
    quantize_int8,
)

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
    return G.random_weight(qtype, n, k, seed)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--types", default=",".join(ALL_TYPES))
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--projs", default="", help="only these projections, e.g. qkv,lm_head")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    types = [t.strip().upper() for t in args.types.split(",") if t.strip()]
    rows_list = [int(r) for r in args.rows.split(",")]
    print(f"isa {G.selected_isa()}, {args.threads} threads, torch {torch.__version__}")
    projs = {p.strip() for p in args.projs.split(",") if p.strip()}
    results = run(types, rows_list, args.repeats, projs)
    print(json.dumps({"isa": G.selected_isa(), "threads": args.threads, "results": results}))


if __name__ == "__main__":
    main()
