"""The records that cross the engine core's boundary hold plain data only (numbers, strings,
enums, lists, dicts and other such records): no tensors, futures or generators, so an engine
core in another process can send them as messages (msgspec / msgpack)."""

from __future__ import annotations

import dataclasses
import enum
import types
import typing

import pytest
import torch

from agentrt.engine.errors import ErrorCode
from agentrt.engine.records import EngineCoreOutput, SampledToken, ScheduledChunk, SchedulerOutput

_SCALARS = (int, float, str, bool, type(None))


def _plain(hint) -> bool:
    origin = typing.get_origin(hint)
    if origin in (list, tuple, frozenset, set, dict, types.UnionType, typing.Union):
        return all(_plain(arg) for arg in typing.get_args(hint) if arg is not Ellipsis)
    if hint in _SCALARS or (isinstance(hint, type) and issubclass(hint, enum.Enum)):
        return True
    return dataclasses.is_dataclass(hint) and all(
        _plain(h) for h in typing.get_type_hints(hint).values()
    )


@pytest.mark.parametrize(
    "record", [EngineCoreOutput, SampledToken, ScheduledChunk, SchedulerOutput]
)
def test_boundary_records_hold_plain_data(record):
    hints = typing.get_type_hints(record)
    assert {name for name, hint in hints.items() if not _plain(hint)} == set()


@dataclasses.dataclass
class _Live:
    token: SampledToken
    logits: torch.Tensor


def test_the_check_rejects_live_state():
    assert not _plain(_Live)


def test_a_failure_is_a_field_not_a_message():
    out = EngineCoreOutput(
        "r", [], None, "error", error_code=ErrorCode.INVALID_SCHEMA, error="bad $ref"
    )
    assert out.finished and out.error_code == "invalid_schema"
