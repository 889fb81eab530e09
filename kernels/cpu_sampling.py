"""The top of a step's logits on the CPU: argmax and top-k in one pass over each row, a C
library (cpu_sampling.c) built on first use (cpu_build.py). Get one with
`load_cpu_sampling(build_dir)`, or the process's with `default_cpu_sampling()`.

torch's `argmax` and `topk` do not vectorize on the CPU: over a 150k-token vocabulary they
cost 0.3-1 ms a row, more than the rest of the sampler. References: `torch.argmax` (the same
index, ties to the lowest, NaN as the largest) and a stable descending sort (`top_k_ref`),
which the tests hold the kernels to.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .cpu_build import build_library
from .errors import KernelInputError
from .ggml_library import default_build_dir

SOURCE = Path(__file__).with_name("cpu_sampling.c")


def _check(logits: torch.Tensor) -> None:
    if (
        logits.dtype != torch.float32
        or logits.dim() != 2
        or logits.is_cuda
        or (logits.shape[1] > 1 and logits.stride(1) != 1)
        or logits.shape[1] == 0
    ):
        raise KernelInputError(
            f"logits are {logits.dtype} {tuple(logits.shape)} with strides {logits.stride()} "
            f"on {logits.device}; expected float32 (B, V > 0), its last stride 1, on the CPU.",
            arg="logits",
        )


class CpuSampling:
    """The loaded library."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.argmax_rows.argtypes = [ptr, i64, i64, i64, ptr]
        lib.argmax_rows.restype = None
        lib.top_k_rows.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr]
        lib.top_k_rows.restype = ctypes.c_int
        lib.softmax_draw_rows.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ptr]
        lib.softmax_draw_rows.restype = ctypes.c_int
        lib.cpu_sampling_has_softmax.restype = ctypes.c_int
        # softmax_draw runs on AVX-512 builds, over rows of a multiple of 16 values
        self.has_softmax = bool(lib.cpu_sampling_has_softmax())
        self._lib = lib

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """logits float32 (B, V) -> (B,) int64: torch.argmax(logits, -1)."""
        _check(logits)
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self._lib.argmax_rows(
            logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0), out.data_ptr()
        )
        return out

    def top_k(
        self, logits: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """logits float32 (B, V), 1 <= k <= V -> (values (B, k), ids (B, k) int64, num_ge (B,)
        int64): each row's k largest by value descending then id ascending, and how many of
        the row's values are >= its k-th (k plus the ties beyond it); num_ge is -1 for a row
        holding a NaN."""
        _check(logits)
        rows, n = logits.shape
        if not 1 <= k <= n:
            raise KernelInputError(f"k = {k}; expected 1 <= k <= {n}.", arg="k")
        values = torch.empty(rows, k)
        ids = torch.empty(rows, k, dtype=torch.int64)
        num_ge = torch.empty(rows, dtype=torch.int64)
        rc = self._lib.top_k_rows(
            logits.data_ptr(),
            rows,
            n,
            logits.stride(0),
            k,
            values.data_ptr(),
            ids.data_ptr(),
            num_ge.data_ptr(),
        )
        if rc:
            raise MemoryError(f"top_k_rows: no memory for k = {k}")
        return values, ids, num_ge

    def softmax_draw(
        self, logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits float32 (R, V), V a multiple of 16; temperature float32 (R,) > 0; uniform
        float32 (R,) in [0, 1) or None -> (totals (R,): each row's sum of exp(x / t - max),
        softmax(x / t)'s denominator; tokens (R,) int64 or None: the inverse-CDF draw of
        `uniform` from the row's softmax in id order, as `draw_inverse_cdf` takes it, -1 for a
        row holding a NaN (its total NaN)). Needs `has_softmax`."""
        _check(logits)
        rows, n = logits.shape
        for name, t in (("temperature", temperature), ("uniform", uniform)):
            if t is not None and (t.dtype != torch.float32 or t.shape != (rows,) or t.is_cuda):
                raise KernelInputError(f"{name}: expected float32 ({rows},) on the CPU.", arg=name)
        temperature = temperature.contiguous()
        uniform = None if uniform is None else uniform.contiguous()
        totals = torch.empty(rows)
        tokens = None if uniform is None else torch.empty(rows, dtype=torch.int64)
        rc = self._lib.softmax_draw_rows(
            logits.data_ptr(),
            rows,
            n,
            logits.stride(0),
            temperature.data_ptr(),
            None if uniform is None else uniform.data_ptr(),
            totals.data_ptr(),
            None if tokens is None else tokens.data_ptr(),
        )
        if rc == -2:
            raise MemoryError("softmax_draw_rows: no memory")
        if rc:
            raise KernelInputError(
                f"softmax_draw: {n} columns (a multiple of 16 needed) or no AVX-512 build.",
                arg="logits",
            )
        return totals, tokens


def top_k_ref(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What CpuSampling.top_k computes, by a stable descending sort of each row."""
    values, ids = logits.sort(dim=-1, descending=True, stable=True)
    num_ge = (logits >= values[:, k - 1 : k]).sum(dim=-1)
    num_ge[logits.isnan().any(dim=-1)] = -1
    return values[:, :k], ids[:, :k], num_ge


@functools.cache
def load_cpu_sampling(build_dir: Path) -> CpuSampling:
    """Build (once per source, flags and CPU) and load the library."""
    return CpuSampling(build_library(SOURCE, Path(build_dir)))


@functools.cache
def default_cpu_sampling() -> CpuSampling:
    """The library in ggml_library's `default_build_dir()`, loaded once per process."""
    return load_cpu_sampling(default_build_dir())
