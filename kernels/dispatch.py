"""Pick the implementation per call: the Triton kernel for CUDA tensors when Triton imports,
the pure-torch reference otherwise (CPU tensors, or no Triton).

The Triton modules are imported here lazily, on first CUDA use, so `import agentrt.kernels`
needs neither CUDA nor Triton. An engine configured for the "triton" attention backend calls
`require_triton()` once at start-up to fail early with an install hint instead of silently
running the references on the GPU.
"""

from __future__ import annotations

import functools
import importlib

import torch

from .errors import TritonUnavailableError
from .reference_attention import paged_attention_ref, reshape_and_cache_ref
from .reference_ops import apply_token_bitmask_ref, rms_norm_ref, rotary_embedding_ref


@functools.cache
def triton_available() -> bool:
    """True when `import triton` succeeds (cached: Triton is not installed mid-process)."""
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def require_triton() -> None:
    """Raise TritonUnavailableError, with the install hint, unless Triton imports."""
    if not triton_available():
        raise TritonUnavailableError(
            "the 'triton' attention backend needs the triton package; install it with "
            "`pip install 'agentrt[triton]'` or choose the 'torch' backend."
        )


def uses_triton(t: torch.Tensor) -> bool:
    """Whether dispatch sends a call whose main tensor is `t` to a Triton kernel."""
    return t.is_cuda and triton_available()


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write K/V [num_tokens, num_kv_heads, head_dim] into the paged cache (see the ref)."""
    if uses_triton(kv_cache):
        from .triton_reshape_and_cache import reshape_and_cache_triton

        return reshape_and_cache_triton(key, value, kv_cache, slot_mapping)
    return reshape_and_cache_ref(key, value, kv_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal varlen attention over the paged cache; returns [num_tokens, num_heads, head_dim].

    See `paged_attention_ref` for the exact semantics. Passing max_query_len / max_seq_len
    spares the Triton path a device sync.
    """
    if uses_triton(query):
        from .triton_paged_attention import paged_attention_triton

        impl = paged_attention_triton
    else:
        impl = paged_attention_ref
    return impl(
        query,
        kv_cache,
        query_start_loc,
        seq_lens,
        block_tables,
        scale,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        out=out,
    )


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None
) -> None:
    """In place: disallowed logits -> -inf (xgrammar bitmask layout; see the ref)."""
    if uses_triton(logits):
        from .triton_bitmask import apply_token_bitmask_triton

        return apply_token_bitmask_triton(logits, bitmask, indices)
    return apply_token_bitmask_ref(logits, bitmask, indices)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm; with `residual` returns (norm(x + residual), x + residual) (see the ref)."""
    if uses_triton(x):
        from .triton_rms_norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    is_neox: bool = True,
) -> None:
    """In place RoPE on query and key at per-token positions (see the ref)."""
    if uses_triton(query):
        from .triton_rotary import rotary_embedding_triton

        return rotary_embedding_triton(positions, query, key, cos_sin_cache, head_size, is_neox)
    return rotary_embedding_ref(positions, query, key, cos_sin_cache, head_size, is_neox)
