"""Typed SDK errors, and the one table that says how each error code crosses HTTP.

Every error the engine or the SDK raises on purpose has a class attribute `code`
(`ErrorCode`): engine errors (`InvalidRequestError`, `EngineDeadError`,
`EngineOverloadedError`, re-exported here so one import covers everything a caller handles)
and the SDK's own. A request the engine ends with finish_reason "error" carries a code too.
`ERROR_KINDS` maps a code to its HTTP status, OpenAI error `type` and exception class: the
server answers with it, and the remote client raises the same class back (`error_for`), so a
failure is the same exception locally and through `agentrt serve`.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentrt.engine.errors import (
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
    ErrorCode,
    InvalidRequestError,
)

__all__ = [
    "ERROR_KINDS",
    "AgentError",
    "AgentrtError",
    "EngineDeadError",
    "EngineError",
    "EngineOverloadedError",
    "ErrorCode",
    "ErrorKind",
    "GenerationError",
    "InvalidRequestError",
    "MCPServerError",
    "OutputValidationError",
    "SchemaError",
    "TruncatedOutputError",
    "code_for_status",
    "code_of",
    "error_for",
]


class AgentrtError(Exception):
    """Base class of the SDK's own errors."""

    code: ErrorCode = ErrorCode.INTERNAL


class SchemaError(AgentrtError, ValueError):
    """The schema cannot be turned into a grammar; the message names the keyword and why.
    `field` names the request field that holds it when one does (e.g. "tools")."""

    code = ErrorCode.INVALID_SCHEMA

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class TruncatedOutputError(AgentrtError):
    """The output hit `max_tokens` before the grammar could finish. `text` is the partial
    output; raise `max_tokens` or simplify the schema."""

    code = ErrorCode.STRUCTURED_OUTPUT_FAILED

    def __init__(self, message: str, *, text: str, usage=None) -> None:
        super().__init__(message)
        self.text = text
        self.usage = usage


class OutputValidationError(AgentrtError):
    """The output cannot be valid: the grammar reached a dead end, or the finished output
    fails a check the grammar does not enforce. `errors` are the problems (Pydantic's
    `errors()` when a model's validation failed), `text` the output."""

    code = ErrorCode.STRUCTURED_OUTPUT_FAILED

    def __init__(self, message: str, *, text: str = "", errors: list | None = None, usage=None):
        super().__init__(message)
        self.text = text
        self.errors = errors if errors is not None else [message]
        self.usage = usage


class GenerationError(AgentrtError):
    """The request failed in the engine for no reason of its own (a bug), or was aborted."""

    code = ErrorCode.INTERNAL


class AgentError(AgentrtError):
    """An agent run could not finish (e.g. `max_steps` reached); `trace` has its steps."""

    def __init__(self, message: str, *, trace=None) -> None:
        super().__init__(message)
        self.trace = trace


class MCPServerError(AgentrtError):
    """An MCP server (agentrt.mcp) is misnamed (an empty command, headers for a command),
    could not be reached, or failed to list its tools."""


@dataclass(frozen=True, slots=True)
class ErrorKind:
    """How one `ErrorCode` crosses HTTP. `finishes`: the engine ends a request with this code
    (finish_reason "error"), so a client turns it back into a failed completion."""

    status: int
    type: str  # the OpenAI error object's `type`
    exception: type[Exception]
    finishes: bool = False


ERROR_KINDS: dict[ErrorCode, ErrorKind] = {
    ErrorCode.INVALID_REQUEST: ErrorKind(400, "invalid_request_error", InvalidRequestError),
    ErrorCode.INVALID_SCHEMA: ErrorKind(400, "invalid_request_error", SchemaError, True),
    # The model's output, not the client's request, failed (a grammar dead end): a 500, as
    # OpenAI answers "the model produced invalid content".
    ErrorCode.STRUCTURED_OUTPUT_FAILED: ErrorKind(500, "server_error", OutputValidationError, True),
    ErrorCode.OVERLOADED: ErrorKind(429, "requests", EngineOverloadedError),
    ErrorCode.ENGINE_DEAD: ErrorKind(503, "server_error", EngineDeadError),
    ErrorCode.INTERNAL: ErrorKind(500, "server_error", GenerationError, True),
}


def code_of(exc: BaseException) -> ErrorCode | None:
    """The code of an error raised on purpose; None for anything else (a bug)."""
    if isinstance(exc, EngineError | AgentrtError):
        return exc.code
    return None


def code_for_status(status: int) -> ErrorCode:
    """The code of an HTTP error that carries none of ours (another server, a proxy)."""
    if status == 429:
        return ErrorCode.OVERLOADED
    if status == 503:
        return ErrorCode.ENGINE_DEAD
    if status >= 500:
        return ErrorCode.INTERNAL
    return ErrorCode.INVALID_REQUEST


def error_for(code: ErrorCode, message: str, *, field: str | None = None) -> Exception:
    """The exception `ERROR_KINDS` gives `code`, with `field` where the class takes one."""
    cls = ERROR_KINDS[code].exception
    if cls is InvalidRequestError or cls is SchemaError:
        return cls(message, field=field)
    return cls(message)
