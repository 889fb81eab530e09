"""Typed engine errors. Each message says what was wrong, what was expected, what to do."""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    """What went wrong, as one code shared by the engine, the SDK, the server (the OpenAI
    error object's `code`) and the remote client, which maps it back to the same exception
    type. A request that finishes with finish_reason "error" carries one too, so no layer
    ever tells errors apart by their message."""

    INVALID_REQUEST = "invalid_request"  # bad input: a field and its limit (400)
    INVALID_SCHEMA = "invalid_schema"  # the output constraint cannot be compiled (400)
    # The output cannot be completed into a valid instance (the grammar reached a dead end),
    # or a finished output fails a check the grammar does not enforce.
    STRUCTURED_OUTPUT_FAILED = "structured_output_failed"
    OVERLOADED = "rate_limit_exceeded"  # too many waiting requests: retry later (429)
    ENGINE_DEAD = "engine_unavailable"  # the engine stopped: start a new one (503)
    INTERNAL = "internal_error"  # a bug: the request failed for no reason of its own (500)


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""

    code: ErrorCode = ErrorCode.INTERNAL


class InvalidRequestError(EngineError, ValueError):
    """A request (prompt or sampling parameters) is invalid. Names the field and the limit."""

    code = ErrorCode.INVALID_REQUEST

    def __init__(self, message: str, *, field: str | None = None, value: object = None):
        super().__init__(message)
        self.field = field
        self.value = value


class ContextLengthError(InvalidRequestError):
    """The prompt, or the prompt plus max_tokens, does not fit in one request (the context
    length, or the KV cache if it holds less). `field` is "prompt" or "max_tokens"."""


class ConfigError(EngineError, ValueError):
    """An engine configuration value is invalid."""

    code = ErrorCode.INVALID_REQUEST


class ModelLoadError(EngineError):
    """Weights, config or tokenizer could not be found or read."""


class ModelTooLargeError(ConfigError):
    """The model's weights and KV pool do not fit in the memory free on its device; raised
    before anything is allocated. The message gives the numbers and the options that would
    make it fit; the fields hold the numbers (bytes)."""

    def __init__(self, message: str, *, weight_bytes: int, kv_bytes: int, available_bytes: int):
        super().__init__(message)
        self.weight_bytes = weight_bytes
        self.kv_bytes = kv_bytes
        self.available_bytes = available_bytes


class EngineDeadError(EngineError):
    """The engine loop stopped (a fault, or shutdown): every pending request fails with this,
    and new requests are refused. Start a new engine."""

    code = ErrorCode.ENGINE_DEAD


class EngineOverloadedError(EngineError):
    """Too many requests are already waiting; retry later (the server answers 429)."""

    code = ErrorCode.OVERLOADED
