"""Paged varlen attention on the CPU: a C kernel (cpu_attention.c), built on first use.

The kernel attends every request of a step (decodes, short chunks, prefills) causally,
reading K/V in place from the block-paged cache: one OpenMP work item per (tile of query
tokens, KV head), fp32 accumulation. torch's own alternative on the CPU gathers every
request's blocks into a copy and runs one SDPA call per prefill and per group of decodes,
which for decodes and short chunks is several times slower.

The source is compiled for this CPU on first use (cpu_build.py).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .checks import CheckedOnce, check_dtype, check_paged_attention, version
from .cpu_build import build_library
from .errors import KernelInputError

SOURCE = Path(__file__).with_name("cpu_attention.c")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# Limits of the kernel's per-thread buffers (cpu_attention.c); larger shapes are rejected.
MAX_HEAD_DIM, MAX_GROUP = 256, 16


def unsupported_shape(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int):
    """Why the kernel cannot attend with these shapes, or None when it can."""
    if (
        num_heads % num_kv_heads
        or num_heads // num_kv_heads > MAX_GROUP
        or head_dim > MAX_HEAD_DIM
        or head_dim % 16
        or (block_size % 16 and 16 % block_size)
    ):
        return (
            f"{num_heads} query heads over {num_kv_heads} KV heads, head_dim {head_dim}, "
            f"block_size {block_size}: the CPU kernel needs GQA groups of at most {MAX_GROUP}, "
            f"head_dim a multiple of 16 up to {MAX_HEAD_DIM}, and block_size a power of two."
        )
    return None


class CpuAttention:
    """The loaded kernel library. Get one with `load_cpu_attention(build_dir)`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))  # CDLL releases the GIL during calls
        fn = lib.paged_attention
        fn.restype = ctypes.c_int
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [ptr, ptr, ptr, ctypes.c_int, ptr, ptr, ptr, i64]
        fn.argtypes += [i64, i64, i64, i64, i64, ctypes.c_float, i64, ctypes.c_float]
        fn.argtypes += [ctypes.c_int]
        self._attend = fn
        # What the last call checked: its metadata tensors, held (so no other tensor can take
        # their ids), and a key of their version counters and of the other tensors' layouts.
        # Every layer of a step passes the same metadata and tensors laid out alike, so the
        # checks (~25 us of Python a call) run once per step instead of once per layer.
        # Inference tensors (the engine's) carry no version counter: for them the same
        # tensors count as checked; the engine builds each step's metadata anew and never
        # writes into it.
        self._checked = CheckedOnce()

    def paged_attention(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Causal varlen attention over the paged cache, as `kernels.paged_attention_ref`:
        request i's query rows query_start_loc[i]:query_start_loc[i + 1] (int32) are the
        last positions of its seq_lens[i] (int32) tokens, read through block_tables[i]
        (int32, contiguous (num_requests, max_blocks)). Writes those rows of `out` (like
        query: (num_tokens, num_heads, head_dim), contiguous) and returns it.

        `window` (a sliding-window layer): the query at position p sees only the keys at
        p - window < j <= p (transformers' sliding window), and the table entries of blocks
        wholly before its window are never read (they may hold a freed block's id).
        `softcap` (Gemma 2): the scaled scores become softcap * tanh(scores / softcap)
        before the softmax."""
        if (window is not None and window < 1) or (softcap is not None and softcap <= 0):
            raise KernelInputError(
                f"window {window} and softcap {softcap}: each is None or positive.", arg="window"
            )
        self.check(query, kv_cache, query_start_loc, seq_lens, block_tables, out)
        num_requests = seq_lens.shape[0]
        if num_requests == 0:
            return out
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        status = self._attend(
            query.data_ptr(),
            kv_cache.data_ptr(),
            out.data_ptr(),
            DTYPES[query.dtype],
            query_start_loc.data_ptr(),
            seq_lens.data_ptr(),
            block_tables.data_ptr(),
            block_tables.shape[1],
            num_requests,
            query.shape[1],
            num_kv_heads,
            head_dim,
            block_size,
            scale,
            window or 0,
            softcap or 0.0,
            torch.get_num_threads(),
        )
        if status == -2:
            raise MemoryError("the CPU attention kernel could not allocate its work list.")
        if status != 0:  # the checks above exclude the shapes it rejects
            raise KernelInputError(f"the CPU attention kernel rejected its input ({status}).")
        return out

    def check(self, query, kv_cache, query_start_loc, seq_lens, block_tables, out) -> None:
        """Raise KernelInputError unless the kernel can run on these tensors (once for a
        step's metadata and tensors laid out alike: see `_checked`)."""
        metadata = (query_start_loc, seq_lens, block_tables)
        key = (*(_layout(t) for t in (query, kv_cache, out)), *(version(t) for t in metadata))
        if not self._checked.passed(metadata, key):
            self._check(query, kv_cache, query_start_loc, seq_lens, block_tables, out)
            self._checked.remember(metadata, key)

    @property
    def address(self) -> int:
        """The C function's address (cpu_ops.c's decoder_forward calls it)."""
        return ctypes.cast(self._attend, ctypes.c_void_p).value

    @staticmethod
    def _check(query, kv_cache, query_start_loc, seq_lens, block_tables, out) -> None:
        """Raise KernelInputError unless the kernel can run on these tensors."""
        check_paged_attention(query, kv_cache, query_start_loc, seq_lens, block_tables, out)
        num_blocks, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        num_heads = query.shape[1]
        if query.dtype not in DTYPES:
            raise KernelInputError(
                f"query is {query.dtype}; the CPU kernel takes float32 or bfloat16.", arg="query"
            )
        reason = unsupported_shape(num_heads, num_kv_heads, head_dim, block_size)
        if reason:
            raise KernelInputError(reason, arg="query")
        tensors = (query, kv_cache, out, query_start_loc, seq_lens, block_tables)
        names = ("query", "kv_cache", "out", "query_start_loc", "seq_lens", "block_tables")
        for name, t in zip(names, tensors, strict=True):
            if t.device.type != "cpu" or not t.is_contiguous():
                raise KernelInputError(f"{name} must be a contiguous CPU tensor.", arg=name)
        for name, t in zip(names[3:], tensors[3:], strict=True):
            check_dtype(name, t, (torch.int32,))
        if seq_lens.shape[0]:
            _check_metadata(query, query_start_loc, seq_lens, block_tables, num_blocks, block_size)


def _layout(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device


def _check_metadata(query, query_start_loc, seq_lens, block_tables, num_blocks, block_size):
    """Raise KernelInputError for values that would read or write outside the tensors."""
    # Out-of-range values would read or write outside the tensors: check them (cheap on
    # the CPU).
    query_lens = query_start_loc.diff()
    if int(query_start_loc[0]) < 0 or int(query_lens.min()) < 0:
        raise KernelInputError(
            "query_start_loc must be non-decreasing from 0 or more.", arg="query_start_loc"
        )
    if int(query_start_loc[-1]) > query.shape[0]:
        raise KernelInputError(
            f"query_start_loc ends at {int(query_start_loc[-1])}, past query's "
            f"{query.shape[0]} rows.",
            arg="query_start_loc",
        )
    capacity = block_tables.shape[1] * block_size
    if (seq_lens < query_lens).any() or int(seq_lens.max()) > capacity:
        raise KernelInputError(
            "seq_lens must hold each request's query tokens and at most "
            f"{capacity} (max_blocks * block_size) positions.",
            arg="seq_lens",
        )
    if int(block_tables.min()) < 0 or int(block_tables.max()) >= num_blocks:
        raise KernelInputError(
            f"block_tables holds ids outside [0, {num_blocks}).", arg="block_tables"
        )


@functools.cache
def load_cpu_attention(build_dir: Path) -> CpuAttention:
    """Build (once per source, flags and CPU) and load the CPU attention kernel. Raises
    KernelBuildError with the compiler's message when it cannot be built."""
    return CpuAttention(build_library(SOURCE, Path(build_dir)))
