"""Linear layers over GGML's quantized block types, in their own format on the CPU.

A `GGMLWeight` holds a GGUF tensor's bytes as they are in the file: uint8 (N, row_bytes),
each row the K / block_elems blocks of one output row (a view of a memory map is fine; it is
never copied unless asked). `ggml_linear(x, weight)` computes x @ W.T through ggml_quants.c:
the activations quantized to int8 per block of 32 and integer dot products against the
unpacked weight blocks (ggml's approach), each weight block read once for all the rows of a
step. The C library is built on first use for the best instruction set of this CPU
(AVX-512 VNNI, AVX2, or portable C); `AGENTRT_GGML_ISA=scalar|avx2|avx512` forces one (read once, on first use); every function
also takes `kernels=load_ggml_kernels(build_dir, isa)` to run another build.

Types: SUPPORTED_TYPES. F32 / F16 / BF16 pass through torch (dense); any other type raises
`UnsupportedGGMLType` naming the tensor. References: `ggml_linear_ref` (gguf-py's numpy
dequantize, then an fp32 product), which the tests hold the kernels to.
"""

from __future__ import annotations

import array
import ctypes
import functools
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch

from .cpu_build import build_library
from .errors import KernelBuildError, KernelInputError

SOURCE = Path(__file__).with_name("ggml_quants.c")
_Q = gguf.GGMLQuantizationType
QUANTIZED_TYPES = frozenset(
    {_Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q8_0, _Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K}
)
DENSE_DTYPES = {_Q.F32: torch.float32, _Q.F16: torch.float16, _Q.BF16: torch.bfloat16}
SUPPORTED_TYPES = frozenset(QUANTIZED_TYPES | DENSE_DTYPES.keys())

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
_EXTRA_FLAGS = ("-ffp-contract=off",)  # dequantize rounds as gguf-py's numpy does: no FMA

# Steps of at least LARGE_STEP_ROWS rows take tiles of the weight dequantized to bf16 into
# torch's bf16 GEMM (oneDNN; AVX-512 BF16 where the CPU has it) instead of the int8 kernel.
# Measured on this 2-core AMD EPYC (AVX-512 VNNI + BF16), one thread, best of 7, us per call,
# int8 kernel vs bf16 tiles:
#   T=16: Q4_1 3072x576 732 vs 1318, Q4_1 576x1536 384 vs 498, Q4_K 2048x2048 1334 vs 1929,
#         Q8_0 2048x2048 1754 vs 1716
#   T=32: 1785 vs 1683, 755 vs 653, 2718 vs 2392, 3449 vs 2571
#   T=48: 2695 vs 1590, 1095 vs 766, 12080 vs 3107, 15481 vs 3406
# so the crossover is at ~32 rows. A tile holds ~LARGE_STEP_TILE_BYTES of bf16 weights (it
# stays in L2 while the GEMM reads it); there is never more than one tile beside the blocks.
LARGE_STEP_ROWS = 32
LARGE_STEP_TILE_BYTES = 1 << 19


class UnsupportedGGMLType(KernelInputError):
    """A GGUF tensor's block type has no kernel here."""


def type_name(qtype: int) -> str:
    try:
        return _Q(qtype).name
    except ValueError:
        return f"unknown type {qtype}"


def check_ggml_type(qtype: int, tensor_name: str) -> None:
    """Raises UnsupportedGGMLType naming the tensor, its type and the supported list."""
    if qtype not in SUPPORTED_TYPES:
        names = ", ".join(sorted(type_name(t) for t in SUPPORTED_TYPES))
        raise UnsupportedGGMLType(
            f"tensor {tensor_name!r} has GGML type {type_name(qtype)}, which agentrt cannot run; "
            f"supported: {names}. Requantize the file to one of them (e.g. llama.cpp's "
            "llama-quantize to Q4_K_M).",
            arg=tensor_name,
        )


def block_shape(qtype: int) -> tuple[int, int]:
    """(elements, bytes) of one block of the type."""
    return gguf.GGML_QUANT_SIZES[_Q(qtype)]


