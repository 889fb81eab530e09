"""The torch references for bitmask, RMSNorm and RoPE against naive formulas."""

from __future__ import annotations

import math

import pytest
import torch

from agentrt.kernels import (
    KernelInputError,
    apply_token_bitmask_ref,
    rms_norm_ref,
    rotary_embedding_ref,
)


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """bool [rows, vocab] -> int32 [rows, ceil(vocab / 32)], bit i % 32 of word i // 32."""
    rows, vocab = allowed.shape
    words = torch.zeros(rows, -(-vocab // 32), dtype=torch.int64)
    for r in range(rows):
        for t in range(vocab):
            if allowed[r, t]:
                words[r, t // 32] |= 1 << (t % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_bitmask_ref_masks_exactly_the_disallowed_tokens():
    gen = torch.Generator().manual_seed(0)
    vocab = 77  # not a multiple of 32
    allowed = torch.rand(3, vocab, generator=gen) < 0.5
    allowed[1, 31] = True  # bit 31 makes the word negative
    logits = torch.randn(3, vocab, generator=gen)
    masked = logits.clone()
    apply_token_bitmask_ref(masked, pack_bitmask(allowed))
    assert torch.equal(masked[allowed], logits[allowed])
    assert torch.isneginf(masked[~allowed]).all()


def test_bitmask_ref_indices_and_wider_logits():
    gen = torch.Generator().manual_seed(1)
    allowed = torch.rand(4, 64, generator=gen) < 0.3
    logits = torch.randn(4, 100, generator=gen)  # 36 columns beyond the mask
    masked = logits.clone()
    apply_token_bitmask_ref(masked, pack_bitmask(allowed), torch.tensor([2, 0]))
    for row in (1, 3):
        assert torch.equal(masked[row], logits[row])
    for row in (0, 2):
        assert torch.equal(masked[row, :64][allowed[row]], logits[row, :64][allowed[row]])
        assert torch.isneginf(masked[row, :64][~allowed[row]]).all()
        assert torch.isneginf(masked[row, 64:]).all()


def test_bitmask_ref_rejects_wrong_dtype():
    with pytest.raises(KernelInputError) as err:
        apply_token_bitmask_ref(torch.zeros(1, 32), torch.zeros(1, 1, dtype=torch.int64))
    assert err.value.arg == "bitmask"


def test_tensors_on_two_devices_are_rejected_by_name():
    # A mask built on the CPU for logits on the GPU (meta stands in for it) names both.
    logits = torch.zeros(2, 64, device="meta")
    with pytest.raises(KernelInputError, match=r"\(logits=meta, bitmask=cpu\)"):
        apply_token_bitmask_ref(logits, torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(KernelInputError, match=r"\(x=cpu, weight=cpu, residual=meta\)"):
        rms_norm_ref(torch.ones(1, 8), torch.ones(8), 1e-6, torch.ones(1, 8, device="meta"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_ref_matches_hf_llama(dtype):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 48, generator=gen).to(dtype)
    residual = torch.randn(2, 3, 48, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(48, generator=gen)).to(dtype)

    def hf(h):  # LlamaRMSNorm.forward
        hf32 = h.to(torch.float32)
        hf32 = hf32 * torch.rsqrt(hf32.pow(2).mean(-1, keepdim=True) + 1e-5)
        return weight * hf32.to(dtype)

    assert torch.equal(rms_norm_ref(x, weight, 1e-5), hf(x))
    out, new_residual = rms_norm_ref(x, weight, 1e-5, residual=residual)
    assert torch.equal(new_residual, x + residual)
    assert torch.equal(out, hf(x + residual))


@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_ref_matches_complex_rotation(is_neox):
    gen = torch.Generator().manual_seed(3)
    tokens, heads, head_size, rot_dim, base = 5, 3, 16, 8, 10000.0
    half = rot_dim // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float64) * 2 / rot_dim)
    angles = torch.arange(32, dtype=torch.float64)[:, None] * inv_freq  # (max_pos, half)
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1).float()
    positions = torch.tensor([0, 7, 3, 31, 7])
    query = torch.randn(tokens, heads * head_size, generator=gen)
    key = torch.randn(tokens, 1, head_size, generator=gen)
    q_out, k_out = query.clone(), key.clone()
    rotary_embedding_ref(positions, q_out, k_out, cache, head_size, is_neox=is_neox)
    for src, got in ((query.view(tokens, -1, head_size), q_out.view(tokens, -1, head_size)),
                     (key, k_out)):  # fmt: skip
        for t in range(tokens):
            for h in range(src.shape[1]):
                vec = src[t, h].double()
                expect = vec.clone()
                for i in range(half):
                    a, b = (i, i + half) if is_neox else (2 * i, 2 * i + 1)
                    z = complex(vec[a], vec[b]) * complex(
                        math.cos(angles[positions[t], i]), math.sin(angles[positions[t], i])
                    )
                    expect[a], expect[b] = z.real, z.imag
                torch.testing.assert_close(got[t, h].double(), expect, atol=1e-5, rtol=1e-5)
