"""Partial JSON for streaming: the members of an unfinished top-level object or array whose
values are already complete. A member appears only once its value can no longer change, so
every partial is a prefix of the final value (same keys, same values)."""

from __future__ import annotations

import json
from typing import Any

_DECODER = json.JSONDecoder()
_WS = " \t\n\r"
_NUMBER_CHARS = "0123456789.eE+-"


def completed_members(text: str) -> dict[str, Any] | list[Any] | None:
    """For text starting an object: a dict of its completed members; for an array: a list of
    its completed elements; otherwise (nothing started yet, or a scalar) None."""
    i = _skip(text, 0)
    if i >= len(text) or text[i] not in "{[":
        return None
    if text[i] == "{":
        return _object_members(text, i + 1)
    return _array_elements(text, i + 1)


def _object_members(text: str, i: int) -> dict[str, Any]:
    members: dict[str, Any] = {}
    while True:
        i = _skip(text, i)
        if i >= len(text) or text[i] != '"':
            return members
        try:
            key, i = _DECODER.raw_decode(text, i)
        except json.JSONDecodeError:
            return members
        i = _skip(text, i)
        if i >= len(text) or text[i] != ":":
            return members
        value, i = _complete_value(text, _skip(text, i + 1))
        if i < 0:
            return members
        members[key] = value
        i = _skip(text, i)
        if i >= len(text) or text[i] != ",":
            return members
        i += 1


def _array_elements(text: str, i: int) -> list[Any]:
    elements: list[Any] = []
    while True:
        value, i = _complete_value(text, _skip(text, i))
        if i < 0:
            return elements
        elements.append(value)
        i = _skip(text, i)
        if i >= len(text) or text[i] != ",":
            return elements
        i += 1


def _complete_value(text: str, i: int) -> tuple[Any, int]:
    """(value, end) when the value at `i` is complete, else (None, -1). A number is complete
    only when something that cannot continue it follows: the decoder reads "3" from "3." or
    "3e", whose number may still become 3.25 or 3e5."""
    try:
        value, end = _DECODER.raw_decode(text, i)
    except json.JSONDecodeError:
        return None, -1
    if isinstance(value, int | float) and not isinstance(value, bool):
        if end >= len(text) or text[end] in _NUMBER_CHARS:
            return None, -1
    return value, end


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i
