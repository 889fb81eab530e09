from __future__ import annotations

import enum
from typing import Literal

import pytest
from pydantic import BaseModel

from agentrt.grammar import GrammarSpec, GrammarSpecError

from .helpers import TOOLS


class Person(BaseModel):
    name: str
    age: int


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


def test_json_schema_spec_is_canonical_and_hashable() -> None:
    a = GrammarSpec.from_json_schema({"type": "object", "properties": {"b": {}, "a": {}}})
    b = GrammarSpec.from_json_schema({"properties": {"b": {}, "a": {}}, "type": "object"})
    assert a == b and hash(a) == hash(b) and a.cache_key() == b.cache_key()
    # Property order is meaningful (generation order) and kept.
    c = GrammarSpec.from_json_schema({"type": "object", "properties": {"a": {}, "b": {}}})
    assert c != a
    assert list(a.json_value()["properties"]) == ["b", "a"]


def test_from_type_covers_models_and_type_adapter_types() -> None:
    assert GrammarSpec.from_type(Person).json_value()["required"] == ["name", "age"]
    assert GrammarSpec.from_type(list[Person]).json_value()["type"] == "array"
    assert GrammarSpec.from_type(Literal["a", "b"]).json_value()["enum"] == ["a", "b"]
    assert GrammarSpec.from_type(Color).json_value()["enum"] == ["red", "blue"]
    union = GrammarSpec.from_type(int | str).json_value()
    assert {b["type"] for b in union["anyOf"]} == {"integer", "string"}


def test_choice_and_regex_and_ebnf() -> None:
    assert GrammarSpec.from_choice(["b", "a", "b"]) == GrammarSpec.from_choice(["a", "b"])
    assert GrammarSpec.from_regex(r"\d+").kind == "regex"
    assert GrammarSpec.from_ebnf('start: "x"').option_dict == {"syntax": "lark"}
    with pytest.raises(GrammarSpecError, match="invalid regex"):
        GrammarSpec.from_regex("(")
    with pytest.raises(GrammarSpecError, match="non-empty"):
        GrammarSpec.from_choice([])
    with pytest.raises(GrammarSpecError, match="syntax"):
        GrammarSpec.from_ebnf("x", syntax="yacc")


def test_from_tools_choices() -> None:
    auto = GrammarSpec.from_tools(TOOLS)
    assert auto.kind == "tools" and auto.option_dict == {"tool_choice": "auto"}
    assert auto.parallel_tool_calls is True
    named = GrammarSpec.from_tools(
        TOOLS, {"type": "function", "function": {"name": "add"}}, parallel_tool_calls=False
    )
    assert named.option_dict == {"tool_choice": "name:add"}
    assert named.parallel_tool_calls is False
    assert named.cache_key() != GrammarSpec.from_tools(TOOLS, "required").cache_key()
    assert GrammarSpec.from_tools(TOOLS, parallel_tool_calls=False).cache_key() != auto.cache_key()
    assert GrammarSpec.from_tools(TOOLS, "none").kind == "text"
    with pytest.raises(GrammarSpecError, match="not one of the tools"):
        GrammarSpec.from_tools(TOOLS, "nope")
    with pytest.raises(GrammarSpecError, match="unique"):
        GrammarSpec.from_tools([TOOLS[0], TOOLS[0]])


def test_bad_inputs_raise_spec_errors() -> None:
    with pytest.raises(GrammarSpecError, match="must be an object"):
        GrammarSpec.from_json_schema([1, 2])  # type: ignore[arg-type]
    with pytest.raises(GrammarSpecError, match="not valid JSON"):
        GrammarSpec.from_json_schema("{nope")
    with pytest.raises(GrammarSpecError, match="unknown grammar kind"):
        GrammarSpec("yaml", "")


def test_specs_nested_past_the_recursion_limit_are_refused_as_spec_errors() -> None:
    # A deeply nested regex or schema text used to escape as a RecursionError (a 500).
    import pytest

    from agentrt.grammar.errors import GrammarSpecError

    with pytest.raises(GrammarSpecError, match="nested too deeply"):
        GrammarSpec.from_regex("(" * 5000 + "a" + ")" * 5000)
    with pytest.raises(GrammarSpecError, match="nested too deeply"):
        GrammarSpec.from_json_schema('{"items":' * 5000 + "{}" + "}" * 5000)


def test_typed_fields_cross_the_core_process_wire() -> None:
    """The engine core process receives specs as msgpack (engine/client/core_process.py):
    the typed flags and the reasoning plan come back equal, with the same cache key."""
    import msgspec

    from agentrt.grammar.reasoning import REASONING_PARSERS, with_reasoning

    tools = GrammarSpec.from_tools(TOOLS, "required", parallel_tool_calls=False)
    spec = with_reasoning(tools, REASONING_PARSERS["qwen3"], opened=False, max_reasoning_tokens=7)
    assert spec.reasoning is not None and spec.reasoning.max_tokens == 7
    assert spec.cache_key() not in (tools.cache_key(), tools.with_bounds(None).cache_key())
    for sent in (tools, spec, spec.with_bounds(None), GrammarSpec.from_regex("a+")):
        got = msgspec.msgpack.decode(msgspec.msgpack.encode(sent), type=GrammarSpec)
        assert got == sent and got.cache_key() == sent.cache_key()
        assert isinstance(got.parallel_tool_calls, bool)
