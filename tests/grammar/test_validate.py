"""Post-generation checks (validate.py): what the token grammar left to the final check."""

from __future__ import annotations

from agentrt.grammar import GrammarSpec
from agentrt.grammar.validate import FinalValidator

from .helpers import TOOLS


def test_post_checked_keywords_are_reported_with_their_path(auto_compiler) -> None:
    schema = {
        "type": "object",
        "properties": {"tags": {"type": "array", "uniqueItems": True},
                       "n": {"type": "integer", "not": {"const": 3}}},
    }  # fmt: skip
    grammar = auto_compiler.compile(GrammarSpec.from_json_schema(schema))
    assert {"uniqueItems", "not"} <= grammar.report.post_checked
    check = grammar.validator.errors
    assert check('{"tags": ["a", "b"], "n": 4}') == []
    errors = check('{"tags": ["a", "a"], "n": 3}')
    assert len(errors) == 2
    assert any(e.startswith("tags: ") and "non-unique" in e for e in errors)
    assert any(e.startswith("n: ") for e in errors)
    assert len(check('{"tags": [')) == 1 and "not valid JSON" in check('{"tags": [')[0]


def test_errors_are_capped() -> None:
    check = FinalValidator(GrammarSpec.from_json_schema({"items": {"type": "string"}})).errors
    assert len(check(str(list(range(20))))) == 8


def test_an_unresolvable_schema_is_reported_not_raised() -> None:
    check = FinalValidator(GrammarSpec.from_json_schema({"$ref": "#/$defs/missing"})).errors
    assert check("1")[0].startswith("schema could not be evaluated")


def test_tool_calls_text_is_allowed_only_with_auto() -> None:
    def check(choice: str):
        spec = GrammarSpec.from_tools(TOOLS, choice, parallel_tool_calls=False)
        return FinalValidator(spec).errors

    auto, required = check("auto"), check("required")
    call = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
    assert auto("It is sunny.") == [] and auto(call) == [] and required(call) == []
    assert required("It is sunny.") == ["expected a tool call, got text"]
    assert required('{"name": "add", "arguments": {"a": 1}}')  # b is required


def test_regex_and_choice_outputs() -> None:
    regex = FinalValidator(GrammarSpec.from_regex(r"[a-c]+\d")).errors
    assert regex("ab1") == [] and "does not match" in regex("ab")[0]
    choice = FinalValidator(GrammarSpec.from_choice(["yes", "no"])).errors
    assert choice("no") == [] and "not one of the 2 choices" in choice("maybe")[0]
    assert FinalValidator(GrammarSpec.any_text()).errors("anything") == []
