"""Kernel benchmark: Triton kernels side by side with their torch references, same device.

    python benchmarks/kernels.py                       # full sweep on a GPU
    python benchmarks/kernels.py --quick --json k.json # a few shapes; the result to a file

Measures (Llama-3-8B attention shapes: 32 query heads, 8 KV heads, head_dim 128, bf16):
- paged decode attention, batch 1-256 x context 512-32k: achieved HBM bandwidth (bytes of
  K/V read / time) as a fraction of the device's peak;
- prefill attention: TFLOP/s (4 * heads * head_dim per visible query-key pair);
- grammar bitmask application at batch 1 and 512 over a 128k vocabulary: microseconds;
- the model's fused add + RMSNorm (hidden 4096) and in-place RoPE (32 + 8 heads of 128) at
  1, 64 and 2048 tokens: microseconds, each against its torch reference.
Targets on an H200: decode >= 70% of peak HBM bandwidth at 8k+ context and batch >= 32;
bitmask <= 10 us at batch 1. Without CUDA only the torch references run (on the CPU, small
shapes) and the Triton columns are null. The last line printed is one JSON object (also
written to `--json PATH`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from agentrt.kernels import (
    apply_token_bitmask_ref,
    paged_attention_ref,
    rms_norm_ref,
    rotary_embedding_ref,
    triton_available,
)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
VOCAB = 128_256
# Nominal HBM bandwidth (bytes/s) by device-name substring; else measured with a big copy.
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12}
TARGET_DECODE_FRACTION = 0.70
TARGET_BITMASK_US = 10.0


def bench_us(fn, device: torch.device, min_time_s: float = 0.2) -> float:
    """Mean microseconds per call after warm-up (triton.testing.do_bench on CUDA)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=int(min_time_s * 1000)) * 1e3
    fn()
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_time_s:
            return elapsed / calls * 1e6


def peak_bandwidth(device: torch.device) -> tuple[float, str]:
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_BANDWIDTH.items():
        if key in name:
            return peak, f"nominal {name}"
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = bench_us(lambda: dst.copy_(src), device)
    return 2 * src.numel() / (us * 1e-6), f"measured copy on {name}"


