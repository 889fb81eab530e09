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
the function's name would hide its module). This package imports nothing local.
"""

from __future__ import annotations

from .cpu_attention import CpuAttention, load_cpu_attention, unsupported_shape
from .cpu_ops import CpuOps, load_cpu_ops
from .dispatch import (
    apply_token_bitmask,
    paged_attention,
    require_triton,
    reshape_and_cache,
    rms_norm,
    rotary_embedding,
    triton_available,
    uses_triton,
)
from .errors import KernelBuildError, KernelError, KernelInputError, TritonUnavailableError
from .reference_attention import (
    merge_attn_states_ref,
    paged_attention_ref,
    reshape_and_cache_ref,
)
from .reference_ops import (
    apply_token_bitmask_ref,
    rms_norm_ref,
    rotary_embedding_ref,
    unpack_bitmask,
)

__all__ = [
    "CpuAttention",
    "CpuOps",
    "KernelBuildError",
    "KernelError",
    "KernelInputError",
    "TritonUnavailableError",
    "apply_token_bitmask",
    "apply_token_bitmask_ref",
    "load_cpu_attention",
    "load_cpu_ops",
    "merge_attn_states_ref",
    "paged_attention",
    "paged_attention_ref",
    "require_triton",
    "reshape_and_cache",
    "reshape_and_cache_ref",
    "rms_norm",
    "rms_norm_ref",
    "rotary_embedding",
    "rotary_embedding_ref",
    "triton_available",
    "unpack_bitmask",
    "unsupported_shape",
    "uses_triton",
]
