"""agentrt.kernels: Triton kernels for the engine, each with a pure-torch reference.

Public functions dispatch per call (Triton on CUDA tensors, the reference elsewhere):
`reshape_and_cache`, `paged_attention`, `apply_token_bitmask`, `rms_norm`,
`rotary_embedding`. The `*_ref` references are exported too. Importing this package needs
neither CUDA nor Triton; the Triton kernels live in the `triton_*` modules, which import
Triton themselves and are loaded on first use. `load_cpu_attention(build_dir)` builds and
loads the C paged-attention kernel that the engine's CPU attention backend uses;
`load_cpu_ops(build_dir)` the fused glue of quantized layers on the CPU. `ggml_linear`
(and `GGMLWeight`, `ggml_embedding`, ...) runs GGUF's quantized block types in their own
format on the CPU: import it from `agentrt.kernels.ggml_linear` (not re-exported here, where
the function's name would hide its module). This package imports nothing local, and its
names load lazily: importing a torch-free module of it (ggml_types, ggml_library) imports no
torch (LLM reads a GGUF file's header before it imports torch).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "CpuAttention": "cpu_attention",
    "load_cpu_attention": "cpu_attention",
    "unsupported_shape": "cpu_attention",
    "CpuOps": "cpu_ops",
    "load_cpu_ops": "cpu_ops",
    "apply_token_bitmask": "dispatch",
    "paged_attention": "dispatch",
    "require_triton": "dispatch",
    "reshape_and_cache": "dispatch",
    "rms_norm": "dispatch",
    "rotary_embedding": "dispatch",
    "triton_available": "dispatch",
    "uses_triton": "dispatch",
    "KernelBuildError": "errors",
    "KernelError": "errors",
    "KernelInputError": "errors",
    "TritonUnavailableError": "errors",
    "merge_attn_states_ref": "reference_attention",
    "paged_attention_ref": "reference_attention",
    "reshape_and_cache_ref": "reference_attention",
    "apply_token_bitmask_ref": "reference_ops",
    "rms_norm_ref": "reference_ops",
    "rotary_embedding_ref": "reference_ops",
    "unpack_bitmask": "reference_ops",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
