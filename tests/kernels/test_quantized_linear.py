"""The quantized linear kernels (torch's int8 / int4 CPU ops) against their fp32 references,
and the quantizers' round trips.

Tolerance: the kernels return bf16, so each output may be off by bf16 rounding of itself
(2^-8 relative) plus fp32 summation order; we allow 1% of the output's largest magnitude.
"""

from __future__ import annotations

import pytest
import torch

from agentrt.kernels.errors import KernelInputError
from agentrt.kernels.quantized_linear import (
    Int4Weight,
    int4_linear,
    int4_linear_ref,
    int8_linear,
    int8_linear_ref,
    pack_int4,
    quantize_int4,
    quantize_int8,
)


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen) * 0.05


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == torch.bfloat16
    atol = 0.01 * ref.abs().max().item()
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=0.01)


@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_int8_kernel_matches_reference(rows, in_dtype):
    q, scale = quantize_int8(_weight(96, 128))
    x = torch.randn(rows, 128).to(in_dtype)
    _close(int8_linear(x, q, scale.bfloat16()), int8_linear_ref(x, q, scale.bfloat16()))


@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_kernel_matches_reference(rows, group_size):
    weight = quantize_int4(_weight(96, 192), group_size)
    packed, scales_and_zeros = pack_int4(weight)
    x = torch.randn(rows, 192)
    out = int4_linear(x, packed, scales_and_zeros, group_size)
    _close(out, int4_linear_ref(x, weight))


def test_int4_reference_is_the_dequantized_weight_up_to_bf16_scales():
    """The reference's weight differs from `dequantize()` only by the bf16 rounding of the
    scales and zeros the kernel holds: at most a few bf16 steps of the group's magnitude."""
    weight = quantize_int4(_weight(64, 128))
    x = torch.eye(128)
    held = int4_linear_ref(x, weight).T  # (N, K): the kernel's weight
    exact = weight.dequantize()
    bound = 3 * 2**-8 * (weight.min.abs() + 16 * weight.scale).repeat_interleave(32, dim=1)
    assert ((held - exact).abs() <= bound).all()


def test_quantizer_error_is_at_most_half_a_step():
    w = _weight(64, 128)
    q, scale = quantize_int8(w)
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all()
    int4 = quantize_int4(w)
    step = int4.scale.repeat_interleave(32, dim=1)
    assert ((int4.dequantize() - w).abs() <= step / 2 + 1e-6).all()


def test_requantizing_a_dequantized_int4_weight_gives_its_blocks_back():
    """llama.cpp's Q4_1 is min/max rounding too: a GGUF weight survives the round trip."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (32, 64), generator=gen, dtype=torch.uint8)
    q[:, ::32] = 0  # every block uses its whole range, as a quantized one does
    q[:, 1::32] = 15
    blocks = Int4Weight(q, torch.rand(32, 2, generator=gen) * 0.01, torch.randn(32, 2) * 0.05)
    again = quantize_int4(blocks.dequantize())
    assert torch.equal(again.q, blocks.q)
    torch.testing.assert_close(again.dequantize(), blocks.dequantize(), atol=1e-6, rtol=0)


def test_kernels_check_their_inputs():
    q, scale = quantize_int8(_weight(8, 64))
    with pytest.raises(KernelInputError, match="int8_linear"):
        int8_linear(torch.randn(2, 32), q, scale.bfloat16())
    with pytest.raises(KernelInputError, match="multiple of group_size"):
        quantize_int4(_weight(8, 48))
