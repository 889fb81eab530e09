"""A sparse MoE MLP over GGML block-format experts in one C call a layer (ggml_experts.c).

`ExpertKernel` holds one layer's experts (each expert's gate_up parts and down weight, as
GGMLWeights of the same block types and shapes for every expert), its fp32 router and the
fused glue's gated activation (cpu_ops.c's `silu_mul`, called from C through its address);
`forward(x)` routes the bf16 rows of x (softmax, top k, renormalised), runs each chosen
expert's products over its tokens' rows once, and returns the weighted sum in bf16: what
engine/model/moe.py's per-expert path computes, operation for operation (the products
are ggml_quants.c's row kernels: the C file includes it), with the router's fp32 sum in its
own order. The library is built per instruction set like ggml_quants.c's
(ggml_library.py), its cache key carrying a hash of ggml_quants.c, which it includes.

Measured (benchmarks/moe_layer.py: one Qwen3-30B-A3B MoE layer, Q4_K gate_up and Q6_K down
interleaved, 4 layers rotating, AMD EPYC, one thread, CPU time, load ~13 on 2 cores): a
decode step's layer 3.6 ms -> 2.4 ms (1.49x); 16 tokens a step 1.24x.
"""

from __future__ import annotations

import array
import ctypes
import functools
import hashlib
from pathlib import Path

import torch

from .cpu_build import build_library
from .cpu_ops import CpuOps
from .errors import KernelInputError
from .ggml_library import EXTRA_FLAGS, ISAS, default_build_dir, selected_isa
from .ggml_linear import GGMLWeight

SOURCE = Path(__file__).with_name("ggml_experts.c")
_QUANTS = Path(__file__).with_name("ggml_quants.c")
_GATED = ("silu_mul", "gelu_tanh_mul")  # cpu_ops.c's gated activations, by name
_ERRORS = {
    -1: "a part this build cannot run, or shapes that do not add up",
    -2: "out of memory",
    -3: "an expert index out of range",
}


class ExpertLibrary:
    """The loaded library of one instruction set."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))  # CDLL releases the GIL during calls
        lib.moe_forward.argtypes = [ctypes.c_void_p]
        lib.moe_forward.restype = ctypes.c_int
        self._moe_forward = lib.moe_forward
        # For callers in C (cpu_decoder.py's one-call decoder).
        self.address = ctypes.cast(lib.moe_forward, ctypes.c_void_p).value

    def moe_forward(self, args: array.array) -> None:
        rc = self._moe_forward(args.buffer_info()[0])  # `args` lives through the call
        if rc:
            raise KernelInputError(f"moe_forward: {_ERRORS.get(rc, rc)}")


@functools.cache
def load_ggml_experts(build_dir: Path, isa: str) -> ExpertLibrary:
    """Build (once per source, flags and CPU) and load the library for `isa` (one of ISAS)."""
    key = hashlib.sha256(_QUANTS.read_bytes()).hexdigest()[:16]  # the source it includes
    flags = ISAS[isa][1] + EXTRA_FLAGS + (f"-DAGENTRT_QUANTS_KEY={key}",)
    return ExpertLibrary(build_library(SOURCE, Path(build_dir), flags))


@functools.cache
def default_experts() -> ExpertLibrary:
    return load_ggml_experts(default_build_dir(), selected_isa())


def gated_address(gated: object) -> int | None:
    """The C function behind `gated` when it is a CpuOps' silu_mul or gelu_tanh_mul (the
    fused glue's activation of gate times up), else None."""
    ops, name = getattr(gated, "__self__", None), getattr(gated, "__name__", "")
    if not isinstance(ops, CpuOps) or name not in _GATED:
        return None
    function = getattr(ctypes.CDLL(str(ops.path)), name)  # the loaded library's own symbol
    return ctypes.cast(function, ctypes.c_void_p).value


def _same(weights: list[GGMLWeight], what: str) -> GGMLWeight:
    first = weights[0]
    for w in weights:
        if (w.qtype, w.out_features, w.in_features, w.interleaved, w.data.stride(0)) != (
            first.qtype,
            first.out_features,
            first.in_features,
            first.interleaved,
            first.data.stride(0),
        ):
            raise KernelInputError(f"experts' {what} differ in block type, shape or layout")
    return first


