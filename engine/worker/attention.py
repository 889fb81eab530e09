"""Attention over the paged KV cache for a flat varlen batch.

Cache layout per layer: (num_blocks, 2, block_size, num_kv_heads, head_dim), index 0 = K,
1 = V; slot s lives at block s // block_size, offset s % block_size.

Backends:
- `torch`: requests with one query token (decodes) of similar length are batched into one
  SDPA call over their gathered blocks; prefill chunks run one SDPA call each (causal over
  their own tokens when nothing precedes them, else over the gathered context).
- `cpu`: every request of the step (decodes, jump-forward chunks, prefills) in one call of
  the kernels package's C paged-attention kernel, which reads the blocks in place (built on
  first use).
- `triton`: the kernels package's unified paged attention (Triton kernels on CUDA, their
  torch references elsewhere). With it the model also runs its RMSNorm and RoPE through the
  kernels package: it is the CUDA path.
- `auto` (the default): `preferred_backend` for the device (`cpu` on the CPU, `triton` on
  CUDA), falling back to `torch` with a warning when that one is unavailable (no compiler,
  shapes the C kernel does not take, triton not installed).
"""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

import agentrt.kernels as kernels
from agentrt.engine import envs
from agentrt.engine.errors import ConfigError
from agentrt.engine.records import AttentionMetadata, DecodeGroup

if TYPE_CHECKING:
    from agentrt.engine.model.arch import ModelArchConfig

logger = logging.getLogger(__name__)


# Decode requests are grouped so that padding each group to its longest context wastes at
# most this factor of the group's shortest context.
DECODE_GROUP_SPREAD = 1.5


def prepare_torch(meta: AttentionMetadata) -> None:
    """Derive the cache rows of the new K/V and split the requests: decodes into
    `decode_groups` of similar length, the rest into `prefill_rows`."""
    meta.key_rows = meta.key_cache_rows()
    meta.prefill_rows = [i for i, q in enumerate(meta.query_lens) if q > 1]
    meta.query_starts = list(itertools.accumulate(meta.query_lens, initial=0))
    seq_lens = [c + q for c, q in zip(meta.context_lens, meta.query_lens, strict=True)]
    decode = sorted(
        (i for i, q in enumerate(meta.query_lens) if q == 1),
        key=seq_lens.__getitem__,
        reverse=True,
    )
    meta.decode_groups = []
    while decode:
        longest = seq_lens[decode[0]]
        size = 1
        while size < len(decode) and seq_lens[decode[size]] * DECODE_GROUP_SPREAD >= longest:
            size += 1
        group, decode = decode[:size], decode[size:]
        meta.decode_groups.append(_decode_group(meta, group, longest))


def _decode_group(meta: AttentionMetadata, rows: list[int], longest: int) -> DecodeGroup:
    device = meta.seq_lens.device
    index = torch.tensor(rows, dtype=torch.int64, device=device)
    num_blocks = -(-longest // meta.block_size)
    lens = meta.seq_lens.index_select(0, index).to(torch.int64)
    positions = torch.arange(num_blocks * meta.block_size, device=device)
    return DecodeGroup(
        token_index=meta.query_start_loc.index_select(0, index).to(torch.int64),
        block_tables=meta.block_tables.index_select(0, index)[:, :num_blocks].long(),
        mask=(positions[None, :] < lens[:, None])[:, None, None, :],
    )


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: AttentionMetadata
) -> None:
    """The step's new K/V into the cache, viewed as rows (NB * 2 * BS, KVH, D): K of slot s
    at block * 2 * BS + offset (meta.key_rows), its V one block_size further."""
    rows = kv_cache.view(-1, key.shape[1], key.shape[2])
    rows.index_copy_(0, meta.key_rows, key)
    rows.index_copy_(0, meta.key_rows + meta.block_size, value)


def _sdpa(q, k, v, **options) -> torch.Tensor:
    """SDPA of one request, q (H, Tq, D) over k, v (KVH, L, D). Given a batch dim, torch
    runs its flash kernel on the CPU (about twice as fast here); 3-D inputs take the math
    path."""
    gqa = q.shape[0] != k.shape[0]
    return F.scaled_dot_product_attention(q[None], k[None], v[None], enable_gqa=gqa, **options)[0]