@dataclass(frozen=True, slots=True)
class GGMLWeight:
    """One weight (N, K) in GGML's block layout. `data` uint8 (N, row_bytes), last stride 1,
    each row the K / block_elems blocks of one output row exactly as in the file; `qtype` a
    gguf.GGMLQuantizationType value; `in_features` K, a multiple of the block size."""

    data: torch.Tensor
    qtype: int
    in_features: int
    # What the C kernel takes of it, read once: (data address, row stride, qtype, N, K).
    _c_args: tuple[int, int, int, int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_ggml_type(self.qtype, "GGMLWeight")
        elems, size = block_shape(self.qtype)
        d = self.data
        if self.in_features % elems:
            raise KernelInputError(
                f"in_features {self.in_features} is not a multiple of {type_name(self.qtype)}'s "
                f"block of {elems}.",
                arg="in_features",
            )
        row_bytes = self.in_features // elems * size
        if d.dtype != torch.uint8 or d.dim() != 2 or d.shape[1] != row_bytes or d.is_cuda:
            raise KernelInputError(
                f"GGMLWeight data is {d.dtype} {tuple(d.shape)} on {d.device}; expected uint8 "
                f"(N, {row_bytes}) on the CPU ({self.in_features} {type_name(self.qtype)} "
                "elements a row).",
                arg="data",
            )
        if d.stride(1) != 1 or (d.shape[0] > 1 and d.stride(0) < row_bytes):
            raise KernelInputError(
                f"GGMLWeight data has strides {d.stride()}; each row's bytes must be contiguous.",
                arg="data",
            )
        args = (d.data_ptr(), d.stride(0), int(self.qtype), d.shape[0], self.in_features)
        object.__setattr__(self, "_c_args", args)

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        return self.data.shape[0] * self.data.shape[1]

    def select_rows(self, index: slice | torch.Tensor) -> GGMLWeight:
        """The weight of these output rows (a tensor-parallel slice, a permutation); a slice
        stays a view of the same bytes, an index tensor gathers a copy."""
        return GGMLWeight(self.data[index], self.qtype, self.in_features)

    def dequantize(
        self, dtype: torch.dtype = torch.float32, kernels: GGMLKernels | None = None
    ) -> torch.Tensor:
        """(N, K) in `dtype`, through the C kernel (bit for bit gguf-py's dequantize);
        `kernels` (default: `default_kernels()`) picks another build."""
        if self.qtype in DENSE_DTYPES:
            return self._dense().to(dtype)
        out = torch.empty((self.out_features, self.in_features), dtype=torch.float32)
        (kernels or default_kernels()).dequantize(self, out)
        return out if dtype == torch.float32 else out.to(dtype)

    def _dense(self) -> torch.Tensor:
        return self.data.view(DENSE_DTYPES[self.qtype])  # (N, K)


def _check_x(x: torch.Tensor, weight: GGMLWeight, dtypes: tuple[torch.dtype, ...]) -> int:
    if (
        x.dtype not in dtypes
        or x.dim() != 2
        or x.shape[1] != weight.in_features
        or not x.is_contiguous()
        or x.is_cuda
    ):
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise KernelInputError(
            f"x is {x.dtype} {tuple(x.shape)} (contiguous: {x.is_contiguous()}, on {x.device}); "
            f"expected {names} (T, {weight.in_features}), contiguous, on the CPU.",
            arg="x",
        )
    return x.shape[0]


def _check_out(out: torch.Tensor | None, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    if out is None:
        return torch.empty((rows, cols), dtype=dtype)
    if (
        out.dtype != dtype
        or out.shape != (rows, cols)
        or (cols > 1 and out.stride(1) != 1)
        or (rows > 1 and out.stride(0) < cols)
        or out.is_cuda
    ):
        raise KernelInputError(
            f"out is {out.dtype} {tuple(out.shape)} with strides {out.stride()}; expected "
            f"{str(dtype).removeprefix('torch.')} ({rows}, {cols}) with its last stride 1 "
            "(a column slice of a wider tensor is fine), on the CPU.",
            arg="out",
        )
    return out


def ggml_linear(
    x: torch.Tensor,
    weight: GGMLWeight,
    out: torch.Tensor | None = None,
    kernels: GGMLKernels | None = None,
) -> torch.Tensor:
    """x (T, K) fp32 or bf16, contiguous, CPU -> out (T, N) fp32 = x @ W.T. `out` may be a
    column slice of a wider fp32 tensor (its row stride >= N, last stride 1): the parts of a
    fused projection with different types write side by side. `kernels`: another build
    than `default_kernels()` (tests run each instruction set so)."""
    rows = _check_x(x, weight, _X_DTYPES)
    out = _check_out(out, rows, weight.out_features, torch.float32)
    return _product(x, weight, out, kernels)


def ggml_linear_bf16(
    x: torch.Tensor,
    weight: GGMLWeight,
    out: torch.Tensor | None = None,
    kernels: GGMLKernels | None = None,
) -> torch.Tensor:
    """As ggml_linear, for the fused CPU glue (kernels/cpu_ops.py hands bf16 rows between
    products): x bf16 (T, K) -> out bf16 (T, N), each sum rounded once from fp32."""
    rows = _check_x(x, weight, _BF16_ONLY)
    out = _check_out(out, rows, weight.out_features, torch.bfloat16)
    return _product(x, weight, out, kernels)


_X_DTYPES, _BF16_ONLY = (torch.float32, torch.bfloat16), (torch.bfloat16,)


def _product(
    x: torch.Tensor, weight: GGMLWeight, out: torch.Tensor, kernels: GGMLKernels | None
) -> torch.Tensor:
    rows = x.shape[0]
    if weight.qtype in DENSE_DTYPES:
        out.copy_(x.float() @ weight._dense().float().T)
    elif rows >= LARGE_STEP_ROWS:
        _large_step(x, weight, out, kernels or default_kernels())
    elif rows:
        (kernels or default_kernels()).linear(x, weight, out)
    return out


def _large_step(x: torch.Tensor, weight: GGMLWeight, out: torch.Tensor, kernels: GGMLKernels):
    """out = x @ W.T by tiles of W's rows dequantized to bf16, each into torch's bf16 GEMM
    (fp32 accumulation): x and W rounded to bf16 (2^-9 relative each), summed in fp32."""
    n, k = weight.out_features, weight.in_features
    tile_rows = max(16, min(512, LARGE_STEP_TILE_BYTES // (2 * k)) // 16 * 16)
    tile = torch.empty((min(tile_rows, n), k), dtype=torch.bfloat16)
    xb = x.to(torch.bfloat16)
    for n0 in range(0, n, tile_rows):
        part = tile[: min(tile_rows, n - n0)]
        kernels.dequantize_rows(weight, n0, part)
        out[:, n0 : n0 + part.shape[0]].copy_(xb @ part.T)


def ggml_embedding(
    ids: torch.Tensor, weight: GGMLWeight, kernels: GGMLKernels | None = None
) -> torch.Tensor:
    """ids int64 (T,) -> (T, K) fp32: those rows of a (vocab, K) weight, dequantized."""
    if ids.dtype != torch.int64 or ids.dim() != 1 or ids.is_cuda:
        raise KernelInputError(
            f"ids is {ids.dtype} {tuple(ids.shape)} on {ids.device}; expected int64 (T,) on the "
            "CPU.",
            arg="ids",
        )
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= weight.out_features):
        raise KernelInputError(
            f"ids must lie in [0, {weight.out_features}); got {int(ids.min())}..{int(ids.max())}.",
            arg="ids",
        )
    return weight.select_rows(ids).dequantize(kernels=kernels)


# Byte offsets of each quantized type's fp16 scale fields (d, dmin) within its block.
FP16_FIELDS = {
    _Q.Q4_0: (0,),
    _Q.Q4_1: (0, 2),
    _Q.Q5_0: (0,),
    _Q.Q5_1: (0, 2),
    _Q.Q8_0: (0,),
    _Q.Q2_K: (80, 82),
    _Q.Q3_K: (108,),
    _Q.Q4_K: (0, 2),
    _Q.Q5_K: (0, 2),
    _Q.Q6_K: (208,),
}


def random_weight(qtype: int, n: int, k: int, seed: int = 0, scale: float = 0.01) -> GGMLWeight:
    """Random blocks of a quantized type (tests, benchmarks, synthetic files): random bytes
    are valid blocks of every type once the fp16 scale fields hold finite values, here
    normal with std `scale`."""
    elems, size = block_shape(qtype)
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n * k // elems, size), dtype=np.uint8)
    for offset in FP16_FIELDS[_Q(qtype)]:
        scales = (rng.standard_normal(len(blocks)) * scale).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return GGMLWeight(torch.from_numpy(blocks.reshape(n, -1)), int(qtype), k)


def dequantize_ref(weight: GGMLWeight) -> torch.Tensor:
    """(N, K) fp32 by gguf-py's numpy dequantize."""
    data = np.ascontiguousarray(weight.data.numpy())
    return torch.from_numpy(gguf.quants.dequantize(data, _Q(weight.qtype)).astype(np.float32))


def ggml_linear_ref(x: torch.Tensor, weight: GGMLWeight) -> torch.Tensor:
    """What ggml_linear computes, unquantized activations: x.float() @ dequantize(W).T, fp32."""
    return x.float() @ dequantize_ref(weight).T


# ---- The C library --------------------------------------------------------------------------


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
        lib.ggml_linear.argtypes += [cint, cint]
        lib.ggml_dequantize.argtypes = [ptr, i64, cint, i64, i64, ptr, i64, cint]
        lib.ggml_dequantize_tile.argtypes = [ptr, i64, cint, i64, i64, ptr, i64, cint, cint]
        for fn in (lib.ggml_linear, lib.ggml_dequantize, lib.ggml_dequantize_tile, lib.ggml_isa):
            fn.restype = cint
        lib.ggml_linear_packed.argtypes = [ctypes.c_void_p]
        lib.ggml_linear_packed.restype = cint
        self._linear_packed = lib.ggml_linear_packed
        built = ["scalar", "avx2", "avx512"][lib.ggml_isa()]
        if built != isa:
            raise KernelBuildError(f"{path} was built for {built}, not {isa}.")
        self._lib = lib

    def linear(self, x: torch.Tensor, weight: GGMLWeight, out: torch.Tensor) -> None:
        """out (T, N) (fp32 or bf16, row stride >= N) = x (T, K) @ W.T; the caller has
        checked the shapes (ggml_linear)."""
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
            ),
        )
        rc = self._linear_packed(args.buffer_info()[0])  # `args` lives through the call
        if rc == -2:
            raise MemoryError(f"ggml_linear: no memory for {x.shape[0]} quantized rows")
        if rc:
            raise KernelInputError(f"ggml_linear: the C kernel refused {type_name(weight.qtype)}")

    def dequantize_rows(self, weight: GGMLWeight, first: int, out: torch.Tensor) -> None:
        """out (R, K) fp32 or bf16, contiguous = rows first .. first + R of the weight as
        scale * u + bias: within an fp32 rounding of `dequantize` (not gguf's order of
        operations), for the large-step GEMM."""
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
            raise KernelInputError(f"ggml_dequantize_tile: type {type_name(weight.qtype)} refused")

    def dequantize(self, weight: GGMLWeight, out: torch.Tensor) -> None:
        """out (N, K) fp32 contiguous = the weight, dequantized."""
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
            raise KernelInputError(f"ggml_dequantize: type {type_name(weight.qtype)} refused")


@functools.cache
def load_ggml_kernels(build_dir: Path, isa: str) -> GGMLKernels:
    """Build (once per source, flags and CPU) and load the library for `isa` (one of ISAS).
    Raises KernelBuildError with the compiler's message when it cannot be built."""
    flags = ISAS[isa][1] + _EXTRA_FLAGS
    return GGMLKernels(build_library(SOURCE, Path(build_dir), flags), isa)


@functools.cache
def default_kernels() -> GGMLKernels:
    """The library of `selected_isa()` in `default_build_dir()`, chosen on first use (the
    environment is read once per process)."""
    return load_ggml_kernels(default_build_dir(), selected_isa())
