"""Triton paged attention, its split-KV merge and KV-cache writes against their torch
references.

CPU-only machines run these under Triton's interpreter (see conftest); CUDA machines run
the compiled kernels on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from agentrt.kernels import (
    KernelInputError,
    merge_attn_states_ref,
    paged_attention_ref,
    reshape_and_cache_ref,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_reshape_and_cache_matches_ref(tk, device, dtype, block_size):
    gen = torch.Generator().manual_seed(1)
    num_blocks, heads, dim = 4, 3, 64
    key = torch.randn(9, heads, dim, generator=gen).to(dtype)
    value = torch.randn(9, heads, dim, generator=gen).to(dtype)
    slots = torch.tensor([0, 5, -1, block_size + 1, 2 * block_size, 3, -7, 4 * block_size - 1, 9])
    ref = torch.zeros(num_blocks, 2, block_size, heads, dim, dtype=dtype)
    reshape_and_cache_ref(key, value, ref, slots)
    cache = torch.zeros_like(ref, device=device)
    tk.reshape_and_cache_triton(key.to(device), value.to(device), cache, slots.to(device))
    assert torch.equal(cache.cpu(), ref)
    assert int((ref != 0).any(dim=-1).any(dim=-1).sum()) == 2 * 7  # 7 real tokens, K and V


def test_reshape_and_cache_strided_input(tk, device):
    # K and V as views into a fused qkv projection output: token stride > heads * dim.
    qkv = torch.randn(5, 3 * 2 * 16, device=device)
    key = qkv[:, 32:64].view(5, 2, 16)
    value = qkv[:, 64:].view(5, 2, 16)
    slots = torch.tensor([3, 4, -1, 0, 7], device=device)
    cache = torch.zeros(2, 2, 4, 2, 16, device=device)
    ref = cache.clone().cpu()
    tk.reshape_and_cache_triton(key, value, cache, slots)
    reshape_and_cache_ref(key.cpu(), value.cpu(), ref, slots.cpu())
    assert torch.equal(cache.cpu(), ref)


# (seq_lens, query_lens) covering decode, prefill, chunked prefill and mixed batches.
BATCHES = {
    "decode": ([37, 5, 70, 16], [1, 1, 1, 1]),
    "prefill": ([45], [45]),
    "chunked": ([70], [23]),
    "mixed": ([37, 5, 70, 1], [1, 5, 20, 1]),
}


@pytest.mark.parametrize("batch_name", list(BATCHES))
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_paged_attention_matches_ref_gqa(
    tk, make_paged_batch, tol, batch_name, num_heads, num_kv_heads
):
    seq_lens, query_lens = BATCHES[batch_name]
    batch = make_paged_batch(seq_lens, query_lens, num_heads, num_kv_heads, 64, 16, torch.float16)
    out = tk.paged_attention_triton(*batch.args())
    ref = paged_attention_ref(*(t.cpu() for t in batch.args()))
    assert not out.isnan().any()
    torch.testing.assert_close(out.cpu(), ref, **tol(torch.float16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,block_size", [(64, 32), (128, 16), (128, 32), (96, 16)])
def test_paged_attention_dtypes_and_shapes(
    tk, make_paged_batch, dense, tol, dtype, head_dim, block_size
):
    batch = make_paged_batch([33, 64, 7], [1, 9, 7], 6, 2, head_dim, block_size, dtype, seed=2)
    out = tk.paged_attention_triton(*batch.args(), scale=0.07, max_query_len=9, max_seq_len=64)
    assert out.dtype == dtype
    torch.testing.assert_close(out.cpu().double(), dense(batch, scale=0.07), **tol(dtype))


@pytest.mark.parametrize("num_splits", [2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_split_kv_matches_ref(tk, make_paged_batch, tol, num_splits, dtype):
    # 8 splits over at most 3 tiles leaves empty splits: they must not contribute.
    batch = make_paged_batch([150, 9, 64], [1, 1, 2], 8, 2, 64, 16, dtype, seed=3)
    out = tk.paged_attention_triton(*batch.args(), num_splits=num_splits)
    ref = paged_attention_ref(*(t.cpu() for t in batch.args()))
    torch.testing.assert_close(out.cpu(), ref, **tol(dtype))


def test_paged_attention_writes_into_strided_out(tk, make_paged_batch, device):
    batch = make_paged_batch([20, 40], [3, 1], 4, 2, 64, 16, torch.float32)
    storage = torch.zeros(4, 4, 2, 64, device=device)
    out = storage[:, :, 0]  # (T, H, D) with head stride 128: a non-contiguous view
    returned = tk.paged_attention_triton(*batch.args(), out=out)
    assert returned is out
    ref = paged_attention_ref(*(t.cpu() for t in batch.args()))
    torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)
    assert not storage[:, :, 1].any()


def test_paged_attention_wrapper_rejects_bad_inputs(tk, make_paged_batch):
    batch = make_paged_batch([8], [1], 4, 2, 64, 16, torch.float32)
    q, cache, cu, lens, tables = batch.args()
    with pytest.raises(KernelInputError) as err:
        tk.paged_attention_triton(q[..., ::2], cache[..., ::2], cu, lens, tables)
    assert err.value.arg in ("query", "kv_cache")
    with pytest.raises(KernelInputError) as err:
        tk.paged_attention_triton(q, cache, cu[:1], lens, tables)
    assert err.value.arg == "query_start_loc"
    with pytest.raises(KernelInputError) as err:
        tk.paged_attention_triton(q, cache, cu, lens, tables, num_splits=0)
    assert err.value.arg == "num_splits"


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_merge_attn_states_matches_ref(tk, device, num_splits):
    gen = torch.Generator().manual_seed(num_splits)
    partial_out = torch.randn(5, 4, num_splits, 48, generator=gen)  # head_dim 48: masked tail
    partial_lse = torch.randn(5, 4, num_splits, generator=gen) * 4
    partial_lse[0, 0] = float("-inf")  # no split saw a key: the result is 0
    partial_lse[1, :, 0] = float("-inf")  # one empty split among others...
    partial_out[1, :, 0] = float("nan")  # ...whose output must not leak in
    expect = merge_attn_states_ref(partial_out, partial_lse)
    assert torch.isfinite(expect).all() and not expect[0, 0].any()
    got = tk.merge_attn_states_triton(partial_out.to(device), partial_lse.to(device))
    torch.testing.assert_close(got.cpu(), expect, atol=1e-5, rtol=1e-5)
    into = torch.empty(5, 4, 48, dtype=torch.bfloat16, device=device)
    tk.merge_attn_states_triton(partial_out.to(device), partial_lse.to(device), into)
    torch.testing.assert_close(into.cpu(), expect.to(torch.bfloat16), atol=2e-2, rtol=2e-2)