class TorchAttentionBackend:
    name = "torch"
    takes_windows = False  # layers with windows go through windowed_attention.py

    def __init__(self, device: torch.device, arch=None, block_size: int = 16) -> None:
        del device, arch, block_size  # runs wherever torch does, any shapes

    def prepare(self, meta: AttentionMetadata) -> None:
        prepare_torch(meta)

    def forward(
        self,
        query: torch.Tensor,  # (T, H, D)
        key: torch.Tensor,  # (T, KVH, D)
        value: torch.Tensor,  # (T, KVH, D)
        kv_cache: torch.Tensor,  # (NB, 2, BS, KVH, D)
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv(kv_cache, key, value, meta)
        out = meta.output_like(query)  # every row is written: each is a decode or a prefill
        for group in meta.decode_groups:
            out[group.token_index] = self._decode(query, kv_cache, group, scale)
        for row in meta.prefill_rows:
            start = meta.query_starts[row]
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

    @staticmethod
    def _gather_context(kv_cache: torch.Tensor, meta: AttentionMetadata, row: int):
        seq_len = meta.context_lens[row] + meta.query_lens[row]  # seq_lens[row], on the host
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


class CpuAttentionBackend:
    """Every request of the step in one call of the kernels package's C paged-attention
    kernel. A system prompt shared by many requests is read by each of them: it stays in the
    CPU's caches, and attending it once for all of them as fp32 matrix products (cascade
    attention) measured 1.7x slower for 128 decodes after a 288-token prompt."""

    name = "cpu"
    # forward takes a sliding window and soft-capped scores (the others' layers go through
    # worker/windowed_attention.py for those).
    takes_windows = True

    def __init__(
        self, device: torch.device, arch: ModelArchConfig | None = None, block_size: int = 16
    ) -> None:
        if device.type != "cpu":
            raise ConfigError(
                f"attention_backend='cpu' runs on the CPU, not on {device}; use 'auto'."
            )
        if arch is not None:
            shape = (arch.num_heads, arch.num_kv_heads, arch.head_dim, block_size)
            if reason := kernels.unsupported_shape(*shape):
                raise ConfigError(f"attention_backend='cpu' is unavailable: {reason}")
        try:
            self.kernel = kernels.load_cpu_attention(envs.cache_dir() / "kernels")
        except kernels.KernelBuildError as exc:
            raise ConfigError(f"attention_backend='cpu' is unavailable: {exc}") from exc

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.key_rows = meta.key_cache_rows()

    def forward(
        self,
        query,
        key,
        value,
        kv_cache,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ):
        """`window`: a sliding-window layer's (its group's block tables in `meta`); `softcap`:
        Gemma 2's attention soft-cap (cpu_attention.py's `paged_attention`)."""
        write_kv(kv_cache, key, value, meta)
        return self.forward_query(query, kv_cache, meta, scale, window, softcap)

    def forward_query(
        self,
        query,
        kv_cache,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ):
        """Attention of `query` over the cache, whose K/V for this step are written already."""
        return self.kernel.paged_attention(
            query,
            kv_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            scale,
            torch.empty_like(query),
            window,
            softcap,
        )


class KernelAttentionBackend:
    """The kernels package's unified varlen paged attention: its Triton kernels on CUDA,
    their torch references elsewhere (slower than the torch backend on the CPU, but the
    same code path the GPU runs, so it is tested here)."""

    name = "triton"
    takes_windows = False  # layers with windows go through windowed_attention.py

    def __init__(self, device: torch.device, arch=None, block_size: int = 16) -> None:
        del arch, block_size  # any shapes
        if device.type == "cuda":
            try:
                kernels.require_triton()
            except kernels.TritonUnavailableError as exc:
                raise ConfigError(f"attention_backend='triton' is unavailable: {exc}") from exc

    def prepare(self, meta: AttentionMetadata) -> None:
        """The kernels read the metadata as it is; the longest query run is taken once."""
        meta.max_query_len = max(meta.query_lens)

    def forward(self, query, key, value, kv_cache, meta: AttentionMetadata, scale: float):
        kernels.reshape_and_cache(key, value, kv_cache, meta.slot_mapping)
        return kernels.paged_attention(
            query,
            kv_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            scale,
            # Host values: the kernel would otherwise read them from the device.
            max_query_len=meta.max_query_len or max(meta.query_lens),
            max_seq_len=meta.max_seq_len,
            out=meta.output_like(query),
        )


BACKENDS = {
    "torch": TorchAttentionBackend,
    "cpu": CpuAttentionBackend,
    "triton": KernelAttentionBackend,
}


def preferred_backend(device: torch.device) -> str:
    """What `auto` tries first on `device`: the C kernel on the CPU, the Triton kernels on
    CUDA, torch anywhere else."""
    return {"cpu": "cpu", "cuda": "triton"}.get(device.type, "torch")


def get_attention_backend(
    name: str, device: torch.device, arch: ModelArchConfig | None = None, block_size: int = 16
):
    """The backend `name` for `device`; with the model's `arch` (ModelArchConfig) and
    `block_size`, the cpu backend also checks that its kernel takes those shapes. Raises
    ConfigError for an unknown name or a backend that cannot run here, except under `auto`,
    which then warns and falls back to `torch`."""
    if name != "auto" and name not in BACKENDS:
        raise ConfigError(
            f"attention_backend={name!r} is invalid: expected 'auto' or one of {sorted(BACKENDS)}."
        )
    if name != "auto":
        return BACKENDS[name](device, arch, block_size)
    try:
        return BACKENDS[preferred_backend(device)](device, arch, block_size)
    except ConfigError as exc:
        logger.warning("%s Falling back to the slower 'torch' attention backend.", exc)
        return TorchAttentionBackend(device)
