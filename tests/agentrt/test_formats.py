"""OutputFormat: `schema=` resolved once (a bad schema is a SchemaError before any request),
turned into the engine's constraint, and a finished text converted into its value. The
schema check of a finished output is the engine's final validator (`final_errors` runs the
same one for remote backends); `parse` only converts."""

from __future__ import annotations

import enum
from typing import Literal

import pytest
from pydantic import BaseModel, Field, field_validator

from agentrt.engine.errors import ErrorCode
from agentrt.errors import OutputValidationError, SchemaError
from agentrt.formats import TEXT, Choice, OutputFormat, Regex, resolve_format, tools_format
from agentrt.tool_calls import ToolCall


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0)

    @field_validator("name")
    @classmethod
    def capitalised(cls, value: str) -> str:
        if not value[:1].isupper():
            raise ValueError("the name must be capitalised")
        return value


class Color(enum.Enum):
    red = "red"
    blue = "blue"


AT_LEAST_3 = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 3}},
    "required": ["n"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def test_schema_kinds_resolve_to_formats_and_constraints():
    assert resolve_format(None) is TEXT and TEXT.structured_outputs() is None
    person = resolve_format(Person)
    assert person.kind == "json" and person.name == "Person"
    assert person.json_schema["required"] == ["name", "age"]
    assert person.structured_outputs().json is Person
    schema = resolve_format(AT_LEAST_3)
    assert schema.kind == "json" and schema.adapter is None
    assert schema.structured_outputs().json == AT_LEAST_3
    assert resolve_format(Regex("[a-z]+")).structured_outputs().regex == "[a-z]+"
    assert resolve_format(Choice(["yes", "no"])).structured_outputs().choice == ("yes", "no")
    assert resolve_format(list[int]).json_schema == {"type": "array", "items": {"type": "integer"}}
    assert resolve_format(Literal["a", "b"]).json_schema["enum"] == ["a", "b"]
    assert resolve_format(person) is person


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda: resolve_format(5), "not a schema"),
        (lambda: resolve_format([Person]), "not a schema"),
        (lambda: resolve_format({"type": "no-such-type"}), "invalid"),
        (lambda: resolve_format(Regex("(unclosed")), "Regex"),
        (lambda: Choice([]), "non-empty"),
        (lambda: Choice(["a", 1]), "strings"),
        (lambda: resolve_format(object()), "cannot build a JSON schema"),
    ],
)
def test_bad_schemas_are_schema_errors(make, fragment):
    with pytest.raises(SchemaError, match=fragment) as info:
        make()
    assert info.value.code == ErrorCode.INVALID_SCHEMA


def test_tools_constraint_names_the_field_at_fault():
    assert tools_format([WEATHER], "required").structured_outputs().spec is not None
    assert tools_format([WEATHER], "none").structured_outputs() is None
    bad_name = {"type": "function", "function": {"name": "bad name!"}}
    with pytest.raises(SchemaError) as info:
        tools_format([bad_name]).structured_outputs()
    assert info.value.field == "tools"
    with pytest.raises(SchemaError) as info:
        tools_format([WEATHER], "no_such_tool").structured_outputs()
    assert info.value.field == "tool_choice" and "no_such_tool" in str(info.value)


def test_parse_converts_without_a_second_schema_check():
    # The engine's final check owns the schema: parse only turns JSON text into the value,
    # so it cannot disagree with the check that already ran.
    assert resolve_format(AT_LEAST_3).parse('{"n": 1}') == {"n": 1}
    assert resolve_format(Regex("[a-z]+")).parse("ABC") == "ABC"
    assert resolve_format(Choice(["yes"])).parse("yes") == "yes"
    assert TEXT.parse("anything") == "anything"
    assert resolve_format(Color).parse('"blue"') is Color.blue
    with pytest.raises(OutputValidationError) as info:
        resolve_format(AT_LEAST_3).parse('{"n": ')
    assert info.value.code == ErrorCode.STRUCTURED_OUTPUT_FAILED
    assert info.value.text == '{"n": ' and "not JSON" in str(info.value)


def test_a_python_type_is_built_by_pydantic_with_its_own_validators():
    assert resolve_format(Person).parse('{"name": "Ann", "age": 3}') == Person(name="Ann", age=3)
    with pytest.raises(OutputValidationError) as info:
        resolve_format(Person).parse('{"name": "ann", "age": 3}')
    assert "capitalised" in str(info.value)
    assert info.value.errors[0]["loc"] == ("name",)


def test_tool_calls_parse_to_tool_call_records():
    calls = tools_format([WEATHER], "required").parse(
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    )
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert isinstance(calls[0], ToolCall) and calls[0].id.startswith("call_")
    assert tools_format([WEATHER], "auto").parse("It is sunny.") == "It is sunny."
    with pytest.raises(OutputValidationError, match="expected tool calls"):
        tools_format([WEATHER], "required").parse("It is sunny.")


def test_final_errors_are_the_engines_final_check():
    fmt = resolve_format(AT_LEAST_3)
    assert fmt.final_errors('{"n": 4}') == []
    problems = fmt.final_errors('{"n": 1}')
    assert len(problems) == 1 and "minimum" in problems[0]
    (problem,) = fmt.final_errors("not json")
    assert "not valid JSON" in problem
    assert resolve_format(Person).final_errors('{"name": "ann", "age": -1}')  # schema: age >= 0
    assert resolve_format(Regex("[a-z]+")).final_errors("ABC")
    assert resolve_format(Choice(["yes", "no"])).final_errors("maybe")
    tools = tools_format([WEATHER], "required")
    assert tools.final_errors('[{"name": "get_weather", "arguments": {"city": "Rome"}}]') == []
    assert tools.final_errors('[{"name": "nope", "arguments": {}}]')
    assert tools.final_errors("plain text")
    assert TEXT.final_errors("anything") is None
    assert OutputFormat("text").final_errors("x") is None


def test_tool_choice_none_replies_in_text_even_when_it_looks_like_a_call():
    """Regression: under "none" a JSON-looking reply was parsed as calls, and one cut at
    max_tokens raised TruncatedOutputError although text may end anywhere."""
    from agentrt.backend import Completion, Usage
    from agentrt.session import check_completion

    fmt = tools_format([WEATHER], "none")
    reply = '{"name": "get_weather", "arguments": {"city": "Par'
    assert fmt.is_plain_text(reply) and fmt.parse(reply) == reply
    assert check_completion(Completion(reply, "length", Usage()), fmt, Usage()) == reply
    assert not tools_format([WEATHER], "auto").is_plain_text(reply)
    assert tools_format([WEATHER], "auto").is_plain_text("It is sunny.")


def test_a_named_tool_choice_allows_one_call_only():
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert not tools_format([WEATHER], named, parallel_tool_calls=True).allows_many_calls
    assert tools_format([WEATHER], "required", parallel_tool_calls=True).allows_many_calls
    assert not tools_format([WEATHER], "required", parallel_tool_calls=False).allows_many_calls


def test_remote_tool_payload_for_a_named_choice_is_one_call():
    """The remote client rebuilds the engine's tool-call text from the server's calls: one
    object for a named choice (what its grammar allows), even with parallel calls on."""
    from agentrt.remote import _tool_payload

    call = {0: {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    named = tools_format([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    text = _tool_payload(call, named)
    assert text.startswith("{") and named.final_errors(text) == []
    assert _tool_payload(call, tools_format([WEATHER], "required")).startswith("[")
