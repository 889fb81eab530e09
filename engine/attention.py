"""Attention over the paged KV cache for a flat varlen batch.

Cache layout per layer: (num_blocks, 2, block_size, num_kv_heads, head_dim), index 0 = K,
1 = V; slot s lives at block s // block_size, offset s % block_size.

The `torch` backend is the CPU path: requests with one query token (decodes) are batched
into one SDPA call over their gathered blocks; prefill chunks run one SDPA call each
(causal over their own tokens when nothing precedes them, else over the gathered context).
The `triton` backend (CUDA) calls the kernels package.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from agentrt.engine.errors import ConfigError


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
    slot_blocks: torch.Tensor | None = None  # (T,) slot // block_size
    slot_offsets: torch.Tensor | None = None  # (T,) slot % block_size
    decode_rows: torch.Tensor | None = None  # (D,) requests with query_len == 1
    decode_token_index: torch.Tensor | None = None  # (D,) their flat token rows
    decode_block_tables: torch.Tensor | None = None  # (D, max_decode_blocks)
    decode_mask: torch.Tensor | None = None  # (D, 1, 1, max_decode_blocks * block_size) bool
    prefill_rows: list[int] | None = None

    def prepare_torch(self) -> None:
        self.slot_blocks = torch.div(self.slot_mapping, self.block_size, rounding_mode="floor")
        self.slot_offsets = self.slot_mapping.remainder(self.block_size)
        decode = [i for i, q in enumerate(self.query_lens) if q == 1]
        self.prefill_rows = [i for i, q in enumerate(self.query_lens) if q > 1]
        if not decode:
            return
        rows = torch.tensor(decode, dtype=torch.int64)
        seq_lens = self.seq_lens.index_select(0, rows).to(torch.int64)
        num_blocks = -(-int(seq_lens.max()) // self.block_size)
        self.decode_rows = rows
        self.decode_token_index = self.query_start_loc.index_select(0, rows).to(torch.int64)
        self.decode_block_tables = self.block_tables.index_select(0, rows)[:, :num_blocks].long()
        positions = torch.arange(num_blocks * self.block_size)
        self.decode_mask = (positions[None, :] < seq_lens[:, None])[:, None, None, :]


class TorchAttentionBackend:
    name = "torch"

    def forward(
        self,
        query: torch.Tensor,  # (T, H, D)
        key: torch.Tensor,  # (T, KVH, D)
        value: torch.Tensor,  # (T, KVH, D)
        kv_cache: torch.Tensor,  # (NB, 2, BS, KVH, D)
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        kv_cache[meta.slot_blocks, 0, meta.slot_offsets] = key
        kv_cache[meta.slot_blocks, 1, meta.slot_offsets] = value
        out = torch.empty_like(query)
        num_heads, num_kv_heads = query.shape[1], key.shape[1]
        if meta.decode_rows is not None:
            out[meta.decode_token_index] = self._decode(query, kv_cache, meta, scale)
        for row in meta.prefill_rows:
            start = int(meta.query_start_loc[row])
            end = start + meta.query_lens[row]
            q = query[start:end].transpose(0, 1)  # (H, Tq, D)
            context_len = meta.context_lens[row]
            if context_len == 0:
                k = key[start:end].transpose(0, 1)  # (KVH, Tq, D)
                v = value[start:end].transpose(0, 1)
                o = F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=scale, enable_gqa=num_heads != num_kv_heads
                )
            else:
                k, v = self._gather_context(kv_cache, meta, row)  # (KVH, L, D)
                seq_len = k.shape[1]
                query_pos = torch.arange(context_len, seq_len)[:, None]
                mask = torch.arange(seq_len)[None, :] <= query_pos  # (Tq, L)
                o = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, scale=scale, enable_gqa=num_heads != num_kv_heads
                )
            out[start:end] = o.transpose(0, 1)
        return out

    @staticmethod
    def _gather_context(kv_cache: torch.Tensor, meta: AttentionMetadata, row: int):
        seq_len = int(meta.seq_lens[row])
        num_blocks = -(-seq_len // meta.block_size)
        blocks = meta.block_tables[row, :num_blocks].long()
        kv = kv_cache.index_select(0, blocks)  # (nb, 2, BS, KVH, D)
        kv = kv.transpose(0, 1).flatten(1, 2)[:, :seq_len]  # (2, L, KVH, D)
        return kv[0].transpose(0, 1), kv[1].transpose(0, 1)  # (KVH, L, D) each

    @staticmethod
    def _decode(query, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
        q = query.index_select(0, meta.decode_token_index)  # (B, H, D)
        batch, num_heads = q.shape[0], q.shape[1]
        group = num_heads // num_kv_heads
        # Each KV head serves `group` query heads: treat them as that head's query rows.
        q = q.view(batch, num_kv_heads, group, head_dim)  # (B, KVH, G, D)
        kv = kv_cache[meta.decode_block_tables]  # (B, nb, 2, BS, KVH, D)
        kv = kv.permute(2, 0, 4, 1, 3, 5).flatten(3, 4)  # (2, B, KVH, nb * BS, D)
        o = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=meta.decode_mask, scale=scale)
        return o.reshape(batch, num_heads, head_dim)  # (B, H, D)


def get_attention_backend(name: str, device: torch.device):
    if name == "torch":
        return TorchAttentionBackend()
    raise ConfigError(f"attention_backend={name!r} is not available here: expected 'torch'.")
