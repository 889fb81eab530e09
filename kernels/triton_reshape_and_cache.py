"""Triton kernel: scatter a flat batch of K/V into the paged KV cache through slot_mapping.

Imports Triton at module level: load this module only through `agentrt.kernels` dispatch
(on CUDA) or explicitly in tests. Reference: `reference_attention.reshape_and_cache_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_reshape_and_cache


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    kv_cache_ptr,
    slot_mapping_ptr,
    stride_key_tok,
    stride_key_head,
    stride_value_tok,
    stride_value_head,
    stride_cache_block,
    stride_cache_kv,
    stride_cache_slot,
    stride_cache_head,
    num_kv_heads,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
):
    # One program per token: copies its [num_kv_heads, head_dim] K and V rows.
    tok = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:  # padding token
        return
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_HEADS)
    dims = tl.arange(0, BLOCK_DIM)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < HEAD_DIM)
    src_k = key_ptr + tok.to(tl.int64) * stride_key_tok + heads[:, None] * stride_key_head
    src_v = value_ptr + tok.to(tl.int64) * stride_value_tok + heads[:, None] * stride_value_head
    k = tl.load(src_k + dims[None, :], mask=mask)
    v = tl.load(src_v + dims[None, :], mask=mask)
    dst = (
        kv_cache_ptr
        + block_id * stride_cache_block
        + offset * stride_cache_slot
        + heads[:, None] * stride_cache_head
        + dims[None, :]
    )
    elem_ty = kv_cache_ptr.dtype.element_ty
    tl.store(dst, k.to(elem_ty), mask=mask)
    tl.store(dst + stride_cache_kv, v.to(elem_ty), mask=mask)


def reshape_and_cache_triton(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Triton version of `reshape_and_cache_ref` (same arguments, same effect)."""
    check_reshape_and_cache(key, value, kv_cache, slot_mapping)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        num_kv_heads,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_HEADS=triton.next_power_of_2(num_kv_heads),
        BLOCK_DIM=triton.next_power_of_2(head_dim),
    )
