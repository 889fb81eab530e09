"""Pick the implementation per call: the Triton kernel for CUDA tensors when Triton imports,
the pure-torch reference otherwise (CPU tensors, or no Triton).

Each public function has its reference's signature and docstring; the Triton wrapper takes
the same arguments. The Triton modules are imported lazily, on first CUDA use, so
`import agentrt.kernels` needs neither CUDA nor Triton. An engine configured for the "triton"
attention backend calls `require_triton()` once at start-up to fail early with an install
hint instead of silently running the references on the GPU.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable

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
    """Whether dispatch sends a call whose first argument is `t` to a Triton kernel."""
    return t.is_cuda and triton_available()


def _dispatch(reference: Callable, module: str) -> Callable:
    """`reference`'s signature and docstring; a call runs `<module>.<name>_triton` (same
    arguments) when its first argument is a CUDA tensor and Triton imports, else `reference`.
    The first argument decides for all: every tensor of a call is on one device (the input
    checks of both implementations enforce it)."""
    first = next(iter(inspect.signature(reference).parameters))
    kernel_name = reference.__name__.removesuffix("_ref") + "_triton"

    @functools.wraps(reference)
    def dispatched(*args, **kwargs):
        if uses_triton(args[0] if args else kwargs[first]):
            kernel = getattr(importlib.import_module(f"{__package__}.{module}"), kernel_name)
            return kernel(*args, **kwargs)
        return reference(*args, **kwargs)

    dispatched.__name__ = dispatched.__qualname__ = kernel_name.removesuffix("_triton")
    return dispatched


reshape_and_cache = _dispatch(reshape_and_cache_ref, "triton_reshape_and_cache")
paged_attention = _dispatch(paged_attention_ref, "triton_paged_attention")
apply_token_bitmask = _dispatch(apply_token_bitmask_ref, "triton_bitmask")
rms_norm = _dispatch(rms_norm_ref, "triton_rms_norm")
rotary_embedding = _dispatch(rotary_embedding_ref, "triton_rotary")
