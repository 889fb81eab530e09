"""The C library of ggml_linear.py (ggml_quants.c and its headers), one build per instruction
set, and the choice among them.

A build is compiled by cpu_build.py on first use (-march=native, plus ISAS's flags: the
portable build turns AVX off, the AVX2 build AVX-512) and loaded with ctypes. `selected_isa()`
is the best this CPU runs, or `$AGENTRT_GGML_ISA` (scalar | avx2 | avx512) when set;
`default_kernels()` loads that one once per process; `load_ggml_kernels(build_dir, isa)` any.
The GGMLKernels methods take tensors their callers (ggml_linear.py) have checked: a wrong
shape here reads out of bounds. The module imports no torch (its methods do, when called).
"""

from __future__ import annotations

import array
import ctypes
import functools
import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING

from .cpu_build import build_library
from .errors import KernelBuildError, KernelInputError
from .ggml_types import type_name as _type_name

if TYPE_CHECKING:
    import torch

    from .ggml_linear import GGMLWeight

SOURCE = Path(__file__).with_name("ggml_quants.c")
# Instruction sets, best first: the name AGENTRT_GGML_ISA takes, the cpuinfo flags it needs,
# and the build's extra flags (on top of -march=native; the portable build turns AVX off, so
# the compiler cannot vectorize it past SSE).
ISA_ENV = "AGENTRT_GGML_ISA"
_X86 = platform.machine().lower() in ("x86_64", "amd64")
ISAS = {
    "avx512": (("avx512f", "avx512bw", "avx512vl", "avx512_vnni"), ("-DAGENTRT_ISA=2",)),
    "avx2": (("avx2", "fma"), ("-mno-avx512f", "-DAGENTRT_ISA=1")),
    "scalar": ((), ("-mno-avx", "-DAGENTRT_ISA=0") if _X86 else ("-DAGENTRT_ISA=0",)),
}
EXTRA_FLAGS = ("-ffp-contract=off",)  # dequantize rounds as gguf-py's numpy does: no FMA


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        line = ""
    return frozenset(line.split(":", 1)[-1].split())


def available_isas() -> list[str]:
    """The instruction sets this CPU runs, best first ("scalar" always)."""
    flags = _cpu_flags()
    return [
        isa for isa, (needs, _) in ISAS.items() if (_X86 or isa == "scalar") and flags >= set(needs)
    ]


def selected_isa() -> str:
    """$AGENTRT_GGML_ISA when set (refused when this CPU cannot run it), else the best."""
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    isas = available_isas()
    if not forced:
        return isas[0]
    if forced not in isas:
        raise KernelInputError(
            f"{ISA_ENV}={forced!r}: this CPU runs {', '.join(isas)}; choose one of them or unset "
            "it.",
            arg=ISA_ENV,
        )
    return forced


