"""Triton kernel: merge split-KV partial attention results by their log-sum-exp weights.

Second stage of flash-decoding (`triton_paged_attention` with num_splits > 1).
Imports Triton at module level; reference: `reference_attention.merge_attn_states_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_dtype, check_last_dim_contiguous, check_ndim
from .errors import KernelInputError


@triton.jit
def _merge_attn_states_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    num_splits,
    stride_o_tok,
    stride_o_head,
    stride_po_tok,
    stride_po_head,
    stride_po_split,
    stride_pl_tok,
    stride_pl_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
):
    # One program per (token, head): out = sum_s w_s * o_s / sum_s w_s, w_s = exp(lse_s - max).
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_SPLITS)
    dims = tl.arange(0, BLOCK_DIM)
    split_ok = splits < num_splits
    lse = tl.load(
        partial_lse_ptr + tok * stride_pl_tok + head * stride_pl_head + splits,
        mask=split_ok,
        other=float("-inf"),
    )
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp(lse - lse_max)  # (BLOCK_SPLITS,); 0 for empty or padded splits
    src = partial_out_ptr + tok * stride_po_tok + head * stride_po_head
    parts = tl.load(
        src + splits[:, None] * stride_po_split + dims[None, :],
        mask=(weights > 0.0)[:, None] & (dims < HEAD_DIM)[None, :],
        other=0.0,
    )  # (BLOCK_SPLITS, BLOCK_DIM)
    total = tl.maximum(tl.sum(weights, axis=0), 1.1754943508222875e-38)
    merged = tl.sum(parts * weights[:, None], axis=0) / total
    dst = out_ptr + tok * stride_o_tok + head * stride_o_head + dims
    tl.store(dst, merged.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def merge_attn_states_triton(
    partial_out: torch.Tensor, partial_lse: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Triton version of `merge_attn_states_ref`; writes into `out` ([T, H, D], any float
    dtype) when given, else returns a new fp32 tensor."""
    check_ndim("partial_out", partial_out, 4, "[num_tokens, num_heads, num_splits, head_dim]")
    check_ndim("partial_lse", partial_lse, 3, "[num_tokens, num_heads, num_splits]")
    check_dtype("partial_out", partial_out, (torch.float32,))
    check_dtype("partial_lse", partial_lse, (torch.float32,))
    check_last_dim_contiguous("partial_out", partial_out)
    check_last_dim_contiguous("partial_lse", partial_lse)
    num_tokens, num_heads, num_splits, head_dim = partial_out.shape
    if tuple(partial_lse.shape) != (num_tokens, num_heads, num_splits):
        raise KernelInputError(
            f"partial_lse has shape {tuple(partial_lse.shape)}; expected "
            f"{(num_tokens, num_heads, num_splits)} to match partial_out.",
            arg="partial_lse",
        )
    if out is None:
        out = torch.empty(num_tokens, num_heads, head_dim, device=partial_out.device)
    elif tuple(out.shape) != (num_tokens, num_heads, head_dim):
        raise KernelInputError(
            f"out has shape {tuple(out.shape)}; expected {(num_tokens, num_heads, head_dim)}.",
            arg="out",
        )
    check_last_dim_contiguous("out", out)
    if num_tokens == 0:
        return out
    _merge_attn_states_kernel[(num_tokens, num_heads)](
        out,
        partial_out,
        partial_lse,
        num_splits,
        out.stride(0),
        out.stride(1),
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_DIM=triton.next_power_of_2(head_dim),
        BLOCK_SPLITS=triton.next_power_of_2(max(num_splits, 2)),
    )
    return out
