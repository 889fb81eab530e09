"""Triton kernel: RMSNorm with an optional fused residual add (vLLM's fused_add_rms_norm).

Numerics follow HF Llama: the new residual is rounded to the input dtype, the norm is taken
in fp32 over it, cast to the input dtype, then multiplied by the weight.
Imports Triton at module level; reference: `reference_ops.rms_norm_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_rms_norm
from .errors import KernelInputError

# One program normalises one row held entirely in registers.
_MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    residual_out_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    hidden_size,
    eps,
    stride_x_row,
    stride_residual_row,
    stride_out_row,
    stride_residual_out_row,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_HIDDEN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_HIDDEN)
    ok = cols < hidden_size
    x = tl.load(x_ptr + row * stride_x_row + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_residual_row + cols, mask=ok, other=0.0)
        h = (x + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_residual_out_row + cols, h, mask=ok)
        x = h.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / hidden_size
    normed = (x * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    out = (w * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out_row + cols, out, mask=ok)


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `rms_norm_ref`: out, or (out, x + residual) with `residual`."""
    check_rms_norm(x, weight, residual)
    hidden_size = x.shape[-1]
    if hidden_size > _MAX_HIDDEN:
        raise KernelInputError(
            f"hidden size {hidden_size} exceeds the kernel's {_MAX_HIDDEN}; use rms_norm_ref.",
            arg="x",
        )
    x2 = x.reshape(-1, hidden_size)  # (rows, hidden)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, hidden_size)
    if residual is not None:
        residual2 = residual.reshape(-1, hidden_size)
        new_residual = torch.empty_like(out)
        new_residual2 = new_residual.view(-1, hidden_size)
    else:
        residual2 = new_residual2 = x2  # unused by the kernel
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            out2,
            new_residual2,
            x2,
            residual2,
            weight,
            hidden_size,
            eps,
            x2.stride(0),
            residual2.stride(0),
            out2.stride(0),
            new_residual2.stride(0),
            HAS_RESIDUAL=residual is not None,
            BLOCK_HIDDEN=triton.next_power_of_2(hidden_size),
        )
    return out if residual is None else (out, new_residual)
