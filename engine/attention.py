"""Attention over the paged KV cache for a flat varlen batch.

Cache layout per layer: (num_blocks, 2, block_size, num_kv_heads, head_dim), index 0 = K,
1 = V; slot s lives at block s // block_size, offset s % block_size.

Backends:
- `torch`: requests with one query token (decodes) of similar length are batched into one
  SDPA call over their gathered blocks; prefill chunks run one SDPA call each (causal over
  their own tokens when nothing precedes them, else over the gathered context).
- `cpu`: as `torch`, but every decode of the step, and every token of chunks of up to
  KERNEL_MAX_QUERY_LEN tokens (jump-forward), goes to one call of the kernels package's C
  paged-decode kernel, which reads the blocks in place (built on first use).
- `triton`: the kernels package's unified paged attention (Triton kernels on CUDA).
- `auto` (the default): `cpu` on the CPU when its kernel builds, else `torch`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

import agentrt.kernels as kernels
from agentrt.engine import envs
from agentrt.engine.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """Decode requests of similar context length, attended to in one batched call."""

    token_index: torch.Tensor  # (B,) flat token row of each request's query
    block_tables: torch.Tensor  # (B, num_blocks) int64, trimmed to the group's longest
    mask: torch.Tensor  # (B, 1, 1, num_blocks * block_size) bool: position < seq_len


@dataclass(frozen=True, slots=True)
class DecodeRows:
    """Query tokens the CPU kernel attends one by one: every decode of the step, and each
    token of short chunks (a decode plus the tokens jump-forward appended) with its own
    causal length."""

    token_index: torch.Tensor  # (N,) int64 flat row of each query token
    seq_lens: torch.Tensor  # (N,) int32 positions each token attends to (itself included)
    block_tables: torch.Tensor  # (N, num_blocks) int32, contiguous: its request's table
    # Cascade: prefixes shared by several rows, attended once per prefix; `starts` (N,) int32
    # is where each row's own part begins (0 outside any prefix).
    prefixes: list[SharedPrefix] = field(default_factory=list)
    starts: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """Leading blocks that several decode rows share (a common system prompt in the prefix
    cache): attended once for all of them, as one matrix product per KV head."""

    rows: torch.Tensor  # (n,) int64 indices into DecodeRows
    token_index: torch.Tensor  # (n,) int64 their flat query rows
    blocks: torch.Tensor  # (P,) int64 the shared block ids, in order


# A shared prefix is attended once when at least this many rows share at least this many
# blocks; below that its matrix products cost more than the kernel reading it per row.
CASCADE_MIN_ROWS = 4
CASCADE_MIN_BLOCKS = 4


# Chunks of at most this many query tokens go to the CPU kernel token by token; longer ones
# (prefills) to SDPA, whose flash kernel is faster once a chunk has many query rows.
KERNEL_MAX_QUERY_LEN = 16

# Decode requests are grouped so that padding each group to its longest context wastes at
# most this factor of the group's shortest context.
DECODE_GROUP_SPREAD = 1.5


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step attention inputs shared by every layer. R = requests, T = tokens."""

    slot_mapping: torch.Tensor  # (T,) int64
    query_start_loc: torch.Tensor  # (R + 1,) int32
    seq_lens: torch.Tensor  # (R,) int32
    block_tables: torch.Tensor  # (R, max_blocks) int32
    max_seq_len: int
    query_lens: list[int]
    context_lens: list[int]
    block_size: int
    # Derived once per step for the torch backend.
    key_rows: torch.Tensor | None = None  # (T,) row of each new K in the flat cache view
    decode_groups: list[DecodeGroup] | None = None
    decode_rows: DecodeRows | None = None
    prefill_rows: list[int] | None = None
    prefill_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def causal_mask(self, row: int, dtype: torch.dtype) -> torch.Tensor:
        """The additive mask (Tq, L) of a prefill chunk after cached context: 0 where query
        i may see key j (j <= context + i), -inf elsewhere. Built once per step, reused by
        every layer (SDPA would otherwise convert a boolean mask in each call)."""
        if row not in self.prefill_masks:
            context, seq_len = self.context_lens[row], self.context_lens[row] + self.query_lens[row]
            hidden = torch.arange(seq_len)[None, :] > torch.arange(context, seq_len)[:, None]
            mask = torch.zeros(hidden.shape, dtype=dtype).masked_fill_(hidden, float("-inf"))
            self.prefill_masks[row] = mask
        return self.prefill_masks[row]

    def prepare_torch(self, *, max_kernel_query_len: int = 0) -> None:
        """Derive the cache rows of the new K/V and split the chunks: with
        `max_kernel_query_len`, chunks up to that length go to `decode_rows` (the CPU
        kernel); otherwise decodes go to `decode_groups` of similar length (SDPA). The
        rest are `prefill_rows`."""
        blocks = torch.div(self.slot_mapping, self.block_size, rounding_mode="floor")
        self.key_rows = blocks * 2 * self.block_size + self.slot_mapping.remainder(self.block_size)
        limit = max_kernel_query_len or 1
        self.prefill_rows = [i for i, q in enumerate(self.query_lens) if q > limit]
        if max_kernel_query_len:
            self.decode_rows = self._decode_rows(limit)
            return
        seq_lens = [c + q for c, q in zip(self.context_lens, self.query_lens, strict=True)]
        decode = sorted(
            (i for i, q in enumerate(self.query_lens) if q == 1),
            key=seq_lens.__getitem__,
            reverse=True,
        )
        self.decode_groups = []
        while decode:
            longest = seq_lens[decode[0]]
            size = 1
            while size < len(decode) and seq_lens[decode[size]] * DECODE_GROUP_SPREAD >= longest:
                size += 1
            group, decode = decode[:size], decode[size:]
            self.decode_groups.append(self._decode_group(group, longest))

    def _decode_rows(self, limit: int) -> DecodeRows | None:
        rows = [i for i, q in enumerate(self.query_lens) if q <= limit]
        if not rows:
            return None
        if max(self.query_lens) == 1:
            return DecodeRows(  # a decode-only step: every row as it is
                token_index=torch.arange(len(rows)),
                seq_lens=self.seq_lens,
                block_tables=self.block_tables,
            )
        index = torch.tensor(rows, dtype=torch.int64)
        lens = torch.tensor([self.query_lens[i] for i in rows])
        request = index.repeat_interleave(lens)  # the request row of each query token
        first = torch.cumsum(lens, 0) - lens
        offset = torch.arange(int(lens.sum())) - first.repeat_interleave(lens)  # within chunk
        seq_lens = self.seq_lens.index_select(0, request) - lens.repeat_interleave(lens) + offset
        return DecodeRows(
            token_index=self.query_start_loc.index_select(0, request).to(torch.int64) + offset,
            seq_lens=(seq_lens + 1).to(torch.int32),
            block_tables=self.block_tables.index_select(0, request),
        )

    def find_shared_prefixes(self) -> None:
        """Group the decode rows by their first block and record each group's common
        leading blocks (full, and within every member's context) as a SharedPrefix."""
        rows = self.decode_rows
        if rows is None or rows.token_index.shape[0] < CASCADE_MIN_ROWS:
            return
        tables, bs = rows.block_tables, self.block_size
        firsts, counts = torch.unique(tables[:, 0], return_counts=True)
        prefixes = []
        for first in firsts[counts >= CASCADE_MIN_ROWS].tolist():
            members = torch.nonzero(tables[:, 0] == first).flatten()
            group = tables.index_select(0, members)
            same = (group == group[:1]).all(dim=0).to(torch.int32)
            num_blocks = int(same.cumprod(0).sum())
            num_blocks = min(num_blocks, int(rows.seq_lens.index_select(0, members).min()) // bs)
            if num_blocks >= CASCADE_MIN_BLOCKS:
                blocks = group[0, :num_blocks].to(torch.int64)
                prefixes.append(
                    SharedPrefix(members, rows.token_index.index_select(0, members), blocks)
                )
        if prefixes:
            starts = torch.zeros_like(rows.seq_lens)
            for prefix in prefixes:
                starts[prefix.rows] = prefix.blocks.shape[0] * bs
            self.decode_rows = replace(rows, prefixes=prefixes, starts=starts)

    def _decode_group(self, rows: list[int], longest: int) -> DecodeGroup:
        index = torch.tensor(rows, dtype=torch.int64)
        num_blocks = -(-longest // self.block_size)
        lens = self.seq_lens.index_select(0, index).to(torch.int64)
        positions = torch.arange(num_blocks * self.block_size)
        return DecodeGroup(
            token_index=self.query_start_loc.index_select(0, index).to(torch.int64),
            block_tables=self.block_tables.index_select(0, index)[:, :num_blocks].long(),
            mask=(positions[None, :] < lens[:, None])[:, None, None, :],
        )


def _sdpa(q, k, v, **options) -> torch.Tensor:
    """SDPA of one request, q (H, Tq, D) over k, v (KVH, L, D). Given a batch dim, torch
    runs its flash kernel on the CPU (about twice as fast here); 3-D inputs take the math
    path."""
    gqa = q.shape[0] != k.shape[0]
    return F.scaled_dot_product_attention(q[None], k[None], v[None], enable_gqa=gqa, **options)[0]


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, device: torch.device) -> None:
        del device  # runs wherever torch does

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.prepare_torch()

    def forward(
        self,
        query: torch.Tensor,  # (T, H, D)
        key: torch.Tensor,  # (T, KVH, D)
        value: torch.Tensor,  # (T, KVH, D)
        kv_cache: torch.Tensor,  # (NB, 2, BS, KVH, D)
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        # Rows of the cache viewed as (NB * 2 * BS, KVH, D): K of slot s at
        # block * 2 * BS + offset, its V one block_size further.
        rows = kv_cache.view(-1, key.shape[1], key.shape[2])
        rows.index_copy_(0, meta.key_rows, key)
        rows.index_copy_(0, meta.key_rows + meta.block_size, value)
        out = torch.empty_like(query)
        self._decode_all(query, kv_cache, meta, scale, out)
        for row in meta.prefill_rows:
            start = int(meta.query_start_loc[row])
            end = start + meta.query_lens[row]
            q = query[start:end].transpose(0, 1)  # (H, Tq, D)
            context_len = meta.context_lens[row]
            if context_len == 0:
                k = key[start:end].transpose(0, 1)  # (KVH, Tq, D)
                v = value[start:end].transpose(0, 1)
                o = _sdpa(q, k, v, is_causal=True, scale=scale)
            else:
                k, v = self._gather_context(kv_cache, meta, row)  # (KVH, L, D)
                o = _sdpa(q, k, v, attn_mask=meta.causal_mask(row, query.dtype), scale=scale)
            out[start:end] = o.transpose(0, 1)
        return out

    def _decode_all(self, query, kv_cache, meta: AttentionMetadata, scale: float, out) -> None:
        for group in meta.decode_groups:
            out[group.token_index] = self._decode(query, kv_cache, group, scale)

    @staticmethod
    def _gather_context(kv_cache: torch.Tensor, meta: AttentionMetadata, row: int):
        seq_len = int(meta.seq_lens[row])
        num_blocks = -(-seq_len // meta.block_size)
        blocks = meta.block_tables[row, :num_blocks].long()
        kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
        k = kv_cache[:, 0].index_select(0, blocks).view(-1, kv_heads, head_dim)[:seq_len]
        v = kv_cache[:, 1].index_select(0, blocks).view(-1, kv_heads, head_dim)[:seq_len]
        return k.transpose(0, 1), v.transpose(0, 1)  # (KVH, L, D) each

    @staticmethod
    def _decode(query, kv_cache, group: DecodeGroup, scale: float) -> torch.Tensor:
        num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
        q = query.index_select(0, group.token_index)  # (B, H, D)
        batch, num_heads = q.shape[0], q.shape[1]
        # Each KV head serves `group` query heads: treat them as that head's query rows.
        q = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)  # (B, KVH, G, D)
        # index_select on a block-strided view copies whole (BS, KVH, D) blocks; the result
        # is contiguous per request, so (B, L, KVH, D) -> (B, KVH, L, D) is a free transpose.
        blocks = group.block_tables.reshape(-1)
        k = kv_cache[:, 0].index_select(0, blocks).view(batch, -1, num_kv_heads, head_dim)
        v = kv_cache[:, 1].index_select(0, blocks).view(batch, -1, num_kv_heads, head_dim)
        o = F.scaled_dot_product_attention(
            q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=group.mask, scale=scale
        )
        return o.reshape(batch, num_heads, head_dim)  # (B, H, D)


class CpuAttentionBackend(TorchAttentionBackend):
    """The torch backend with decodes in the kernels package's C paged-decode kernel."""

    name = "cpu"

    def __init__(self, device: torch.device) -> None:
        if device.type != "cpu":
            raise ConfigError(
                f"attention_backend='cpu' runs on the CPU, not on {device}; use 'auto'."
            )
        try:
            self.kernel = kernels.load_cpu_attention(envs.cache_dir() / "kernels")
        except kernels.KernelBuildError as exc:
            raise ConfigError(f"attention_backend='cpu' is unavailable: {exc}") from exc

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.prepare_torch(max_kernel_query_len=KERNEL_MAX_QUERY_LEN)
        meta.find_shared_prefixes()

    def _decode_all(self, query, kv_cache, meta: AttentionMetadata, scale: float, out) -> None:
        rows = meta.decode_rows
        if rows is None:
            return
        init_out = init_lse = None
        if rows.prefixes:
            num, heads, dim = rows.token_index.shape[0], query.shape[1], query.shape[2]
            init_out = torch.empty(num, heads, dim)
            init_lse = torch.empty(num, heads)
            for prefix in rows.prefixes:
                q = query.index_select(0, prefix.token_index)
                o, lse = prefix_attention(q, kv_cache, prefix.blocks, scale)
                init_out[prefix.rows] = o
                init_lse[prefix.rows] = lse
        self.kernel.paged_decode(
            query,
            kv_cache,
            rows.token_index,
            rows.seq_lens,
            rows.block_tables,
            scale,
            out,
            starts=rows.starts,
            init_out=init_out,
            init_lse=init_lse,
        )


def prefix_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, blocks: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of n query tokens (n, H, D) over the same full blocks, in fp32: (out
    (n, H, D), log-sum-exp (n, H)). Each KV head's keys are read once for all n * G query
    heads on it, as two batched matrix products."""
    num, heads, dim = query.shape
    kv_heads = kv_cache.shape[3]
    group = heads // kv_heads
    kv = kv_cache.index_select(0, blocks).float()  # (P, 2, BS, KVH, D)
    k = kv[:, 0].reshape(-1, kv_heads, dim).permute(1, 2, 0)  # (KVH, D, L)
    v = kv[:, 1].reshape(-1, kv_heads, dim).transpose(0, 1)  # (KVH, L, D)
    q = query.float().view(num, kv_heads, group, dim).transpose(0, 1)  # (KVH, n, G, D)
    scores = torch.bmm(q.reshape(kv_heads, num * group, dim), k).mul_(scale)  # (KVH, nG, L)
    lse = torch.logsumexp(scores, dim=-1)  # (KVH, nG)
    out = torch.bmm(scores.sub_(lse[..., None]).exp_(), v)  # (KVH, nG, D)
    out = out.view(kv_heads, num, group, dim).transpose(0, 1).reshape(num, heads, dim)
    return out, lse.view(kv_heads, num, group).transpose(0, 1).reshape(num, heads)


class KernelAttentionBackend:
    """The kernels package's unified varlen paged attention: its Triton kernels on CUDA,
    their torch references elsewhere (slower than the torch backend on the CPU, but the
    same code path the GPU runs, so it is tested here)."""

    name = "triton"

    def __init__(self, device: torch.device) -> None:
        if device.type == "cuda":
            kernels.require_triton()

    def prepare(self, meta: AttentionMetadata) -> None:
        """Nothing to derive: the kernels read the metadata as it is."""

    def forward(self, query, key, value, kv_cache, meta: AttentionMetadata, scale: float):
        kernels.reshape_and_cache(key, value, kv_cache, meta.slot_mapping)
        return kernels.paged_attention(
            query,
            kv_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            scale,
            max_query_len=max(meta.query_lens),
            max_seq_len=meta.max_seq_len,
        )


BACKENDS = {
    "torch": TorchAttentionBackend,
    "cpu": CpuAttentionBackend,
    "triton": KernelAttentionBackend,
}


def get_attention_backend(name: str, device: torch.device):
    if name == "auto":
        if device.type != "cpu":
            return TorchAttentionBackend(device)
        try:
            return CpuAttentionBackend(device)
        except ConfigError as exc:
            logger.warning("%s Falling back to the slower 'torch' attention backend.", exc)
            return TorchAttentionBackend(device)
    if name not in BACKENDS:
        raise ConfigError(
            f"attention_backend={name!r} is invalid: expected 'auto' or one of {sorted(BACKENDS)}."
        )
    return BACKENDS[name](device)
