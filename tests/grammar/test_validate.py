"""Post-generation checks (validate.py): what the token grammar left to the final check."""

from __future__ import annotations

import json
import time

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


EVIL = r"(?:(a+)+[^\s\S])?a{40}"  # 40 a's; a backtracking engine tries 2^40 splits first


def test_a_backtracking_regex_is_matched_within_a_time_bound() -> None:
    # No matcher's verdict (the SDK checking a remote server's text): the bounded engine runs,
    # and the whole check, however many strings carry the pattern, ends within its budget.
    many = {"type": "array", "items": {"type": "string", "pattern": f"^{EVIL}$"}}
    for spec, text in (
        (GrammarSpec.from_regex(EVIL), "a" * 40),
        (GrammarSpec.from_json_schema(many), json.dumps(["a" * 40] * 20)),
        (
            GrammarSpec.from_json_schema({"patternProperties": {EVIL: {}}}),
            '{"' + "a" * 40 + '": 1}',
        ),
    ):
        start = time.monotonic()
        problems = FinalValidator(spec).errors(text)
        assert time.monotonic() - start < 1.0
        assert problems and "could not be checked within" in problems[0]
    assert FinalValidator(GrammarSpec.from_json_schema(many)).errors('["a", "b"]')  # mismatch


def test_what_the_grammar_proved_is_not_matched_again() -> None:
    proven = FinalValidator(GrammarSpec.from_regex(EVIL), proven=frozenset({"regex"}))
    start = time.monotonic()
    assert proven.errors("a" * 40, complete=True) == []  # the matcher reached its end
    assert "ended early" in proven.errors("a" * 39, complete=False)[0]
    schema = GrammarSpec.from_json_schema({"type": "string", "pattern": EVIL})
    proven = FinalValidator(schema, proven=frozenset({"pattern"}))
    assert proven.errors(json.dumps("a" * 40), complete=True) == []
    assert time.monotonic() - start < 0.5
    # Not proven (xgrammar approximates patterns): still matched, bounded.
    assert FinalValidator(schema).errors(json.dumps("b"), complete=True)


def test_patterns_are_proven_only_where_their_verdict_cannot_reject_more(auto_compiler) -> None:
    plain = {"type": "object", "properties": {"id": {"type": "string", "pattern": "^a"}}}
    assert auto_compiler.compile(GrammarSpec.from_json_schema(plain)).validator.proven == {
        "pattern"
    }
    # Under `not`, a pattern taken as true would make every value fail: it is matched.
    negated = {"type": "string", "not": {"pattern": "^a"}}
    grammar = auto_compiler.compile(GrammarSpec.from_json_schema(negated))
    assert grammar.validator.proven == frozenset()
    assert grammar.validator.errors('"xyz"', complete=True) == []
    assert grammar.validator.errors('"abc"', complete=True)


# An array whose items are `anyOf` two references to itself: jsonschema evaluates each
# nesting level twice, so a check's cost doubles per level (2^20 evaluations at depth 20).
SELF_ANY_OF = {
    "$defs": {
        "a": {
            "type": "array",
            "items": {"anyOf": [{"$ref": "#/$defs/a", "maxItems": 0}, {"$ref": "#/$defs/a"}]},
        }
    },
    "$ref": "#/$defs/a",
}


def test_a_schema_whose_cost_doubles_per_level_is_checked_within_a_deadline() -> None:
    validator = FinalValidator(GrammarSpec.from_json_schema(SELF_ANY_OF))
    assert validator.check("[[]]").errors == []  # shallow: checked in full
    start = time.monotonic()
    verdict = validator.check("[" * 20 + "]" * 20)
    assert time.monotonic() - start < 1.0  # the unbounded check took 25 s here
    assert not verdict.checked and "could not be checked" in verdict.errors[0]


def test_instances_beyond_the_depth_and_size_bounds_are_not_walked() -> None:
    validator = FinalValidator(GrammarSpec.from_json_schema({"type": "array"}))
    start = time.monotonic()
    deep = validator.check("[" * 100 + "]" * 100)
    deeper = validator.check("[" * 100_000 + "]" * 100_000)  # past Python's recursion limit
    wide = validator.check(json.dumps(list(range(50_000))))
    assert time.monotonic() - start < 2.0
    for verdict in (deep, deeper, wide):
        assert not verdict.checked and "could not be checked" in verdict.errors[0]
    assert validator.check(json.dumps(list(range(100)))).checked


def test_unique_items_compares_a_bounded_number_of_items() -> None:
    schema = {"type": "array", "uniqueItems": True}
    validator = FinalValidator(GrammarSpec.from_json_schema(schema))
    assert validator.check("[[1], [1]]").errors  # duplicates found
    verdict = validator.check(json.dumps([[i] for i in range(5_000)]))
    assert not verdict.checked and "uniqueItems" in verdict.errors[0]
