"""Attention that the torch and triton backends' kernels do not compute, over the same paged
cache: sliding windows (Gemma's local layers) and soft-capped scores (Gemma 2), in torch, one
request at a time. Any backend's cache layout (engine/worker/attention.py's). The 'cpu'
backend's C kernel takes both itself (its `takes_windows`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from agentrt.engine.records import AttentionMetadata
from agentrt.engine.worker.attention import write_kv


def windowed_attention(
    query: torch.Tensor,  # (T, H, D)
    key: torch.Tensor,  # (T, KVH, D)
    value: torch.Tensor,  # (T, KVH, D)
    kv_cache: torch.Tensor,  # (NB, 2, BS, KVH, D)
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Sliding-window attention of a step (any backend's cache layout): the query at
    position p sees the keys at positions p - window < j <= p (transformers' sliding
    window; None: every earlier key). Writes the step's K/V, then one attention call per
    request over the blocks that hold its window only: blocks wholly before it are never
    read, so the KV manager may free them. `softcap` (Gemma 2): the scores become
    softcap * tanh(scores / softcap) before the softmax, which SDPA cannot do, so they are
    computed as matrix products (transformers' eager attention). The pure-torch path of the
    backends whose kernels take neither (the Triton kernel)."""
    if meta.key_rows is None:  # the triton backend derives none
        meta.key_rows = meta.key_cache_rows()
    write_kv(kv_cache, key, value, meta)
    out = torch.empty_like(query)
    bs, kv_heads, head_dim = meta.block_size, kv_cache.shape[3], kv_cache.shape[4]
    window = window or meta.max_seq_len + 1  # no window: every key
    start = 0
    for row, num_queries in enumerate(meta.query_lens):
        seq_len = meta.context_lens[row] + num_queries
        first, mask = _window_mask(meta, row, window, query.dtype)
        first_block = first // bs
        blocks = meta.block_tables[row, first_block : -(-seq_len // bs)].long()
        lo, hi = first - first_block * bs, seq_len - first_block * bs
        k = kv_cache[:, 0].index_select(0, blocks).view(-1, kv_heads, head_dim)[lo:hi]
        v = kv_cache[:, 1].index_select(0, blocks).view(-1, kv_heads, head_dim)[lo:hi]
        q = query[start : start + num_queries].transpose(0, 1)  # (H, Tq, D)
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # (KVH, L, D)
        if softcap is None:
            gqa = q.shape[0] != k.shape[0]
            o = F.scaled_dot_product_attention(
                q[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=gqa
            )[0]
        else:
            o = _softcapped(q, k, v, mask, scale, softcap)
        out[start : start + num_queries] = o.transpose(0, 1)
        start += num_queries
    return out


def _softcapped(q, k, v, mask, scale: float, softcap: float) -> torch.Tensor:
    """q (H, Tq, D) over k, v (KVH, L, D) with soft-capped scores, as transformers' eager
    attention: scores * scale, capped, masked, softmax in fp32, times v."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)  # (H, L, D)
    scores = torch.matmul(q, k.transpose(1, 2)) * scale  # (H, Tq, L)
    scores = torch.tanh(scores / softcap) * softcap + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)  # (H, Tq, D)


def _window_mask(
    meta: AttentionMetadata, row: int, window: int, dtype: torch.dtype
) -> tuple[int, torch.Tensor]:
    """(first key position, additive mask (Tq, keys from it)) of request `row`'s queries
    under a sliding window; built once per step and window."""
    cached = meta.window_masks.get((row, window))
    if cached is None:
        context, seq_len = meta.context_lens[row], meta.context_lens[row] + meta.query_lens[row]
        first = max(0, context - window + 1)  # the first key the chunk's first query sees
        device = meta.seq_lens.device
        keys = torch.arange(first, seq_len, device=device)
        queries = torch.arange(context, seq_len, device=device)
        hidden = (keys[None, :] > queries[:, None]) | (keys[None, :] <= queries[:, None] - window)
        mask = torch.zeros(hidden.shape, dtype=dtype, device=device)
        mask.masked_fill_(hidden, float("-inf"))
        cached = meta.window_masks[(row, window)] = (first, mask)
    return cached
