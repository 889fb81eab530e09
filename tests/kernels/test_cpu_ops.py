"""The fused CPU glue of quantized layers (kernels/cpu_ops.c) against its torch references:
bf16 outputs within one bf16 rounding step (the kernels sum in another order), fp32 outputs
and the KV cache within fp32 rounding; one row (a decode) and many (the threaded path)."""

from __future__ import annotations

import pytest
import torch

from agentrt.engine import envs
from agentrt.kernels import KernelInputError, load_cpu_ops
from agentrt.kernels.cpu_ops import (
    add_rms_norm_ref,
    gelu_tanh_mul_ref,
    rope_qkv_ref,
    silu_mul_ref,
)

BF16_STEP = 2**-7  # relative distance of neighbouring bf16 values


@pytest.fixture(scope="module")
def ops():
    return load_cpu_ops(envs.cache_dir() / "kernels")


def _close_bf16(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(
        actual.float(), expected.float(), rtol=BF16_STEP, atol=1e-6, check_dtype=False
    )


@pytest.mark.parametrize("rows", [1, 17])
@pytest.mark.parametrize("with_x,x_scale", [(True, 1.0), (False, 1.0), (True, 0.22)])
def test_add_rms_norm(ops, rows, with_x, x_scale):
    g = torch.Generator().manual_seed(rows)
    residual = torch.randn(rows, 576, generator=g) * 3
    x = (torch.randn(rows, 576, generator=g) * 5).bfloat16() if with_x else None
    weight = torch.rand(576, generator=g) + 0.5
    expected_residual = residual.clone()
    expected = add_rms_norm_ref(x, expected_residual, weight, 1e-5, x_scale)
    out = ops.add_rms_norm(x, residual, weight, 1e-5, x_scale)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 576)
    # The same adds; a scaled x may be one fused multiply-add in C (one rounding, not two).
    exact = dict(rtol=0, atol=0) if x_scale == 1.0 else dict(rtol=2e-7, atol=1e-6)
    torch.testing.assert_close(residual, expected_residual, **exact)
    _close_bf16(out, expected)


@pytest.mark.parametrize("rows", [1, 17])
@pytest.mark.parametrize("with_weight", [True, False])
def test_add_rms_norm_of_a_normed_branch(ops, rows, with_weight):
    """Gemma's and OLMo 2's post-norms: x is normalised (x_norm) before it joins the
    residual; OLMo 2 has no norm on the sum (weight None: the sum itself, rounded)."""
    g = torch.Generator().manual_seed(rows)
    residual = torch.randn(rows, 576, generator=g) * 3
    x = (torch.randn(rows, 576, generator=g) * 40).bfloat16()
    x_norm = torch.rand(576, generator=g) + 0.5
    weight = torch.rand(576, generator=g) + 0.5 if with_weight else None
    expected_residual = residual.clone()
    expected = add_rms_norm_ref(x, expected_residual, weight, 1e-6, x_norm=x_norm)
    before = residual.clone()
    out = ops.add_rms_norm(x, residual, weight, 1e-6, x_norm=x_norm)
    # fp32 rounding: the norm of x sums in another order.
    torch.testing.assert_close(residual, expected_residual, rtol=1e-5, atol=1e-5)
    _close_bf16(out, expected)
    # The branch joined at the norm's scale (RMS of x_norm's order), not at x's (40).
    assert float((residual - before).pow(2).mean().sqrt()) < 2.0


@pytest.mark.parametrize("extras", ["none", "bias", "qk_norm", "both", "qk_norm_all_heads"])
@pytest.mark.parametrize("tokens", [1, 9])
def test_rope_qkv_rotates_and_writes_the_cache(ops, tokens, extras):
    """Llama's rotation; with Qwen2's qkv bias and / or Qwen3's per-head q/k RMSNorm first,
    or OLMo 2's q/k RMSNorm over all heads."""
    heads, kv_heads, dim, block_size, num_blocks = 9, 3, 64, 16, 4
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).bfloat16()
    kw = {}
    if extras in ("bias", "both"):
        kw["bias"] = torch.randn(qkv.shape[1], generator=g) * 2
    if extras in ("qk_norm", "both"):
        kw["q_norm"] = torch.rand(dim, generator=g) + 0.5
        kw["k_norm"] = torch.rand(dim, generator=g) + 0.5
        kw["eps"] = 1e-6
        qkv[0, :dim] *= 50  # a head far from unit scale: normalised all the same
    if extras == "qk_norm_all_heads":
        kw["q_norm"] = torch.rand(heads * dim, generator=g) + 0.5
        kw["k_norm"] = torch.rand(kv_heads * dim, generator=g) + 0.5
        kw["eps"], kw["norm_all_heads"] = 1e-6, True
        qkv[0, :dim] *= 50  # one loud head: over all heads, it keeps its loudness
    angles = torch.rand(100, dim // 2, generator=g) * 6
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
    positions = torch.randperm(100, generator=g)[:tokens]
    # Slots spread over the blocks: block b's K rows start at b * 2 * block_size.
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    key_rows = slots // block_size * 2 * block_size + slots % block_size
    cache = torch.zeros(num_blocks, 2, block_size, kv_heads, dim)
    expected_cache = cache.clone()
    expected = rope_qkv_ref(qkv, expected_cache, key_rows, positions, cos_sin, heads, **kw)
    query = ops.rope_qkv(qkv, cache, key_rows, positions, cos_sin, heads, **kw)
    assert query.shape == (tokens, heads, dim) and query.dtype == torch.float32
    torch.testing.assert_close(query, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cache, expected_cache, rtol=1e-6, atol=1e-6)
    if extras == "none":
        return
    # The bias or the norms change every head (the reference without them is far off).
    plain = rope_qkv_ref(qkv, cache.clone(), key_rows, positions, cos_sin, heads)
    assert ((query - plain).abs().amax(-1) > 1e-3).all()
    if extras == "qk_norm_all_heads":  # the token's whole query is normalised, not each head
        loud, quiet = query[0, 0].pow(2).mean().sqrt(), query[0, 1:].pow(2).mean().sqrt()
        assert loud > 5 * quiet
    elif "q_norm" in kw:  # each rotated head's RMS is its weight's (rotation keeps pairs' norms)
        rms = query.pow(2).mean(-1).sqrt()
        bound = float(kw["q_norm"].max()) + 1e-4
        assert (rms < bound).all() and (rms > float(kw["q_norm"].min()) - 1e-4).all()
    assert int((cache != 0).any(-1).any(-1).sum()) == 2 * tokens  # only the step's rows


@pytest.mark.parametrize("rows,size", [(1, 1536), (12, 40)])  # 40: a tail past 16 lanes
def test_silu_mul(ops, rows, size):
    g = torch.Generator().manual_seed(size)
    gate_up = (torch.randn(rows, 2 * size, generator=g) * 8).bfloat16()
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])  # far tails, and zero
    _close_bf16(ops.silu_mul(gate_up), silu_mul_ref(gate_up))


