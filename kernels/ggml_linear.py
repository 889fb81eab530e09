"""Linear layers over GGML's quantized block types, in their own format on the CPU.

A `GGMLWeight` holds a GGUF tensor's bytes as they are in the file: uint8 (N, row_bytes),
each row the K / block_elems blocks of one output row (a view of a memory map is fine; it is
never copied unless asked). `ggml_linear(x, weight)` computes x @ W.T through ggml_quants.c:
the activations quantized to int8 per block of 32 (of 256 for Q4_K / Q5_K / Q6_K on
AVX-512, ggml's Q8_K: `GGMLKernels.act_block`) and integer dot products against the
unpacked weight blocks (ggml's approach), each weight block read once for all the rows of a
step. The C library is built on first use for the best instruction set of this CPU
(AVX-512 VNNI, AVX2, or portable C); `AGENTRT_GGML_ISA=scalar|avx2|avx512` forces one
(read once, on first use); every function also takes `kernels=load_ggml_kernels(build_dir,
isa)` to run another build (ggml_library.py).
On AVX-512, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q6_K run faster with the rows of a
weight interleaved by 16 (on AVX2 the five legacy types; 1.3-1.8x streaming from memory, ~3x
in cache)
(`interleave`, done once at load; `GGMLWeight.interleaved`): each vector lane sums one row,
so the scales of 16 rows are one vector and no lanes are summed at the end.
Every step size takes the same kernel, so a row's result does not depend on the step it is
in (see the note on long steps below). `ggml_linear_bf16` is the variant for the fused CPU glue
(bf16 rows in and out, as kernels/cpu_ops.py hands them between products).

Types: SUPPORTED_TYPES. F32 / F16 / BF16 pass through torch (dense); any other type raises
`UnsupportedGGMLType` naming the tensor. References: `ggml_linear_ref` (gguf-py's numpy
dequantize, then an fp32 product), which the tests hold the kernels to.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from .errors import KernelInputError
from .ggml_library import (
    ISA_ENV,
    ISAS,
    GGMLKernels,
    available_isas,
    default_build_dir,
    default_kernels,
    load_ggml_kernels,
    selected_isa,
)
from .ggml_types import BLOCK_SIZES, GGMLType, type_name

# GGMLType (ggml_types.py: gguf-py's ids without importing gguf-py) is the one home of the
# type ids for the package and the engine.
_Q = GGMLType  # its short name within this module
QUANTIZED_TYPES = frozenset(
    {_Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q8_0, _Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K}
)
__all__ = [  # the library's names are re-exported for callers and tests
    "DENSE_DTYPES",
    "GGMLType",
    "ISAS",
    "ISA_ENV",
    "SUPPORTED_TYPES",
    "GGMLKernels",
    "GGMLWeight",
    "UnsupportedGGMLType",
    "available_isas",
    "check_ggml_type",
    "default_build_dir",
    "default_kernels",
    "ggml_embedding",
    "ggml_linear",
    "ggml_linear_bf16",
    "ggml_linear_ref",
    "interleave",
    "load_ggml_kernels",
    "selected_isa",
]
# The types `interleave` lays out by ROWS_INTERLEAVED rows (GGMLKernels.interleaves: which
# build runs which of them so).
INTERLEAVED_TYPES = frozenset({_Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q8_0, _Q.Q4_K, _Q.Q6_K})
ROWS_INTERLEAVED = 16
DENSE_DTYPES = {_Q.F32: torch.float32, _Q.F16: torch.float16, _Q.BF16: torch.bfloat16}
SUPPORTED_TYPES = frozenset(QUANTIZED_TYPES | DENSE_DTYPES.keys())

# Long steps (prefills, big batches) run the same int8 kernel: the C code takes their
# activation rows a tile at a time (~256 KiB quantized, within L2) against every weight row.
# A GEMM over dequantized tiles was measured (1 thread, us per call, int8 kernel vs tiles):
#   bf16 tiles into torch's bf16 GEMM, T=48: Q4_1 3072x576 2695 vs 1590, Q4_K 2048x2048
#     12080 vs 3107 (before the Q8_K kernel); faster, but x and W rounded to bf16 give other
#     numbers than the int8 kernel (~0.5%), so a prompt's logits depended on how it was split
#     into steps and a prefix-cache hit decoded other tokens than a cold run;
#   fp32 tiles of the int8-rounded x (the kernel's numbers to 5e-7), T=256: Q4_1 3072x576
#     30.9 ms vs 45.0, Q8_0 2048x2048 69.7 vs 92.8, Q4_K 2048x2048 85.4 vs 56.8, before the
#     activation tiles made the kernel ~30% faster on long steps (Q4_1 25.0 -> 18.0 ms,
#     Q8_0 68.9 -> 50.7 ms, C alone): no longer ahead.
# So every step size takes the kernel, and its numbers do not depend on the step.


class UnsupportedGGMLType(KernelInputError):
    """A GGUF tensor's block type has no kernel here."""


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
    return BLOCK_SIZES[_Q(qtype)]