def default_build_dir() -> Path:
    """Where engine.envs.cache_dir() puts the kernels: $AGENTRT_CACHE_DIR/kernels, else
    $XDG_CACHE_HOME/agentrt/kernels, else ~/.cache/agentrt/kernels."""
    explicit = os.environ.get("AGENTRT_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser() / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "agentrt" / "kernels"


class GGMLKernels:
    """The library of one instruction set. Get one with `load_ggml_kernels`; the module's
    functions use the selected one."""

    def __init__(self, path: Path, isa: str) -> None:
        self.path, self.isa = path, isa
        lib = ctypes.CDLL(str(path))  # CDLL releases the GIL during calls
        ptr, i64, cint = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.ggml_linear.argtypes = [ptr, cint, i64, i64, ptr, i64, cint, i64, ptr, i64]
        lib.ggml_linear.argtypes += [cint, cint, cint]
        lib.ggml_dequantize.argtypes = [ptr, i64, cint, i64, i64, ptr, i64, cint]
        lib.ggml_dequantize_tile.argtypes = [ptr, i64, cint, i64, i64, ptr, i64, cint, cint]
        for fn in (lib.ggml_linear, lib.ggml_dequantize, lib.ggml_dequantize_tile, lib.ggml_isa):
            fn.restype = cint
        lib.ggml_linear_packed.argtypes = [ctypes.c_void_p]
        lib.ggml_linear_packed.restype = cint
        self._linear_packed = lib.ggml_linear_packed
        lib.ggml_act_block.argtypes = [cint]
        lib.ggml_act_block.restype = cint
        self._act_block = lib.ggml_act_block
        lib.ggml_interleave.argtypes = [ptr, i64, cint, i64, i64, ptr, cint]
        lib.ggml_interleave.restype = cint
        lib.ggml_interleave_jobs.argtypes = [ptr, i64, ptr]
        lib.ggml_interleave_jobs.restype = cint
        lib.ggml_deinterleave_rows.argtypes = [ptr, i64, cint, ptr, i64, i64, ptr, i64]
        lib.ggml_deinterleave_rows.restype = cint
        lib.ggml_interleaves.argtypes = [cint]
        lib.ggml_interleaves.restype = cint
        self._interleaves = lib.ggml_interleaves
        built = ["scalar", "avx2", "avx512"][lib.ggml_isa()]
        if built != isa:
            raise KernelBuildError(f"{path} was built for {built}, not {isa}.")
        self._lib = lib

    @property
    def linear_address(self) -> int:
        """The address of ggml_linear_packed (cpu_ops.c's decoder_forward calls it)."""
        return ctypes.cast(self._linear_packed, ctypes.c_void_p).value

    def act_block(self, qtype: int) -> int:
        """The block (32 or 256 elements) this build quantizes activations to for the type:
        each block's x is rounded to int8 with one scale d = max|x| / 127."""
        return self._act_block(int(qtype))

    def interleaves(self, qtype: int) -> bool:
        """Whether this build runs the type faster interleaved (ggml_linear.interleave)."""
        return bool(self._interleaves(int(qtype)))

    def interleave(
        self, weight: GGMLWeight, out: torch.Tensor, num_threads: int | None = None
    ) -> None:
        """out uint8 (N / 16, 16 * row_bytes), contiguous = the weight interleaved by 16 rows
        (ggml_linear.interleave has the layout) on `num_threads` OpenMP threads (default:
        torch's); the caller checked type and shape."""
        import torch  # not at the module's import (module doc)

        data = weight.data
        assert out.is_contiguous() and out.shape[0] * 16 == weight.out_features
        rc = self._lib.ggml_interleave(
            data.data_ptr(),
            data.stride(0),
            int(weight.qtype),
            weight.out_features,
            weight.in_features,
            out.data_ptr(),
            torch.get_num_threads() if num_threads is None else num_threads,
        )
        if rc:
            raise KernelInputError(f"ggml_interleave: {_type_name(weight.qtype)} refused")

    def interleave_jobs(self, jobs: torch.Tensor, next_job: torch.Tensor) -> None:
        """Run interleave jobs on this thread until none is left: `jobs` int64 (J, 8),
        contiguous, each ggml_interleave's (w, w_stride, qtype, n, k, out) addresses and sizes
        then a span of w's pages (address, bytes; 0 bytes: none) dropped once copied;
        `next_job` int64 (1,), the index of the next job to take, shared by every thread
        that runs the same jobs. One C call: the GIL is released until the jobs are done."""
        import torch  # not at the module's import (module doc)

        assert jobs.dtype == torch.int64 and jobs.is_contiguous() and jobs.shape[1:] == (8,)
        rc = self._lib.ggml_interleave_jobs(jobs.data_ptr(), jobs.shape[0], next_job.data_ptr())
        if rc:
            qtype = int(jobs[rc - 1, 2])
            raise KernelInputError(
                f"ggml_interleave_jobs: job {rc - 1} ({_type_name(qtype)}) refused"
            )

    def deinterleave_rows(self, weight: GGMLWeight, index: torch.Tensor, out: torch.Tensor) -> None:
        """out uint8 (R, row_bytes), contiguous = rows `index` (int64 (R,), contiguous, each
        < N) of an interleaved weight, in the file's layout."""
        import torch  # not at the module's import (module doc)

        assert out.is_contiguous() and index.dtype == torch.int64 and index.is_contiguous()
        assert out.shape[0] == index.numel()
        if index.numel() and not (0 <= int(index.min()) and int(index.max()) < weight.out_features):
            raise KernelInputError(f"row index out of range [0, {weight.out_features})")
        rc = self._lib.ggml_deinterleave_rows(
            weight.data.data_ptr(),
            weight.data.stride(0),
            int(weight.qtype),
            index.data_ptr(),
            index.numel(),
            weight.in_features,
            out.data_ptr(),
            out.stride(0),
        )
        if rc:
            raise KernelInputError(f"ggml_deinterleave_rows: {_type_name(weight.qtype)} refused")

    def linear(self, x: torch.Tensor, weight: GGMLWeight, out: torch.Tensor) -> None:
        """out (T, N) (fp32 or bf16, row stride >= N) = x (T, K) @ W.T; the caller has
        checked the shapes (ggml_linear)."""
        import torch  # not at the module's import (module doc)

        ptr, stride, qtype, n, k = weight._c_args
        bf16 = torch.bfloat16
        args = array.array(
            "q",
            (
                x.data_ptr(),
                x.dtype is bf16,
                x.shape[0],
                k,
                ptr,
                stride,
                qtype,
                n,
                out.data_ptr(),
                out.stride(0),
                out.dtype is bf16,
                torch.get_num_threads(),
                weight.interleaved,
            ),
        )
        rc = self._linear_packed(args.buffer_info()[0])  # `args` lives through the call
        if rc == -2:
            raise MemoryError(f"ggml_linear: no memory for {x.shape[0]} quantized rows")
        if rc:
            raise KernelInputError(f"ggml_linear: the C kernel refused {_type_name(weight.qtype)}")

    def dequantize_rows(self, weight: GGMLWeight, first: int, out: torch.Tensor) -> None:
        """out (R, K) fp32 or bf16, contiguous = rows first .. first + R of the weight as
        scale * u + bias: within an fp32 rounding of `dequantize` (not gguf's order of
        operations), for the large-step GEMM."""
        import torch  # not at the module's import (module doc)

        rows = out.shape[0]
        assert out.shape[1] == weight.in_features and out.is_contiguous()
        assert 0 <= first and first + rows <= weight.out_features
        data = weight.data
        rc = self._lib.ggml_dequantize_tile(
            data.data_ptr() + first * data.stride(0),
            data.stride(0),
            int(weight.qtype),
            rows,
            weight.in_features,
            out.data_ptr(),
            out.stride(0),
            int(out.dtype == torch.bfloat16),
            torch.get_num_threads(),
        )
        if rc:
            raise KernelInputError(f"ggml_dequantize_tile: type {_type_name(weight.qtype)} refused")

    def dequantize(self, weight: GGMLWeight, out: torch.Tensor) -> None:
        """out (N, K) fp32 contiguous = the weight, dequantized."""
        import torch  # not at the module's import (module doc)

        assert out.shape == (weight.out_features, weight.in_features) and out.is_contiguous()
        rc = self._lib.ggml_dequantize(
            weight.data.data_ptr(),
            weight.data.stride(0),
            int(weight.qtype),
            weight.out_features,
            weight.in_features,
            out.data_ptr(),
            out.stride(0),
            torch.get_num_threads(),
        )
        if rc:
            raise KernelInputError(f"ggml_dequantize: type {_type_name(weight.qtype)} refused")


@functools.cache
def load_ggml_kernels(build_dir: Path, isa: str) -> GGMLKernels:
    """Build (once per source, flags and CPU) and load the library for `isa` (one of ISAS).
    Raises KernelBuildError with the compiler's message when it cannot be built."""
    flags = ISAS[isa][1] + EXTRA_FLAGS
    return GGMLKernels(build_library(SOURCE, Path(build_dir), flags), isa)


@functools.cache
def default_kernels() -> GGMLKernels:
    """The library of `selected_isa()` in `default_build_dir()`, chosen on first use (the
    environment is read once per process)."""
    return load_ggml_kernels(default_build_dir(), selected_isa())
