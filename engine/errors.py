"""Typed engine errors. Each message says what was wrong, what was expected, what to do."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """A request (prompt or sampling parameters) is invalid. Names the field and the limit."""

    def __init__(self, message: str, *, field: str | None = None, value: object = None):
        super().__init__(message)
        self.field = field
        self.value = value


class ConfigError(EngineError, ValueError):
    """An engine configuration value is invalid."""


class ModelLoadError(EngineError):
    """Weights, config or tokenizer could not be found or read."""


class EngineDeadError(EngineError):
    """The engine loop stopped (a fault, or shutdown): every pending request fails with this,
    and new requests are refused. Start a new engine."""


class EngineOverloadedError(EngineError):
    """Too many requests are already waiting; retry later (the server answers 429)."""