@dataclass(frozen=True, slots=True)
class GGMLWeight:
    """One weight (N, K) in GGML's block layout. `data` uint8 (N, row_bytes), last stride 1,
    each row the K / block_elems blocks of one output row exactly as in the file; `qtype` a
    GGMLType value; `in_features` K, a multiple of the block size."""

    data: torch.Tensor
    qtype: int
    in_features: int
    # True: `data` is (N / 16, interleaved_row_bytes), the rows interleaved by `interleave`.
    interleaved: bool = False
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
        if self.interleaved and self.qtype not in INTERLEAVED_TYPES:
            raise KernelInputError(
                f"{type_name(self.qtype)} has no interleaved layout.", arg="interleaved"
            )
        if self.interleaved:
            row_bytes, rows = interleaved_row_bytes(self.qtype, self.in_features), "N / 16"
        else:
            row_bytes, rows = self.in_features // elems * size, "N"
        if d.dtype != torch.uint8 or d.dim() != 2 or d.shape[1] != row_bytes or d.is_cuda:
            raise KernelInputError(
                f"GGMLWeight data is {d.dtype} {tuple(d.shape)} on {d.device}; expected uint8 "
                f"({rows}, {row_bytes}) on the CPU ({self.in_features} {type_name(self.qtype)} "
                "elements a row).",
                arg="data",
            )
        if d.stride(1) != 1 or (d.shape[0] > 1 and d.stride(0) < row_bytes):
            raise KernelInputError(
                f"GGMLWeight data has strides {d.stride()}; each row's bytes must be contiguous.",
                arg="data",
            )
        n = d.shape[0] * (ROWS_INTERLEAVED if self.interleaved else 1)
        args = (d.data_ptr(), d.stride(0), int(self.qtype), n, self.in_features)
        object.__setattr__(self, "_c_args", args)

    def __reduce__(self):
        # Rebuilt through __init__ (pickled to another process, copied): `_c_args` holds an
        # address valid only for this object's tensor.
        return (GGMLWeight, (self.data, self.qtype, self.in_features, self.interleaved))

    @property
    def out_features(self) -> int:
        return self._c_args[3]

    @property
    def nbytes(self) -> int:
        return self.data.shape[0] * self.data.shape[1]

    def select_rows(self, index: slice | torch.Tensor) -> GGMLWeight:
        """The weight of these output rows (a tensor-parallel slice, a permutation); a slice
        stays a view of the same bytes, an index tensor gathers a copy (of an interleaved
        weight: rows in the file's layout; a slice on whole groups of 16 stays interleaved)."""
        if self.interleaved:
            g = ROWS_INTERLEAVED
            if isinstance(index, slice):
                start, stop, step = index.indices(self.out_features)
                if step == 1 and start % g == 0 and stop % g == 0:
                    return GGMLWeight(
                        self.data[start // g : stop // g], self.qtype, self.in_features, True
                    )
                index = torch.arange(start, stop, step)
            return GGMLWeight(_interleaved_rows(self, index), self.qtype, self.in_features)
        return GGMLWeight(self.data[index], self.qtype, self.in_features)

    def dequantize(
        self,
        dtype: torch.dtype = torch.float32,
        kernels: GGMLKernels | None = None,
        exact: bool = True,
    ) -> torch.Tensor:
        """(N, K) in `dtype`, through the C kernel: bit for bit gguf-py's dequantize, or with
        `exact=False` the SIMD decoders' scale * u + bias (within an fp32 rounding of it,
        several times faster; fp32 or bf16 written directly, e.g. a GGUF dequantized once
        for a GPU). `kernels` (default: `default_kernels()`) picks another build."""
        if self.qtype in DENSE_DTYPES:
            return self._dense().to(dtype)
        if self.interleaved:
            return deinterleave(self).dequantize(dtype, kernels, exact)
        kernels = kernels or default_kernels()
        direct = not exact and dtype in (torch.float32, torch.bfloat16)
        out = torch.empty(
            (self.out_features, self.in_features), dtype=dtype if direct else torch.float32
        )
        if exact:
            kernels.dequantize(self, out)
        else:
            kernels.dequantize_rows(self, 0, out)
        return out if out.dtype == dtype else out.to(dtype)

    def _dense(self) -> torch.Tensor:
        return self.data.view(DENSE_DTYPES[self.qtype])  # (N, K)


# Bytes of a block of 16 interleaved rows where it is not 16 blocks (ggml_quants.c's
# group_block_bytes): Q4_K's 6-bit scales and mins are held unpacked.
_GROUP_BLOCK_BYTES = {_Q.Q4_K: 64 + 128 + 128 + 16 * 128}


def interleaved_row_bytes(qtype: int, in_features: int) -> int:
    """Bytes of one group of 16 interleaved rows of K = `in_features` (`interleave`)."""
    elems, size = block_shape(qtype)
    return in_features // elems * _GROUP_BLOCK_BYTES.get(_Q(qtype), ROWS_INTERLEAVED * size)


def interleave(weight: GGMLWeight, kernels: GGMLKernels | None = None) -> GGMLWeight:
    """The weight with its rows interleaved by 16 for the SIMD kernels that take it so
    (`GGMLKernels.interleaves`): a copy, (N / 16, interleaved_row_bytes), made by the C
    library (`kernels`, default `default_kernels()`). Each group of 16 rows goes block by
    block; a block of the group holds the 16 rows' scale fields side by side (fp16 d; m of
    Q4_1 / Q5_1; dmin and the 8 sub-block scales and mins of Q4_K unpacked from their 6-bit
    fields; Q6_K's 16 int8 scales), Q5_0's / Q5_1's fifth bits as 8 masks of 64 bits (mask c, bits 4r .. 4r + 3: row
    r's bits 4c .. 4c + 3 of qh), then the block's quants by 4-byte column: column c is the 16
    rows' quant bytes 4c .. 4c + 3 (64 bytes, row r at 4r), so one 64-byte register holds 4
    bytes of each row (Q6_K's ql and qh columns in the order its kernel reads them). Q8_0's
    int8 quants are stored as u = q + 128. ggml_avx512.h spells out each layout. N
    must be a multiple of 16; `deinterleave` and `select_rows` give the file's rows back."""
    qtype, g = weight.qtype, ROWS_INTERLEAVED
    if weight.interleaved:
        return weight
    if qtype not in INTERLEAVED_TYPES or weight.out_features % g:
        raise KernelInputError(
            f"interleave: {type_name(qtype)} ({weight.out_features} rows) has no interleaved "
            f"layout; it needs one of {sorted(_Q(t).name for t in INTERLEAVED_TYPES)} and a "
            f"multiple of {g} rows.",
            arg="weight",
        )
    width = interleaved_row_bytes(qtype, weight.in_features)
    out = torch.empty(weight.out_features // g, width, dtype=torch.uint8)
    (kernels or default_kernels()).interleave(weight, out)
    return GGMLWeight(out, qtype, weight.in_features, interleaved=True)


def _interleaved_rows(weight: GGMLWeight, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` of an interleaved weight in the file's layout, uint8 (R, row_bytes)."""
    elems, size = block_shape(weight.qtype)
    index = index.reshape(-1).long().contiguous()
    out = torch.empty(len(index), weight.in_features // elems * size, dtype=torch.uint8)
    default_kernels().deinterleave_rows(weight, index, out)
    return out


def deinterleave(weight: GGMLWeight) -> GGMLWeight:
    """The file's layout of an interleaved weight (a copy); any other weight as it is."""
    if not weight.interleaved:
        return weight
    rows = _interleaved_rows(weight, torch.arange(weight.out_features))
    return GGMLWeight(rows, weight.qtype, weight.in_features)


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
    if weight.qtype in DENSE_DTYPES:
        out.copy_(x.float() @ weight._dense().float().T)
    elif x.shape[0]:
        (kernels or default_kernels()).linear(x, weight, out)
    return out


def ggml_embedding(
    ids: torch.Tensor,
    weight: GGMLWeight,
    kernels: GGMLKernels | None = None,
    read_rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """ids int64 (T,) -> (T, K) fp32: those rows of a (vocab, K) weight, dequantized.
    `read_rows(ids)`, if given, supplies the rows' blocks ((T, row bytes) uint8, the file's
    layout) instead of `weight.select_rows`."""
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
    if read_rows is None:
        return weight.select_rows(ids).dequantize(kernels=kernels)
    return GGMLWeight(read_rows(ids), weight.qtype, weight.in_features).dequantize(kernels=kernels)


def dequantize_ref(weight: GGMLWeight) -> torch.Tensor:
    """(N, K) fp32 by gguf-py's numpy dequantize."""
    import gguf

    data = np.ascontiguousarray(weight.data.numpy())
    return torch.from_numpy(gguf.quants.dequantize(data, _Q(weight.qtype)).astype(np.float32))


def ggml_linear_ref(x: torch.Tensor, weight: GGMLWeight) -> torch.Tensor:
    """What ggml_linear computes, unquantized activations: x.float() @ dequantize(W).T, fp32."""
    return x.float() @ dequantize_ref(weight).T
