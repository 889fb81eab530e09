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
    assert auto.kind == "tools" and auto.option_dict == {"parallel": "1", "tool_choice": "auto"}
    named = GrammarSpec.from_tools(
        TOOLS, {"type": "function", "function": {"name": "add"}}, parallel_tool_calls=False
    )
    assert named.option_dict == {"parallel": "0", "tool_choice": "name:add"}
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
