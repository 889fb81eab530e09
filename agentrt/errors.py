"""Typed SDK errors. Engine errors (`InvalidRequestError`, `EngineDeadError`,
`EngineOverloadedError`) are re-exported so one import covers everything a caller handles."""

from __future__ import annotations

from agentrt.engine.errors import (
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
    InvalidRequestError,
)

__all__ = [
    "AgentError",
    "AgentrtError",
    "EngineDeadError",
    "EngineError",
    "EngineOverloadedError",
    "GenerationError",
    "InvalidRequestError",
    "OutputValidationError",
    "SchemaError",
    "TruncatedOutputError",
]


class AgentrtError(Exception):
    """Base class of the SDK's own errors."""


class SchemaError(AgentrtError, ValueError):
    """The schema cannot be turned into a grammar; the message names the keyword and why."""


class TruncatedOutputError(AgentrtError):
    """The output hit `max_tokens` before the grammar could finish. `text` is the partial
    output; raise `max_tokens` or simplify the schema."""

    def __init__(self, message: str, *, text: str, usage=None) -> None:
        super().__init__(message)
        self.text = text
        self.usage = usage


class OutputValidationError(AgentrtError):
    """The output finished but fails a constraint that is only checked after generation.
    `errors` are the validator's (Pydantic's `errors()` for a model), `text` the output."""

    def __init__(self, message: str, *, text: str, errors: list, usage=None) -> None:
        super().__init__(message)
        self.text = text
        self.errors = errors
        self.usage = usage


class GenerationError(AgentrtError):
    """The engine ended the request with an error that is neither of the above."""


class AgentError(AgentrtError):
    """An agent run could not finish (e.g. `max_steps` reached); `trace` has its steps."""

    def __init__(self, message: str, *, trace=None) -> None:
        super().__init__(message)
        self.trace = trace