def paged_inputs(seq_lens: list[int], query_lens: list[int], device: torch.device):
    dtype = torch.bfloat16
    blocks = [-(-s // BLOCK_SIZE) for s in seq_lens]
    kv_cache = torch.empty(
        sum(blocks), 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device
    ).normal_()  # (num_blocks, 2, block_size, Hkv, D)
    perm = torch.randperm(sum(blocks), device=device, dtype=torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=device)
    used = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[used : used + n]
        used += n
    cu = torch.tensor([0, *query_lens], device=device).cumsum(0).to(torch.int32)
    query = torch.randn(int(cu[-1]), NUM_HEADS, HEAD_DIM, dtype=dtype, device=device)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    extra = dict(max_query_len=max(query_lens), max_seq_len=max(seq_lens))
    return (query, kv_cache, cu, seq, tables), extra


def attention_sides(args, extra, device: torch.device, run_ref: bool):
    """(triton_us, ref_us); a side that does not run is None."""
    triton_us = ref_us = None
    if device.type == "cuda" and triton_available():
        from agentrt.kernels.triton_paged_attention import paged_attention_triton

        out = torch.empty_like(args[0])
        triton_us = bench_us(lambda: paged_attention_triton(*args, **extra, out=out), device)
    if run_ref:
        ref_us = bench_us(lambda: paged_attention_ref(*args), device)
    return triton_us, ref_us


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(b / a, 2)


def bench_decode(device, batches, contexts, peak, ref_budget):
    rows = []
    print(f"\n# decode attention (bf16, {NUM_HEADS}q/{NUM_KV_HEADS}kv heads, d={HEAD_DIM})")
    print(f"{'batch':>6} {'ctx':>6} {'triton_us':>10} {'ref_us':>10} {'frac_peak':>9} {'x':>6}")
    for batch in batches:
        for ctx in contexts:
            args, extra = paged_inputs([ctx] * batch, [1] * batch, device)
            t_us, r_us = attention_sides(args, extra, device, batch * ctx <= ref_budget)
            kv_bytes = batch * ctx * NUM_KV_HEADS * HEAD_DIM * 2 * 2  # K and V, bf16
            frac = None if t_us is None else kv_bytes / (t_us * 1e-6) / peak
            rows.append(dict(batch=batch, context=ctx, triton_us=t_us, ref_us=r_us, frac_peak=frac))
            print(
                f"{batch:>6} {ctx:>6} {fmt(t_us):>10} {fmt(r_us):>10} {fmt(frac, 3):>9} "
                f"{fmt(ratio(t_us, r_us)):>6}"
            )
            del args
    return rows


def bench_prefill(device, shapes, ref_budget):
    rows = []
    print("\n# prefill attention (causal, bf16)")
    print(f"{'reqs':>5} {'len':>6} {'triton_TF/s':>11} {'ref_TF/s':>9} {'x':>6}")
    for reqs, length in shapes:
        args, extra = paged_inputs([length] * reqs, [length] * reqs, device)
        pairs = reqs * length * (length + 1) / 2  # visible query-key pairs
        flops = 4 * NUM_HEADS * HEAD_DIM * pairs
        t_us, r_us = attention_sides(args, extra, device, reqs * length * length <= ref_budget)
        t_tf = None if t_us is None else flops / (t_us * 1e-6) / 1e12
        r_tf = None if r_us is None else flops / (r_us * 1e-6) / 1e12
        rows.append(dict(reqs=reqs, length=length, triton_tflops=t_tf, ref_tflops=r_tf))
        print(
            f"{reqs:>5} {length:>6} {fmt(t_tf, 2):>11} {fmt(r_tf, 2):>9} {fmt(ratio(r_tf, t_tf)):>6}"
        )
    return rows


def bench_bitmask(device, batches):
    rows = []
    print(f"\n# bitmask application (fp32 logits, vocab {VOCAB})")
    print(f"{'batch':>6} {'triton_us':>10} {'ref_us':>10} {'x':>6}")
    for batch in batches:
        logits = torch.randn(batch, VOCAB, device=device)
        words = -(-VOCAB // 32)
        mask = torch.randint(-(2**31), 2**31 - 1, (batch, words), dtype=torch.int32)
        mask = mask.to(device)
        t_us = None
        if device.type == "cuda" and triton_available():
            from agentrt.kernels.triton_bitmask import apply_token_bitmask_triton

            t_us = bench_us(lambda x=logits, m=mask: apply_token_bitmask_triton(x, m), device)
        r_us = bench_us(lambda x=logits, m=mask: apply_token_bitmask_ref(x, m), device)
        rows.append(dict(batch=batch, triton_us=t_us, ref_us=r_us))
        print(f"{batch:>6} {fmt(t_us):>10} {fmt(r_us):>10} {fmt(ratio(t_us, r_us)):>6}")
    return rows


def norm_rope_row(device: torch.device, tokens: int) -> dict:
    """Fused add + RMSNorm and in-place RoPE at `tokens` tokens: Triton and reference us."""
    hidden = NUM_HEADS * HEAD_DIM
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device)
    res, w = torch.randn_like(x), torch.rand(hidden, dtype=torch.bfloat16, device=device)
    positions = torch.randint(0, 8192, (tokens,), device=device)
    angles = torch.rand(8192, HEAD_DIM // 2, device=device) * 100
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1)  # (max_pos, head_dim)
    q = torch.randn(tokens, NUM_HEADS * HEAD_DIM, dtype=torch.bfloat16, device=device)
    k = torch.randn(tokens, NUM_KV_HEADS * HEAD_DIM, dtype=torch.bfloat16, device=device)
    row = dict(tokens=tokens, rms_norm_triton_us=None, rotary_triton_us=None)
    if device.type == "cuda" and triton_available():
        from agentrt.kernels.triton_rms_norm import rms_norm_triton
        from agentrt.kernels.triton_rotary import rotary_embedding_triton

        row["rms_norm_triton_us"] = bench_us(lambda: rms_norm_triton(x, w, 1e-5, res), device)
        row["rotary_triton_us"] = bench_us(
            lambda: rotary_embedding_triton(positions, q, k, cache, HEAD_DIM), device
        )
    row["rms_norm_ref_us"] = bench_us(lambda: rms_norm_ref(x, w, 1e-5, res), device)
    row["rotary_ref_us"] = bench_us(
        lambda: rotary_embedding_ref(positions, q, k, cache, HEAD_DIM), device
    )
    return row


def bench_norm_rope(device, token_counts):
    rows = []
    print(f"\n# fused add + RMSNorm (hidden {NUM_HEADS * HEAD_DIM}) and RoPE, bf16")
    print(
        f"{'tokens':>6} {'norm_us':>8} {'ref_us':>8} {'x':>6} {'rope_us':>8} {'ref_us':>8} {'x':>6}"
    )
    for tokens in token_counts:
        r = norm_rope_row(device, tokens)
        rows.append(r)
        norm, norm_ref = r["rms_norm_triton_us"], r["rms_norm_ref_us"]
        rope, rope_ref = r["rotary_triton_us"], r["rotary_ref_us"]
        print(
            f"{tokens:>6} {fmt(norm):>8} {fmt(norm_ref):>8} {fmt(ratio(norm, norm_ref)):>6} "
            f"{fmt(rope):>8} {fmt(rope_ref):>8} {fmt(ratio(rope, rope_ref)):>6}"
        )
    return rows


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    parser.add_argument("--json", metavar="PATH", help="also write the result object here")
    opts = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    result: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu"}
    if not cuda:
        print(
            "No CUDA device: the Triton kernels need a GPU. Running the torch references on "
            "the CPU at small shapes; Triton columns are null.",
            file=sys.stderr,
        )
    if cuda and not triton_available():
        print("triton is not installed: pip install 'agentrt[triton]'", file=sys.stderr)
    if cuda:
        peak, peak_source = peak_bandwidth(device)
        batches = [1, 32, 256] if opts.quick else [1, 8, 32, 64, 128, 256]
        contexts = [512, 8192] if opts.quick else [512, 2048, 8192, 32768]
        prefill = [(1, 2048)] if opts.quick else [(1, 1024), (1, 4096), (1, 8192), (4, 2048)]
        ref_budget = 1 << 21 if opts.quick else 1 << 22
    else:
        peak, peak_source = float("nan"), "n/a"
        batches, contexts, prefill, ref_budget = [1, 8], [512, 2048], [(1, 512)], 1 << 30
    result["peak_bandwidth_bytes_s"] = peak if cuda else None
    result["peak_source"] = peak_source
    result["decode"] = bench_decode(device, batches, contexts, peak, ref_budget)
    result["prefill"] = bench_prefill(device, prefill, ref_budget)
    result["bitmask"] = bench_bitmask(device, [1, 512])
    result["norm_rope"] = bench_norm_rope(device, [1, 64, 2048] if cuda else [1, 64])
    long_rows = [
        r["frac_peak"]
        for r in result["decode"]
        if r["context"] >= 8192 and r["batch"] >= 32 and r["frac_peak"] is not None
    ]
    bitmask_1 = next(r["triton_us"] for r in result["bitmask"] if r["batch"] == 1)
    result["targets"] = {
        "decode_min_frac_peak_8k_b32": min(long_rows) if long_rows else None,
        "decode_target": TARGET_DECODE_FRACTION,
        "decode_met": (min(long_rows) >= TARGET_DECODE_FRACTION) if long_rows else None,
        "bitmask_batch1_us": bitmask_1,
        "bitmask_target_us": TARGET_BITMASK_US,
        "bitmask_met": None if bitmask_1 is None else bitmask_1 <= TARGET_BITMASK_US,
    }
    print(json.dumps(result))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
