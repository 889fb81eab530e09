"""Paged decode attention on the CPU: a C kernel (cpu_attention.c), built on first use.

The kernel reads K/V in place from the block-paged cache, one OpenMP work item per
(request, KV head), with fp32 accumulation. torch's own alternative on the CPU gathers every
request's blocks into a padded copy and runs SDPA over it, which for one query token per
request is several times slower.

The source is compiled with the system C compiler (`$CC`, else `cc`) for this CPU
(-march=native) into `build_dir`, keyed by a hash of the source, the flags and the CPU's
feature flags, so a rebuilt or moved checkout never loads a stale or foreign library. The
build is atomic (compile to a temporary name, then rename), so concurrent processes are safe.
It links against the libgomp torch already loaded, so `torch.set_num_threads` governs both.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from .checks import check_dtype, check_kv_cache, check_like, check_ndim, check_same_device
from .errors import KernelBuildError, KernelInputError

SOURCE = Path(__file__).with_name("cpu_attention.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# Limits of the kernel's per-thread buffers (cpu_attention.c); larger shapes are rejected.
MAX_HEAD_DIM, MAX_GROUP, MAX_BLOCK = 256, 16, 128


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _build(build_dir: Path) -> Path:
    compiler = os.environ.get("CC", "cc")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), _cpu_flags().encode()]))
    target = build_dir / f"cpu_attention-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    build_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=build_dir)
    os.close(fd)
    try:
        _compile(compiler, tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _compile(compiler: str, output: str) -> None:
    try:
        done = subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", output], capture_output=True, text=True
        )
    except FileNotFoundError as exc:
        raise KernelBuildError(
            f"no C compiler {compiler!r} to build {SOURCE.name} (set $CC or install gcc)."
        ) from exc
    if done.returncode != 0:
        raise KernelBuildError(
            f"compiling {SOURCE.name} with {compiler!r} failed:\n{done.stderr.strip()[-2000:]}"
        )


class CpuAttention:
    """The loaded kernel library. Get one with `load_cpu_attention(build_dir)`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))  # CDLL releases the GIL during calls
        fn = lib.paged_decode
        fn.restype = ctypes.c_int
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [ptr, ptr, ptr, ctypes.c_int, ptr, ptr, ptr, i64, ptr, ptr, ptr]
        fn.argtypes += [i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
        self._decode = fn

    def paged_decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        token_index: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        starts: torch.Tensor | None = None,
        init_out: torch.Tensor | None = None,
        init_lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of one query token per request over its paged context.

        query, out: (num_tokens, num_heads, head_dim), contiguous; request i's query is row
        token_index[i] (int64) and its output goes to the same row of `out` (other rows are
        left alone). It attends to positions < seq_lens[i] (int32) through block_tables[i]
        (int32, contiguous (num_requests, max_blocks)). Returns `out`.

        Cascade: with `starts` (int32, multiples of block_size), request i attends only
        positions starts[i] onwards here; where starts[i] > 0, the positions before were
        attended elsewhere and init_out[i] (fp32 (num_heads, head_dim)) and init_lse[i]
        (fp32 (num_heads,)) hold that partial output and its log-sum-exp, merged exactly.
        """
        check_kv_cache(kv_cache)
        check_ndim("query", query, 3, "[num_tokens, num_heads, head_dim]")
        check_dtype("query", query, tuple(DTYPES))
        check_like("out", out, "query", query)
        num_blocks, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        num_heads = query.shape[1]
        if query.dtype != kv_cache.dtype or query.shape[2] != head_dim:
            raise KernelInputError(
                f"query is {query.dtype} {tuple(query.shape)} but kv_cache is "
                f"{kv_cache.dtype} with head_dim {head_dim}; dtype and head_dim must match.",
                arg="query",
            )
        if (
            num_heads % num_kv_heads
            or num_heads // num_kv_heads > MAX_GROUP
            or head_dim > MAX_HEAD_DIM
            or block_size > MAX_BLOCK
        ):
            raise KernelInputError(
                f"{num_heads} query heads over {num_kv_heads} KV heads, head_dim {head_dim}, "
                f"block_size {block_size}: the CPU kernel needs whole GQA groups of at most "
                f"{MAX_GROUP}, head_dim <= {MAX_HEAD_DIM} and block_size <= {MAX_BLOCK}.",
                arg="query",
            )
        check_ndim("token_index", token_index, 1, "[num_requests]")
        check_dtype("token_index", token_index, (torch.int64,))
        check_ndim("seq_lens", seq_lens, 1, "[num_requests]")
        check_dtype("seq_lens", seq_lens, (torch.int32,))
        check_ndim("block_tables", block_tables, 2, "[num_requests, max_blocks]")
        check_dtype("block_tables", block_tables, (torch.int32,))
        num_requests = token_index.shape[0]
        for name, t in (("seq_lens", seq_lens), ("block_tables", block_tables)):
            if t.shape[0] != num_requests:
                raise KernelInputError(
                    f"{name} has {t.shape[0]} rows; expected {num_requests} like token_index.",
                    arg=name,
                )
        tensors = (query, kv_cache, out, token_index, seq_lens, block_tables)
        names = ("query", "kv_cache", "out", "token_index", "seq_lens", "block_tables")
        check_same_device(names, *tensors)
        for name, t in zip(names, tensors, strict=True):
            if t.device.type != "cpu" or not t.is_contiguous():
                raise KernelInputError(f"{name} must be a contiguous CPU tensor.", arg=name)
        if num_requests == 0:
            return out
        # Out-of-range values would read outside the cache: check them (cheap on the CPU).
        if int(seq_lens.min()) < 1 or int(seq_lens.max()) > block_tables.shape[1] * block_size:
            raise KernelInputError(
                f"seq_lens must lie in [1, {block_tables.shape[1] * block_size}] "
                "(max_blocks * block_size).",
                arg="seq_lens",
            )
        if int(block_tables.min()) < 0 or int(block_tables.max()) >= num_blocks:
            raise KernelInputError(
                f"block_tables holds ids outside [0, {num_blocks}).", arg="block_tables"
            )
        if int(token_index.min()) < 0 or int(token_index.max()) >= query.shape[0]:
            raise KernelInputError(
                f"token_index holds rows outside [0, {query.shape[0]}).", arg="token_index"
            )
        cascade = (starts, init_out, init_lse)
        if any(t is not None for t in cascade):
            self._check_cascade(starts, init_out, init_lse, seq_lens, query, block_size)
        self._decode(
            query.data_ptr(),
            kv_cache.data_ptr(),
            out.data_ptr(),
            DTYPES[query.dtype],
            token_index.data_ptr(),
            seq_lens.data_ptr(),
            block_tables.data_ptr(),
            block_tables.shape[1],
            *(0 if t is None else t.data_ptr() for t in cascade),
            num_requests,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            scale,
            torch.get_num_threads(),
        )
        return out

    @staticmethod
    def _check_cascade(starts, init_out, init_lse, seq_lens, query, block_size) -> None:
        num, heads, dim = seq_lens.shape[0], query.shape[1], query.shape[2]
        expected = (
            ("starts", starts, torch.int32, (num,)),
            ("init_out", init_out, torch.float32, (num, heads, dim)),
            ("init_lse", init_lse, torch.float32, (num, heads)),
        )
        for name, t, dtype, shape in expected:
            if t is None or t.dtype != dtype or tuple(t.shape) != shape:
                got = "None" if t is None else f"{t.dtype} {tuple(t.shape)}"
                raise KernelInputError(
                    f"{name} is {got}; a cascade needs starts, init_out and init_lse, here "
                    f"{dtype} {shape}.",
                    arg=name,
                )
            if t.device.type != "cpu" or not t.is_contiguous():
                raise KernelInputError(f"{name} must be a contiguous CPU tensor.", arg=name)
        if (starts < 0).any() or (starts > seq_lens).any() or (starts % block_size).any():
            raise KernelInputError(
                f"starts must be multiples of block_size ({block_size}) in [0, seq_lens].",
                arg="starts",
            )


@functools.cache
def load_cpu_attention(build_dir: Path) -> CpuAttention:
    """Build (once per source, flags and CPU) and load the CPU attention kernel. Raises
    KernelBuildError with the compiler's message when it cannot be built."""
    return CpuAttention(_build(Path(build_dir)))
