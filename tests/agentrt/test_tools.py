"""@tool: the schema comes from the signature, calls validate their arguments, sync and async
functions both run."""

from __future__ import annotations

import pydantic
import pytest
from pydantic import BaseModel

import agentrt
from agentrt import SchemaError

pytestmark = pytest.mark.anyio


class Point(BaseModel):
    x: int
    y: int


@agentrt.tool
def distance(a: Point, b: Point, scale: float = 1.0) -> float:
    """Manhattan distance between two points."""
    return scale * (abs(a.x - b.x) + abs(a.y - b.y))


@agentrt.tool(name="lookup_city")
async def lookup(city: str) -> dict:
    """Find a city."""
    return {"city": city, "found": True}


def test_definition_from_signature_and_docstring():
    definition = distance.definition()["function"]
    assert definition["name"] == "distance"
    assert definition["description"] == "Manhattan distance between two points."
    params = definition["parameters"]
    assert params["required"] == ["a", "b"]
    assert params["properties"]["scale"]["default"] == 1.0
    assert params["additionalProperties"] is False
    assert "Point" in params["$defs"]
    assert lookup.name == "lookup_city"
    assert distance(Point(x=0, y=0), Point(x=1, y=2)) == 3.0  # still a plain function


async def test_calls_validate_arguments():
    assert await distance.call({"a": {"x": 0, "y": 0}, "b": {"x": 3, "y": 4}}) == 7.0
    assert await lookup.call({"city": "Oslo"}) == {"city": "Oslo", "found": True}
    with pytest.raises(pydantic.ValidationError):
        await distance.call({"a": {"x": "far"}, "b": {"x": 0, "y": 0}})
    with pytest.raises(pydantic.ValidationError):
        await lookup.call({"city": "Oslo", "extra": 1})


def test_untyped_parameters_are_rejected():
    with pytest.raises(SchemaError, match="needs a type annotation"):

        @agentrt.tool
        def bad(x):
            return x
