"""The torch attention references against naive dense attention (no Triton involved)."""

from __future__ import annotations

import pytest
import torch

from agentrt.kernels import (
    KernelInputError,
    merge_attn_states_ref,
    paged_attention_ref,
    reshape_and_cache_ref,
)

# (seq_lens, query_lens): decode-only, prefill-only, chunked prefill, and mixed batches;
# lengths deliberately not multiples of the block size.
CASES = [
    ([1], [1]),
    ([37, 5, 70], [1, 1, 1]),
    ([19], [19]),
    ([37, 5, 70], [1, 5, 20]),
    ([50, 33, 2, 16], [3, 1, 2, 16]),
]


def test_reshape_and_cache_ref_writes_slots_and_skips_padding():
    num_blocks, block_size, heads, dim = 3, 16, 2, 8
    cache = torch.zeros(num_blocks, 2, block_size, heads, dim)
    key = torch.randn(4, heads, dim)
    value = torch.randn(4, heads, dim)
    slots = torch.tensor([0, -1, 17, 47])
    reshape_and_cache_ref(key, value, cache, slots)
    for tok, slot in ((0, 0), (2, 17), (3, 47)):
        block, offset = divmod(slot, block_size)
        torch.testing.assert_close(cache[block, 0, offset], key[tok])
        torch.testing.assert_close(cache[block, 1, offset], value[tok])
    # Three slots written, K and V each: everything else is untouched.
    assert int((cache != 0).any(dim=-1).any(dim=-1).sum()) == 6


@pytest.mark.parametrize("seq_lens,query_lens", CASES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_paged_attention_ref_matches_dense(
    make_paged_batch, dense, seq_lens, query_lens, num_heads, num_kv_heads
):
    batch = make_paged_batch(seq_lens, query_lens, num_heads, num_kv_heads, 64, 16, torch.float32)
    out = paged_attention_ref(*(t.cpu() for t in batch.args()))
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), dense(batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim,block_size", [(64, 32), (128, 16)])
def test_paged_attention_ref_half_precision(
    make_paged_batch, dense, tol, dtype, head_dim, block_size
):
    batch = make_paged_batch([45, 9], [4, 1], 6, 2, head_dim, block_size, dtype)
    out = paged_attention_ref(*(t.cpu() for t in batch.args()), scale=0.1)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), dense(batch, scale=0.1), **tol(dtype))


def test_paged_attention_ref_writes_into_out(make_paged_batch):
    batch = make_paged_batch([20, 7], [2, 1], 4, 2, 64, 16, torch.float32)
    args = [t.cpu() for t in batch.args()]
    out = torch.zeros_like(args[0])
    returned = paged_attention_ref(*args, out=out)
    assert returned is out
    torch.testing.assert_close(out, paged_attention_ref(*args))


def test_merge_attn_states_ref_recombines_split_softmax():
    torch.manual_seed(0)
    num_tokens, heads, keys, dim = 3, 2, 40, 16
    scores = torch.randn(num_tokens, heads, keys)
    values = torch.randn(keys, dim)
    full = scores.softmax(-1) @ values  # (T, H, D)
    bounds = [(0, 15), (15, 16), (16, 40), (40, 40)]  # the last split sees no key
    parts, lses = [], []
    for lo, hi in bounds:
        s = scores[..., lo:hi]
        if hi > lo:
            parts.append(s.softmax(-1) @ values[lo:hi])
            lses.append(s.logsumexp(-1))
        else:
            parts.append(torch.full((num_tokens, heads, dim), float("nan")))
            lses.append(torch.full((num_tokens, heads), float("-inf")))
    merged = merge_attn_states_ref(torch.stack(parts, dim=2), torch.stack(lses, dim=2))
    torch.testing.assert_close(merged, full, atol=1e-5, rtol=1e-5)


def test_paged_attention_ref_rejects_bad_inputs(make_paged_batch):
    batch = make_paged_batch([8], [1], 4, 2, 64, 16, torch.float32)
    q, cache, cu, lens, tables = (t.cpu() for t in batch.args())
    with pytest.raises(KernelInputError) as err:
        paged_attention_ref(q.half(), cache, cu, lens, tables)
    assert err.value.arg == "query"
    with pytest.raises(KernelInputError, match="multiple"):
        paged_attention_ref(q[:, :3], cache, cu, lens, tables)
    with pytest.raises(KernelInputError) as err:
        paged_attention_ref(q, cache, cu, lens, tables.float())
    assert err.value.arg == "block_tables"
    with pytest.raises(KernelInputError) as err:
        paged_attention_ref(q, cache[:, :1], cu, lens, tables)
    assert err.value.arg == "kv_cache"
