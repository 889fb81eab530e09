"""Kernel test fixtures.

Without CUDA the Triton kernels run under Triton's CPU interpreter. TRITON_INTERPRET is read
when a kernel is decorated (module import), so it is set here, before any test imports a
`triton_*` module, and only on machines without CUDA: there the whole process can never run
a compiled Triton kernel anyway, so the variable cannot change another folder's tests. With
CUDA the same tests run the compiled kernels on the GPU.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

# Dependency order: triton_paged_attention imports triton_merge_states.
TRITON_MODULES = (
    "triton_merge_states",
    "triton_paged_attention",
    "triton_reshape_and_cache",
    "triton_bitmask",
    "triton_rms_norm",
    "triton_rotary",
)


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(scope="session")
def tk():
    """Namespace of the Triton wrappers, interpreted on CPU-only machines."""
    triton = pytest.importorskip("triton")
    names = [f"agentrt.kernels.{m}" for m in TRITON_MODULES]
    # A module imported before TRITON_INTERPRET was set holds compiled-mode kernels: reload.
    stale = not HAS_CUDA and any(
        isinstance(obj, triton.JITFunction)
        for n in names
        if n in sys.modules
        for obj in vars(sys.modules[n]).values()
    )
    mods = [importlib.import_module(n) for n in names]
    if stale:
        mods = [importlib.reload(m) for m in mods]

    class Wrappers:
        pass

    ns = Wrappers()
    for mod in mods:
        for name, obj in vars(mod).items():
            if name.endswith("_triton"):
                setattr(ns, name, obj)
    return ns


class PagedBatch:
    """A flat varlen batch over a randomly laid out paged cache (see `make_paged_batch`)."""

    def __init__(self, query, kv_cache, query_start_loc, seq_lens, block_tables, keys, values):
        self.query = query  # (num_tokens, H, D)
        self.kv_cache = kv_cache  # (num_blocks, 2, block_size, Hkv, D)
        self.query_start_loc = query_start_loc  # int32 (num_reqs + 1,)
        self.seq_lens = seq_lens  # int32 (num_reqs,)
        self.block_tables = block_tables  # int32 (num_reqs, max_blocks)
        self.keys = keys  # per request: (seq_len, Hkv, D) dense context
        self.values = values

    def args(self):
        return (self.query, self.kv_cache, self.query_start_loc, self.seq_lens, self.block_tables)


@pytest.fixture
def make_paged_batch(device):
    """Build a batch: shuffled physical blocks, spare table entries pointing at NaN-filled
    blocks, and unwritten slots left NaN, so any read past a context shows up in the output."""

    def build(seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
        gen = torch.Generator().manual_seed(seed)
        blocks_per_req = [-(-s // block_size) for s in seq_lens]
        num_blocks = sum(blocks_per_req) + 2
        kv_cache = torch.full(
            (num_blocks, 2, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype
        )
        perm = torch.randperm(num_blocks, generator=gen)
        spare = perm[-1].item()  # never written: stays NaN
        block_tables = torch.full((len(seq_lens), max(blocks_per_req) + 1), spare)
        keys, values = [], []
        used = 0
        for i, (seq_len, nb) in enumerate(zip(seq_lens, blocks_per_req, strict=True)):
            block_tables[i, :nb] = perm[used : used + nb]
            used += nb
            k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
            v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
            pos = torch.arange(seq_len)
            blk = block_tables[i, pos // block_size]
            kv_cache[blk, 0, pos % block_size] = k
            kv_cache[blk, 1, pos % block_size] = v
            keys.append(k)
            values.append(v)
        cu = [0]
        for n in query_lens:
            cu.append(cu[-1] + n)
        query = torch.randn(cu[-1], num_heads, head_dim, generator=gen).to(dtype)
        return PagedBatch(
            query.to(device),
            kv_cache.to(device),
            torch.tensor(cu, dtype=torch.int32, device=device),
            torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables.to(torch.int32).to(device),
            keys,
            values,
        )

    return build


def dense_attention(batch: PagedBatch, scale: float | None = None) -> torch.Tensor:
    """Naive per-token causal attention over the dense contexts (float64, no paging)."""
    q_all = batch.query.cpu().double()
    head_dim = q_all.shape[-1]
    scale = head_dim**-0.5 if scale is None else scale
    out = torch.empty_like(q_all)
    cu = batch.query_start_loc.tolist()
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        k, v = batch.keys[i].double(), batch.values[i].double()
        group = q_all.shape[1] // k.shape[1]
        q_len = cu[i + 1] - cu[i]
        for j in range(q_len):
            pos = seq_len - q_len + j
            for h in range(q_all.shape[1]):
                scores = k[: pos + 1, h // group] @ q_all[cu[i] + j, h] * scale
                out[cu[i] + j, h] = scores.softmax(0) @ v[: pos + 1, h // group]
    return out


TOLERANCE = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    # bf16 carries 8 mantissa bits; Triton's interpreter also truncates instead of rounding.
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


@pytest.fixture(scope="session")
def dense():
    """The naive dense attention oracle, as a fixture (test modules cannot import conftest)."""
    return dense_attention


@pytest.fixture(scope="session")
def tol():
    """assert_close tolerances per dtype."""
    return TOLERANCE.__getitem__
