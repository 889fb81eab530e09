"""Triton bitmask, RMSNorm and RoPE kernels against their torch references.

CPU-only machines run these under Triton's interpreter (see conftest).
"""

from __future__ import annotations

import pytest
import torch

from agentrt.kernels import (
    KernelInputError,
    apply_token_bitmask_ref,
    rms_norm_ref,
    rotary_embedding_ref,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def random_bitmask(rows: int, words: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=gen, dtype=torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [32, 100, 4096 + 77])
def test_bitmask_matches_ref_all_rows(tk, device, dtype, vocab):
    bitmask = random_bitmask(3, -(-vocab // 32), seed=vocab)
    logits = torch.randn(3, vocab).to(dtype)
    expect = logits.clone()
    apply_token_bitmask_ref(expect, bitmask)
    got = logits.clone().to(device)
    tk.apply_token_bitmask_triton(got, bitmask.to(device))
    assert torch.equal(got.cpu(), expect)
    assert 0 < int(torch.isneginf(expect).sum()) < expect.numel()


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_bitmask_indices_and_logits_wider_than_mask(tk, device, index_dtype):
    bitmask = random_bitmask(5, 3, seed=7)  # covers 96 tokens
    storage = torch.randn(5, 160)
    logits = storage[:, :130]  # row stride 160 > vocab 130: a strided view
    indices = torch.tensor([4, 1], dtype=index_dtype)
    expect = logits.clone()
    apply_token_bitmask_ref(expect, bitmask, indices)
    got_storage = storage.clone().to(device)
    tk.apply_token_bitmask_triton(got_storage[:, :130], bitmask.to(device), indices.to(device))
    assert torch.equal(got_storage[:, :130].cpu(), expect)
    assert torch.equal(got_storage[:, 130:].cpu(), storage[:, 130:])  # outside the view
    assert torch.isneginf(expect[[1, 4], 96:]).all()
    assert torch.equal(expect[[0, 2, 3]], logits[[0, 2, 3]])


def test_bitmask_rejects_mismatched_rows(tk, device):
    with pytest.raises(KernelInputError) as err:
        tk.apply_token_bitmask_triton(
            torch.zeros(2, 64, device=device), torch.zeros(3, 2, dtype=torch.int32, device=device)
        )
    assert err.value.arg == "bitmask"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm_matches_ref(tk, device, tol, dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(2, 5, hidden, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    out = tk.rms_norm_triton(x.to(device), weight.to(device), 1e-6)
    torch.testing.assert_close(out.cpu(), rms_norm_ref(x, weight, 1e-6), **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_matches_ref(tk, device, tol, dtype):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(7, 128, generator=gen).to(dtype)
    residual = torch.randn(7, 128, generator=gen).to(dtype)
    weight = torch.rand(128, generator=gen).to(dtype)
    out, new_residual = tk.rms_norm_triton(
        x.to(device), weight.to(device), 1e-5, residual=residual.to(device)
    )
    ref_out, ref_residual = rms_norm_ref(x, weight, 1e-5, residual=residual)
    torch.testing.assert_close(new_residual.cpu(), ref_residual, **tol(dtype))
    torch.testing.assert_close(out.cpu(), ref_out, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_size,rot_dim", [(64, 64), (128, 64)])
def test_rotary_matches_ref(tk, device, tol, dtype, is_neox, head_size, rot_dim):
    gen = torch.Generator().manual_seed(head_size + rot_dim)
    tokens, q_heads, k_heads, max_pos = 6, 6, 2, 40
    angles = torch.rand(max_pos, rot_dim // 2, generator=gen) * 6
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1)  # (max_pos, rot_dim)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen)
    query = torch.randn(tokens, q_heads * head_size, generator=gen).to(dtype)
    key = torch.randn(tokens, k_heads, head_size, generator=gen).to(dtype)
    q_ref, k_ref = query.clone(), key.clone()
    rotary_embedding_ref(positions, q_ref, k_ref, cache, head_size, is_neox)
    q_got, k_got = query.clone().to(device), key.clone().to(device)
    tk.rotary_embedding_triton(
        positions.to(device), q_got, k_got, cache.to(device), head_size, is_neox
    )
    torch.testing.assert_close(q_got.cpu(), q_ref, **tol(dtype))
    torch.testing.assert_close(k_got.cpu(), k_ref, **tol(dtype))
    assert not torch.equal(q_ref, query)
    if rot_dim < head_size:  # the unrotated tail is untouched
        tail = q_ref.view(tokens, q_heads, head_size)[..., rot_dim:]
        assert torch.equal(tail, query.view(tokens, q_heads, head_size)[..., rot_dim:])


def test_rotary_strided_query_and_no_key(tk, device):
    # query as a slice of a fused qkv output (token stride 3 * 4 * 32), key=None.
    qkv = torch.randn(3, 3 * 4 * 32)
    cache = torch.randn(10, 32)
    positions = torch.tensor([1, 9, 0])
    ref = qkv.clone()
    rotary_embedding_ref(positions, ref[:, :128], None, cache, 32)
    got = qkv.clone().to(device)
    tk.rotary_embedding_triton(positions.to(device), got[:, :128], None, cache.to(device), 32)
    torch.testing.assert_close(got.cpu(), ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[:, 128:].cpu(), qkv[:, 128:])
