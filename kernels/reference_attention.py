"""Pure-torch references for the attention kernels: KV-cache writes, paged attention and the
merge of split-KV partial results.

They define what the Triton kernels must compute, and they are the engine's CPU attention
path, so they are vectorised: one batched computation for all decode requests (query run of
1) and one per prefill request, never a Python loop per token. Attention runs in fp32
(torch SDPA with an explicit mask); outputs are cast back to the query dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .checks import check_paged_attention, check_reshape_and_cache

# Upper bound on the elements of one temporary score/context tensor (about 128 MiB in fp32).
_MAX_TEMP_ELEMENTS = 1 << 25


def reshape_and_cache_ref(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into kv_cache through slot_mapping.

    kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim]; slot = block_id *
    block_size + offset. Negative slots (padding tokens) are skipped. Mutates kv_cache only.
    """
    check_reshape_and_cache(key, value, kv_cache, slot_mapping)
    block_size = kv_cache.shape[2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    block_ids, offsets = slots // block_size, slots % block_size
    kv_cache[block_ids, 0, offsets] = key[valid].to(kv_cache.dtype)
    kv_cache[block_ids, 1, offsets] = value[valid].to(kv_cache.dtype)


def paged_attention_ref(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal varlen attention of a flat query batch over a paged KV cache.

    query: [num_tokens, num_heads, head_dim]; request i owns query rows
    query_start_loc[i]:query_start_loc[i + 1], which are the LAST positions of its
    seq_lens[i]-token context (their K/V are already in the cache). Query j of request i sits
    at position seq_lens[i] - query_len_i + j and attends to positions <= that.
    Returns out [num_tokens, num_heads, head_dim] (written into `out` when given).
    max_query_len / max_seq_len (the longest query run and context): given, they spare the
    Triton kernel a device sync; this reference ignores them.
    """
    del max_query_len, max_seq_len
    check_paged_attention(query, kv_cache, query_start_loc, seq_lens, block_tables, out)
    if scale is None:
        scale = query.shape[-1] ** -0.5
    if out is None:
        out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    query_lens = [starts[i + 1] - starts[i] for i in range(len(lens))]
    decode_reqs = [i for i, n in enumerate(query_lens) if n == 1]
    if decode_reqs:
        _decode_batch(query, kv_cache, starts, lens, block_tables, decode_reqs, scale, out)
    for i, n in enumerate(query_lens):
        if n > 1:
            q = query[starts[i] : starts[i] + n]
            k, v = _gather_context(kv_cache, block_tables[i], lens[i])
            out[starts[i] : starts[i] + n] = _attend_causal(q, k, v, scale)
    return out


def _gather_context(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one request's first seq_len positions, each [seq_len, num_kv_heads, head_dim]."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_blocks = -(-seq_len // block_size)
    table = block_table[:num_blocks].long()
    # Index the K and V views separately: one gather each, already contiguous.
    k = kv_cache[:, 0][table].view(num_blocks * block_size, num_kv_heads, head_dim)
    v = kv_cache[:, 1][table].view(num_blocks * block_size, num_kv_heads, head_dim)
    return k[:seq_len], v[:seq_len]


def _attend_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, H, D] at the last n of the L positions of k/v [L, Hkv, D]; returns [n, H, D].

    GQA without copying K/V: the group's query heads are folded into the query-row axis,
    so each KV head is one SDPA batch entry. fp32 throughout, rounded once at the end.
    """
    n, num_heads, head_dim = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    kf = k.float().transpose(0, 1).unsqueeze(0)  # (1, Hkv, L, D)
    vf = v.float().transpose(0, 1).unsqueeze(0)
    key_pos = torch.arange(seq_len, device=q.device)
    out = torch.empty_like(q)
    # Chunk the query rows so a materialised [Hkv, group * rows, L] score tensor stays bounded.
    rows = max(1, _MAX_TEMP_ELEMENTS // (num_heads * seq_len))
    for r0 in range(0, n, rows):
        qc = q[r0 : r0 + rows].float()
        m = qc.shape[0]
        qg = qc.view(m, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # (Hkv, G, m, D)
        qg = qg.reshape(1, num_kv_heads, group * m, head_dim)  # (1, Hkv, G*m, D)
        q_pos = seq_len - n + r0 + torch.arange(m, device=q.device)
        allowed = (key_pos[None, :] <= q_pos[:, None]).repeat(group, 1)  # (G*m, L)
        ctx = F.scaled_dot_product_attention(qg, kf, vf, attn_mask=allowed, scale=scale)
        ctx = ctx.view(num_kv_heads, group, m, head_dim).permute(2, 0, 1, 3)  # (m, Hkv, G, D)
        out[r0 : r0 + m] = ctx.reshape(m, num_heads, head_dim).to(q.dtype)
    return out


def _decode_batch(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    starts: list[int],
    lens: list[int],
    block_tables: torch.Tensor,
    reqs: list[int],
    scale: float,
    out: torch.Tensor,
) -> None:
    """All single-query requests at once, padded to the longest context of each chunk."""
    num_blocks_total, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    device = query.device
    longest = max(lens[i] for i in reqs)
    per_req = -(-longest // block_size) * block_size * num_kv_heads * head_dim
    chunk = max(1, _MAX_TEMP_ELEMENTS // per_req)
    for c0 in range(0, len(reqs), chunk):
        ids = reqs[c0 : c0 + chunk]
        r = len(ids)
        idx = torch.tensor(ids, device=device)
        rows = torch.tensor([starts[i] for i in ids], device=device)
        ctx_lens = torch.tensor([lens[i] for i in ids], device=device)
        num_blocks = -(-max(lens[i] for i in ids) // block_size)
        # Entries past a request's own blocks may hold anything: clamp them to a valid id;
        # the positions they cover are masked below.
        table = block_tables[idx, :num_blocks].long().clamp(0, num_blocks_total - 1)
        padded = num_blocks * block_size
        k = kv_cache[:, 0][table].view(r, padded, num_kv_heads, head_dim).float()  # (r, L, Hkv, D)
        v = kv_cache[:, 1][table].view(r, padded, num_kv_heads, head_dim).float()
        valid = torch.arange(padded, device=device)[None, :] < ctx_lens[:, None]  # (r, L)
        # Unwritten cache slots may hold NaN, which a mask does not stop (NaN - inf, 0 * NaN).
        k = torch.where(valid[:, :, None, None], k, 0.0)
        v = torch.where(valid[:, :, None, None], v, 0.0)
        # The group's query heads share one mask row, so they ride the query-row axis.
        q = query[rows].float().view(r, num_kv_heads, group, head_dim)  # (r, Hkv, G, D)
        ctx = F.scaled_dot_product_attention(
            q,
            k.transpose(1, 2),  # (r, Hkv, L, D)
            v.transpose(1, 2),
            attn_mask=valid[:, None, None, :],  # (r, 1, 1, L)
            scale=scale,
        )  # (r, Hkv, G, D)
        out[rows] = ctx.reshape(r, num_heads, head_dim).to(out.dtype)


def merge_attn_states_ref(partial_out: torch.Tensor, partial_lse: torch.Tensor) -> torch.Tensor:
    """Combine split-KV partial results.

    partial_out: [num_tokens, num_heads, num_splits, head_dim] fp32, each split normalised
    over its own keys; partial_lse: [num_tokens, num_heads, num_splits] natural-log
    sum-exp of each split's scores (-inf for a split that saw no key).
    Returns fp32 [num_tokens, num_heads, head_dim].
    """
    lse_max = partial_lse.amax(dim=-1, keepdim=True)  # (T, H, 1)
    lse_max = torch.where(torch.isinf(lse_max), torch.zeros_like(lse_max), lse_max)
    weights = torch.exp(partial_lse - lse_max)  # (T, H, S)
    total = weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    safe_out = torch.where(weights[..., None] > 0, partial_out, 0.0)
    return (weights[..., None] * safe_out).sum(dim=-2) / total
