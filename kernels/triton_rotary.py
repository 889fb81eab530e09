"""Triton kernel: rotary position embedding applied in place to query and key.

cos_sin_cache [max_position, rot_dim] holds cos in its first rot_dim / 2 columns and sin in
the rest (vLLM layout). Neox style rotates dim i with i + rot_dim / 2; GPT-J style rotates
2i with 2i + 1. Arithmetic in fp32, rounded once to the tensor dtype.
Imports Triton at module level; reference: `reference_ops.rotary_embedding_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_rotary


@triton.jit
def _rotate_heads(
    x_ptr,
    stride_tok,
    stride_head,
    tok,
    num_heads,
    cos,
    sin,
    half_ok,
    IS_NEOX: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HALF: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_HEADS)
    idx = tl.arange(0, BLOCK_HALF)
    if IS_NEOX:
        off1 = idx
        off2 = idx + HALF
    else:
        off1 = 2 * idx
        off2 = 2 * idx + 1
    base = x_ptr + tok * stride_tok + heads[:, None] * stride_head
    mask = (heads < num_heads)[:, None] & half_ok[None, :]
    x1 = tl.load(base + off1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + off2[None, :], mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    elem_ty = x_ptr.dtype.element_ty
    tl.store(base + off1[None, :], o1.to(elem_ty), mask=mask)
    tl.store(base + off2[None, :], o2.to(elem_ty), mask=mask)


@triton.jit
def _rotary_embedding_kernel(
    positions_ptr,
    query_ptr,
    key_ptr,
    cos_sin_cache_ptr,
    num_q_heads,
    num_k_heads,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_cache_pos,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_K_HEADS: tl.constexpr,
    IS_NEOX: tl.constexpr,
    HAS_KEY: tl.constexpr,
):
    # One program per token: all of its query heads, then all of its key heads.
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    idx = tl.arange(0, BLOCK_HALF)
    half_ok = idx < HALF
    row = cos_sin_cache_ptr + pos * stride_cache_pos
    cos = tl.load(row + idx, mask=half_ok, other=0.0).to(tl.float32)
    sin = tl.load(row + HALF + idx, mask=half_ok, other=0.0).to(tl.float32)
    _rotate_heads(
        query_ptr, stride_q_tok, stride_q_head, tok, num_q_heads, cos, sin, half_ok,
        IS_NEOX, BLOCK_Q_HEADS, BLOCK_HALF, HALF,
    )  # fmt: skip
    if HAS_KEY:
        _rotate_heads(
            key_ptr, stride_k_tok, stride_k_head, tok, num_k_heads, cos, sin, half_ok,
            IS_NEOX, BLOCK_K_HEADS, BLOCK_HALF, HALF,
        )  # fmt: skip


def rotary_embedding_triton(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    is_neox: bool = True,
) -> None:
    """Triton version of `rotary_embedding_ref` (same arguments, same in-place effect)."""
    check_rotary(positions, query, key, cos_sin_cache, head_size)
    num_tokens = positions.shape[0]
    if num_tokens == 0:
        return
    q = query.view(num_tokens, -1, head_size)  # (T, Hq, D), shares storage with query
    k = key.view(num_tokens, -1, head_size) if key is not None else q  # (T, Hk, D)
    half = cos_sin_cache.shape[1] // 2
    _rotary_embedding_kernel[(num_tokens,)](
        positions,
        q,
        k,
        cos_sin_cache,
        q.shape[1],
        k.shape[1],
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_Q_HEADS=triton.next_power_of_2(q.shape[1]),
        BLOCK_K_HEADS=triton.next_power_of_2(k.shape[1]),
        IS_NEOX=is_neox,
        HAS_KEY=key is not None,
    )