@pytest.mark.parametrize("rows,size", [(1, 6912), (12, 40)])  # Gemma 3 1B's FFN; a tail
def test_gelu_tanh_mul(ops, rows, size):
    g = torch.Generator().manual_seed(size)
    gate_up = (torch.randn(rows, 2 * size, generator=g) * 4).bfloat16()
    gate_up[0, :5] = torch.tensor([-200.0, 200.0, 0.0, -0.0, 1e-3])  # far tails, zero, tiny
    expected = gelu_tanh_mul_ref(gate_up)
    # C computes g * sigmoid(2 y), torch 0.5 g (1 + tanh(y)), whose 1 + tanh cancels for
    # gates below -3 (|result| < 1e-5): that far, the two differ by torch's rounding.
    torch.testing.assert_close(
        ops.gelu_tanh_mul(gate_up).float(), expected.float(), rtol=BF16_STEP, atol=1e-5
    )
    assert not torch.equal(expected, silu_mul_ref(gate_up))  # another activation


def test_bad_input_is_refused(ops):
    residual, weight = torch.zeros(2, 8), torch.ones(8)
    with pytest.raises(KernelInputError, match="x: got torch.float32"):
        ops.add_rms_norm(torch.zeros(2, 8), residual, weight, 1e-5)
    with pytest.raises(KernelInputError, match="weight"):
        ops.add_rms_norm(None, residual, torch.ones(4), 1e-5)
    with pytest.raises(KernelInputError, match="gate_up"):
        ops.silu_mul(torch.zeros(2, 7, dtype=torch.bfloat16))
    with pytest.raises(KernelInputError, match="gate_up"):
        ops.gelu_tanh_mul(torch.zeros(2, 8))
    with pytest.raises(KernelInputError, match="x_norm"):
        ops.add_rms_norm(None, residual, weight, 1e-5, x_norm=torch.ones(7))
    cache = torch.zeros(2, 2, 16, 1, 16)
    qkv = torch.zeros(1, 3 * 16, dtype=torch.bfloat16)
    cos_sin = torch.zeros(10, 16)
    ok = torch.tensor([0]), torch.tensor([3])
    ops.rope_qkv(qkv, cache, *ok, cos_sin, 1)
    with pytest.raises(KernelInputError, match="out of range"):
        ops.rope_qkv(qkv, cache, torch.tensor([48]), torch.tensor([3]), cos_sin, 1)
    with pytest.raises(KernelInputError, match="out of range"):
        ops.rope_qkv(qkv, cache, torch.tensor([0]), torch.tensor([10]), cos_sin, 1)
    with pytest.raises(KernelInputError, match="positions"):
        ops.rope_qkv(
            qkv, cache, torch.tensor([0]), torch.tensor([3], dtype=torch.int32), cos_sin, 1
        )
    with pytest.raises(KernelInputError, match="bias"):
        ops.rope_qkv(qkv, cache, *ok, cos_sin, 1, bias=torch.zeros(3 * 16 - 1))
    with pytest.raises(KernelInputError, match="both or neither"):
        ops.rope_qkv(qkv, cache, *ok, cos_sin, 1, q_norm=torch.ones(16))
    with pytest.raises(KernelInputError, match="k_norm"):
        ops.rope_qkv(
            qkv, cache, *ok, cos_sin, 1, q_norm=torch.ones(16), k_norm=torch.ones(16).double()
        )
    all_heads = dict(q_norm=torch.ones(32), k_norm=torch.ones(16), norm_all_heads=True)
    with pytest.raises(KernelInputError, match="q_norm"):  # over all (1) heads: (H D,) = (16,)
        ops.rope_qkv(qkv, cache, *ok, cos_sin, 1, **all_heads)