class ExpertKernel:
    """One MoE layer's experts for moe_forward (module docstring). `gate_up[e]`: expert e's
    gate_up parts (one fused weight, or gate and up of two block types), `down[e]` its down
    weight; `router` (E, H) fp32. Raises KernelInputError for experts the C kernel cannot
    run as one (differing types or shapes)."""

    def __init__(
        self,
        router: torch.Tensor,
        gate_up: list[list[GGMLWeight]],
        down: list[GGMLWeight],
        top_k: int,
        norm_topk_prob: bool,
        gated: int,
        library: ExpertLibrary | None = None,
    ) -> None:
        num_experts, hidden = router.shape
        if router.dtype != torch.float32 or not router.is_contiguous():
            raise KernelInputError("the router must be fp32 (E, H), contiguous", arg="router")
        if len(gate_up) != num_experts or len(down) != num_experts:
            raise KernelInputError(f"{num_experts} experts by the router, not by the weights")
        if len({len(parts) for parts in gate_up}) != 1 or not 1 <= len(gate_up[0]) <= 2:
            raise KernelInputError("each expert's gate_up: the same one or two parts")
        self.library = library or default_experts()
        self.router, self.hidden, self.top_k = router, hidden, top_k
        self.inter = sum(p.out_features for p in gate_up[0]) // 2
        # The weights' addresses, one int64 table per part (kept alive here).
        self._tables, tail, col = [], [len(gate_up[0])], 0
        for i in range(len(gate_up[0])):
            part = _same([parts[i] for parts in gate_up], "gate_up")
            tail += self._part([parts[i] for parts in gate_up], part, col)
            col += part.out_features
        tail += self._part(down, _same(down, "down"), 0)
        self._head = (num_experts, top_k, int(norm_topk_prob), router.data_ptr())
        self._gated, self._tail = gated, tail
        self._weights = (gate_up, down)  # the tables' memory
        # moe_forward's arguments for a caller in C that fills in x, T, out and num_threads
        # (cpu_ops.c's decoder_forward), routed by the router.
        self.decoder_args = self._args(0, 0, 0, self._head[3], (0, 0), 0)

    def _part(self, weights: list[GGMLWeight], first: GGMLWeight, col: int) -> list[int]:
        table = torch.tensor([w.data.data_ptr() for w in weights], dtype=torch.int64)
        self._tables.append(table)
        interleaved = int(first.interleaved)
        return [table.data_ptr(), first.data.stride(0), first.out_features, col, first.qtype,
                interleaved]  # fmt: skip

    def forward(
        self,
        x: torch.Tensor,
        weights: torch.Tensor | None = None,
        chosen: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (T, H) bf16, contiguous -> (T, H) bf16. With `weights` (T, k) fp32 and `chosen`
        (T, k) int64 given, that routing is used instead of the router's."""
        num_tokens = x.shape[0]
        if x.dtype != torch.bfloat16 or x.shape != (num_tokens, self.hidden):
            raise KernelInputError(f"x: bfloat16 (T, {self.hidden}) expected", arg="x")
        x = x.contiguous()
        out = torch.empty(num_tokens, self.hidden, dtype=torch.bfloat16)
        router, routing = self._head[3], (0, 0)
        if chosen is not None and weights is not None:
            shape = (num_tokens, self.top_k)
            if chosen.shape != shape or weights.shape != shape:
                raise KernelInputError(f"weights and chosen: {shape} expected", arg="chosen")
            weights = weights.float().contiguous()
            chosen = chosen.to(torch.int64).contiguous()
            router, routing = 0, (weights.data_ptr(), chosen.data_ptr())
        threads = torch.get_num_threads()
        args = self._args(x.data_ptr(), num_tokens, out.data_ptr(), router, routing, threads)
        self.library.moe_forward(args)
        return out

    def _args(
        self, x: int, num_tokens: int, out: int, router: int, routing: tuple[int, int], threads: int
    ) -> array.array:
        """moe_forward's arguments (ggml_experts.c lists them)."""
        num_experts, top_k, norm, _ = self._head
        head = (x, num_tokens, self.hidden, self.inter, num_experts, top_k, norm, router)
        return array.array("q", (*head, *routing, out, self._gated, threads, *self._tail))
