"""Triton kernel: unified varlen paged attention (prefill, chunked prefill and decode in one
launch), with an optional split-KV (flash-decoding) mode for long contexts and few queries.

Layout of one program: a tile of BLOCK_M rows = BLOCK_Q query tokens of one request x the
NUM_QUERIES_PER_KV query heads sharing one KV head (GQA), so each K/V tile loaded from the
cache serves every head of the group. Online softmax in fp32 (base-2 exponentials).
Imports Triton at module level; reference: `reference_attention.paged_attention_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_paged_attention
from .errors import KernelInputError
from .triton_merge_states import merge_attn_states_triton

_LOG2E = 1.4426950408889634
# Split-KV pays off only with few programs per SM and enough keys per split.
_MIN_KEYS_PER_SPLIT = 512
_MAX_SPLITS = 32


@triton.jit
def _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q: tl.constexpr):
    # Request r owns global query blocks [start_r // BLOCK_Q + r, ...): the "+ r" gives every
    # request at least one block, so a binary search for the last r at or below q_block works.
    lo: tl.int32 = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    query_ptr,
    kv_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    qk_scale,  # softmax scale * log2(e)
    num_reqs,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_cache_block,
    stride_cache_kv,
    stride_cache_slot,
    stride_cache_head,
    stride_bt_req,
    stride_po_tok,
    stride_po_head,
    stride_po_split,
    stride_pl_tok,
    stride_pl_head,
    NUM_QUERIES_PER_KV: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_FP32: tl.constexpr,  # fp32 operands, exact dots: for fp32 inputs (no TF32)
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + req)
    if q_block_local * BLOCK_Q >= q_len:
        return  # spare block of the upper-bound grid
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len  # positions before the first query token

    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_DIM)
    q_idx = q_block_local * BLOCK_Q + rows // NUM_QUERIES_PER_KV  # query index in request
    head = kv_head * NUM_QUERIES_PER_KV + rows % NUM_QUERIES_PER_KV
    row_ok = (rows < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_idx < q_len)
    dim_ok = dims < HEAD_DIM
    q_tok = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        query_ptr + q_tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )  # (BLOCK_M, BLOCK_DIM)
    q_pos = context_len + q_idx  # absolute position of each row's query token

    # Keys this query block can see: up to its last query token (causal).
    kv_len = context_len + tl.minimum((q_block_local + 1) * BLOCK_Q, q_len)
    num_tiles = tl.cdiv(kv_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DIM], dtype=tl.float32)
    cols = tl.arange(0, TILE_N)
    cache_head = kv_cache_ptr + kv_head * stride_cache_head
    for tile in range(tile_lo, tile_hi):
        k_pos = tile * TILE_N + cols
        k_ok = k_pos < kv_len
        block_id = tl.load(
            block_tables_ptr + req * stride_bt_req + k_pos // BLOCK_SIZE, mask=k_ok, other=0
        ).to(tl.int64)
        slot = block_id * stride_cache_block + (k_pos % BLOCK_SIZE) * stride_cache_slot
        k = tl.load(
            cache_head + slot[None, :] + dims[:, None],
            mask=k_ok[None, :] & dim_ok[:, None],
            other=0.0,
        )  # (BLOCK_DIM, TILE_N)
        v = tl.load(
            cache_head + stride_cache_kv + slot[:, None] + dims[None, :],
            mask=k_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )  # (TILE_N, BLOCK_DIM)
        if DOT_FP32:
            s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * qk_scale  # (BLOCK_M, TILE_N), log2 domain
        visible = row_ok[:, None] & (k_pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    has_keys = l_i > 0.0
    result = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    out_mask = row_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        dst = out_ptr + q_tok[:, None] * stride_o_tok + head[:, None] * stride_o_head
        tl.store(dst + dims[None, :], result.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Natural-log sum-exp of this split's scores; -inf when the split saw no key.
        log2_sum = m_i + tl.log2(tl.where(has_keys, l_i, 1.0))
        lse = tl.where(has_keys, log2_sum * 0.6931471805599453, float("-inf"))
        dst = (
            partial_out_ptr
            + q_tok[:, None] * stride_po_tok
            + head[:, None] * stride_po_head
            + split * stride_po_split
        )
        tl.store(dst + dims[None, :], result, mask=out_mask)
        lse_dst = partial_lse_ptr + q_tok * stride_pl_tok + head * stride_pl_head + split
        tl.store(lse_dst, lse, mask=row_ok)


def paged_attention_triton(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Triton version of `paged_attention_ref` (same arguments and result).

    max_query_len / max_seq_len avoid a device sync when given. num_splits forces the number
    of KV splits (1 = no split); None picks it from the batch shape and the SM count.
    """
    check_paged_attention(query, kv_cache, query_start_loc, seq_lens, block_tables, out)
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    if out is None:
        out = torch.empty_like(query)
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out
    if scale is None:
        scale = head_dim**-0.5
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    group = num_heads // num_kv_heads
    # Rows of a tile = BLOCK_Q tokens x group heads; tl.dot needs at least 16 rows.
    wide = max_query_len * group >= 64
    block_m = max(64 if wide else 16, triton.next_power_of_2(group))
    block_q = block_m // group
    block_dim = triton.next_power_of_2(head_dim)
    tile_n = 64 if block_dim <= 128 else 32
    if num_splits is None:
        num_splits = _auto_num_splits(
            query, seq_lens, max_query_len, max_seq_len, block_q, num_reqs * num_kv_heads
        )
    if num_splits < 1:
        raise KernelInputError(f"num_splits must be >= 1, got {num_splits}.", arg="num_splits")
    if num_splits > 1:
        partial_out = torch.empty(
            num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device
        )
        partial_lse = torch.empty(
            num_tokens, num_heads, num_splits, dtype=torch.float32, device=query.device
        )
    else:  # unused by the kernel; any tensor satisfies the signature
        partial_out, partial_lse = out, out
    num_q_blocks = num_tokens // block_q + num_reqs  # upper bound; spare programs exit
    _paged_attention_kernel[(num_q_blocks, num_kv_heads, num_splits)](
        out,
        query,
        kv_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        partial_out,
        partial_lse,
        scale * _LOG2E,
        num_reqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_tables.stride(0),
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2) if num_splits > 1 else 0,
        partial_lse.stride(0),
        partial_lse.stride(1),
        NUM_QUERIES_PER_KV=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_DIM=block_dim,
        NUM_SPLITS=num_splits,
        DOT_FP32=query.dtype == torch.float32 or _interpreted_bf16(query.dtype),
    )
    if num_splits > 1:
        merge_attn_states_triton(partial_out, partial_lse, out)
    return out


def _interpreted_bf16(dtype: torch.dtype) -> bool:
    # Triton's CPU interpreter stores bf16 as uint16 and its tl.dot multiplies those integers;
    # under the interpreter, bf16 dots therefore run on fp32 copies of the operands.
    return dtype == torch.bfloat16 and not isinstance(_paged_attention_kernel, triton.JITFunction)


def _auto_num_splits(
    query: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    max_seq_len: int | None,
    block_q: int,
    num_programs: int,
) -> int:
    """Flash-decoding split count: only for decode-like batches on a GPU whose SMs the
    unsplit grid would leave idle."""
    if query.device.type != "cuda" or max_query_len > block_q:
        return 1
    num_sms = torch.cuda.get_device_properties(query.device).multi_processor_count
    if num_programs >= 2 * num_sms:
        return 1
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item())
    by_length = max_seq_len // _MIN_KEYS_PER_SPLIT
    by_occupancy = -(-2 * num_sms // num_programs)
    return max(1, min(_MAX_SPLITS, by_length, by_occupancy))
