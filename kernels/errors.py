"""Typed kernel errors. Each message says what was wrong, what was expected, what to do."""

from __future__ import annotations


class KernelError(Exception):
    """Base class of every error the kernels package raises on purpose."""


class KernelInputError(KernelError, ValueError):
    """A tensor passed to a kernel has the wrong shape, dtype, device, stride or value.

    `arg` names the offending argument so the caller can find it without reading the kernel.
    """

    def __init__(self, message: str, *, arg: str | None = None):
        super().__init__(message)
        self.arg = arg


class TritonUnavailableError(KernelError, ImportError):
    """A Triton kernel was requested but Triton cannot be imported."""


class KernelBuildError(KernelError, RuntimeError):
    """A compiled CPU kernel could not be built (no compiler, or the compile failed)."""
