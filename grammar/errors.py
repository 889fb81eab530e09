"""Typed errors of the grammar layer.

Every error says what was wrong, what was expected and what to do. Errors raised while
compiling a request's grammar are `GrammarCompileError` (or a subclass), so the engine can
fail that one request and carry on with the others.
"""

from __future__ import annotations


class GrammarError(Exception):
    """Base class for all errors of `agentrt.grammar`."""


class GrammarSpecError(GrammarError, ValueError):
    """A grammar spec could not be built from the user's input (bad type, bad arguments)."""


class GrammarCompileError(GrammarError):
    """A spec could not be compiled into a token grammar; the request must fail.

    `reason` is a short machine-readable tag ("invalid_schema", "unsupported", "limit",
    "timeout", "backend"), `detail` the human-readable explanation.
    """

    def __init__(self, detail: str, *, reason: str = "invalid_schema") -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class SchemaLimitError(GrammarCompileError):
    """The schema exceeds a configured size or depth limit."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail, reason="limit")


class GrammarCompileTimeout(GrammarCompileError):
    """Compilation did not finish inside the time budget."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail, reason="timeout")


class BackendUnavailableError(GrammarCompileError):
    """An optional backend package is not installed."""

    def __init__(self, backend: str, extra: str) -> None:
        super().__init__(
            f"grammar backend {backend!r} is not installed; install it with "
            f"`pip install 'agentrt[{extra}]'` or choose another backend",
            reason="backend",
        )
        self.backend = backend


class MatcherStateError(GrammarError):
    """A matcher was used in a way its state does not allow (e.g. rollback too far)."""
