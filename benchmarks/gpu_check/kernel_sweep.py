"""The Triton paged-attention kernel against its torch reference over the shapes the model
zoo uses: head dims 64 / 80 / 128, GQA group sizes 1 to 8, KV block sizes 16 and 128, and
forced split-KV counts (1, 3, 8) next to the automatic choice, each on a decode batch and
on a mixed batch (chunked prefill after cached context, a fresh prefill, decodes).
The KV-cache write kernel is checked at both block sizes too.

Not a full cartesian product: every kernel specialisation costs a compile (about a second),
so each axis is swept around a base case (tests/kernels covers 2 and 8 splits). Unused cache blocks and spare block-table
entries hold NaN: a read past a context shows up in the output.
"""

from __future__ import annotations

import time

import torch
from common import Context

# (head_dim, num_kv_heads, group, block_size, dtype): head dims 64 / 80 / 128, groups
# 1 / 2 / 3 / 4 / 8, blocks 16 / 128, each dtype, in 8 cases of about 4 compiles each.
CASES = [
    (128, 2, 4, 16, torch.bfloat16),
    (64, 2, 4, 16, torch.bfloat16),
    (80, 2, 4, 16, torch.bfloat16),
    (128, 4, 1, 16, torch.bfloat16),
    (128, 1, 8, 16, torch.bfloat16),
    (64, 3, 3, 128, torch.float16),
    (80, 2, 2, 128, torch.bfloat16),
    (128, 2, 4, 128, torch.float32),
]
DRY_CASES = [(80, 1, 4, 16, torch.bfloat16), (64, 1, 2, 128, torch.float32)]
SPLITS = (1, 3, None)  # None: the kernel's own choice (4 for DECODE on an H200)
DRY_SPLITS = (1, 3)
# atol = rtol per dtype, as tests/kernels/conftest.py's TOLERANCE.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}

# (seq_lens, query_lens): long decodes (splits matter), and a mixed step.
DECODE = ([1100, 37, 2050, 5], [1, 1, 1, 1])
MIXED = ([700, 129, 33, 1000], [200, 129, 1, 1])
DRY_DECODE = ([40, 3], [1, 1])
DRY_MIXED = ([21, 9], [5, 9])


def paged_batch(seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device):
    """Query, shuffled paged cache and metadata for a flat varlen batch (seeded)."""
    gen = torch.Generator().manual_seed(0)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 1
    cache = torch.full((num_blocks, 2, block_size, num_kv_heads, head_dim), float("nan"))
    perm = torch.randperm(num_blocks, generator=gen)
    spare = int(perm[-1])  # never written: stays NaN
    tables = torch.full((len(seq_lens), max(blocks_per_req) + 1), spare, dtype=torch.int32)
    used = 0
    for i, (seq_len, nb) in enumerate(zip(seq_lens, blocks_per_req, strict=True)):
        tables[i, :nb] = perm[used : used + nb]
        used += nb
        pos = torch.arange(seq_len)
        blk = tables[i, pos // block_size].long()
        cache[blk, 0, pos % block_size] = torch.randn(
            seq_len, num_kv_heads, head_dim, generator=gen
        )
        cache[blk, 1, pos % block_size] = torch.randn(
            seq_len, num_kv_heads, head_dim, generator=gen
        )
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(cu[-1]), num_heads, head_dim, generator=gen)
    return tuple(
        t.to(device)
        for t in (
            query.to(dtype),
            cache.to(dtype),
            cu,
            torch.tensor(seq_lens, dtype=torch.int32),
            tables,
        )
    )


def check_reshape_and_cache(block_size: int, device: str) -> float:
    from agentrt.kernels import reshape_and_cache_ref
    from agentrt.kernels.triton_reshape_and_cache import reshape_and_cache_triton

    gen = torch.Generator().manual_seed(1)
    num_blocks, heads, dim = 6, 2, 80
    key = torch.randn(70, heads, dim, generator=gen).to(torch.bfloat16)
    value = torch.randn(70, heads, dim, generator=gen).to(torch.bfloat16)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:70]
    slots[::9] = -1  # padding tokens are skipped
    ref = torch.zeros(num_blocks, 2, block_size, heads, dim, dtype=torch.bfloat16)
    reshape_and_cache_ref(key, value, ref, slots)
    cache = torch.zeros_like(ref, device=device)
    reshape_and_cache_triton(key.to(device), value.to(device), cache, slots.to(device))
    return float((cache.cpu().float() - ref.float()).abs().max())


def run(ctx: Context) -> dict:
    from agentrt.kernels import paged_attention_ref
    from agentrt.kernels.triton_paged_attention import paged_attention_triton

    device = ctx.device
    cases, splits = (DRY_CASES, DRY_SPLITS) if ctx.dry_run else (CASES, SPLITS)
    batches = (
        {"decode": DRY_DECODE, "mixed": DRY_MIXED}
        if ctx.dry_run
        else {
            "decode": DECODE,
            "mixed": MIXED,
        }
    )
    rows, failures = [], []
    start = time.perf_counter()
    for head_dim, num_kv_heads, group, block_size, dtype in cases:
        for batch_name, (seq_lens, query_lens) in batches.items():
            args = paged_batch(
                seq_lens, query_lens, num_kv_heads * group, num_kv_heads, head_dim,
                block_size, dtype, device,
            )  # fmt: skip
            ref = paged_attention_ref(*args).float()
            for num_splits in splits if batch_name == "decode" else (1, None):
                out = paged_attention_triton(*args, num_splits=num_splits).float()
                err = float((out - ref).abs().max())  # NaN when a read went past a context
                tol = TOLERANCE[dtype]
                excess = float(((out - ref).abs() - tol * ref.abs()).max())  # vs atol
                row = {
                    "head_dim": head_dim,
                    "group": group,
                    "kv_heads": num_kv_heads,
                    "block_size": block_size,
                    "dtype": str(dtype).removeprefix("torch."),
                    "batch": batch_name,
                    "splits": num_splits or "auto",
                    "max_abs": round(err, 6),
                }
                rows.append(row)
                if not excess <= tol:
                    failures.append(row)
        ctx.save_partial({"cases": len(rows), "failures": failures[:10]})
    cache_errors = {bs: check_reshape_and_cache(bs, device) for bs in (16, 128)}
    for bs, err in cache_errors.items():
        if err != 0.0:
            failures.append({"reshape_and_cache": bs, "max_abs": err})
    print(f"{len(rows)} attention cases in {time.perf_counter() - start:.1f}s")
    for row in rows:
        print(row)
    result = {
        "ok": not failures,
        "cases": len(rows),
        "worst_max_abs": max(r["max_abs"] for r in rows),
        "reshape_and_cache_max_abs": cache_errors,
        "failures": failures[:10],
    }
    if failures:
        result["error"] = f"{len(failures)} case(s) outside tolerance, e.g. {failures[0]}"
    return result
