"""Excluded argument objects (an agent's answered calls) compiled into a tool's parameters:
the grammar cannot produce them, every other call stays reachable where the exclusion is
exact, and the final validator agrees with the grammar on the narrowed schema."""

from __future__ import annotations

import json
from typing import Any

from agentrt.grammar import GrammarCompiler, GrammarSpec
from agentrt.grammar.exclude import exclude_arguments
from agentrt.grammar.tools import EXCLUDED_ARGUMENTS
from agentrt.grammar.validate import FinalValidator

from .helpers import drive

CALC = {
    "type": "object",
    "properties": {
        "a": {"type": "number"},
        "op": {"type": "string"},
        "b": {"type": "integer", "minimum": 0, "maximum": 9},
        "scale": {"type": "number", "default": 1.0},
    },
    "required": ["a", "op", "b"],
    "additionalProperties": False,
}


def _tool(parameters: dict, excluded: list[dict]) -> dict:
    function = {"name": "f", "parameters": parameters, EXCLUDED_ARGUMENTS: excluded}
    return {"type": "function", "function": function}


def _accepted(compiler: GrammarCompiler, tok: Any, tools: list[dict], calls: list[dict]):
    """Which of `calls` (arguments, or a call's raw text) the grammar accepts, checked
    against the final validator too: the post-check must agree on the narrowed schema."""
    spec = GrammarSpec.from_tools(tools, "required", parallel_tool_calls=False)
    grammar, validator = compiler.compile(spec), FinalValidator(spec)
    verdicts = []
    for call in calls:
        text = call if isinstance(call, str) else json.dumps({"name": "f", "arguments": call})
        ok = drive(grammar.matcher(), tok, text) == (True, True)
        assert ok == (validator.errors(text) == []), text
        verdicts.append(ok)
    return verdicts


def test_an_excluded_call_is_unreachable_and_every_other_call_is_not(
    real_compiler: GrammarCompiler, smollm2_tok: Any
) -> None:
    done = [
        {"a": 249, "op": "*", "b": 3},
        {"a": 249, "op": "*", "b": 4, "scale": 2},
        {"a": 1, "op": 'say "hi"\\', "b": 0},
        {"a": 1, "op": "line\nbreak", "b": 0},
    ]
    tools = [_tool(CALC, done)]
    excluded = [
        {"a": 249, "op": "*", "b": 3},
        {"a": 249.0, "op": "*", "b": 3},  # the same number spelled differently
        {"a": 249, "op": "*", "b": 3, "scale": 1.0},  # the default, written out
        {"a": 249, "op": "*", "b": 4, "scale": 2},
        {"a": 1, "op": 'say "hi"\\', "b": 0},
        {"a": 1, "op": "line\nbreak", "b": 0},
        # Parses to the float 249.0: exclusive bounds at 249 would let this through.
        '{"name": "f", "arguments": {"a": 249.00000000000000005, "op": "*", "b": 3}}',
        '{"name": "f", "arguments": {"a": 249, "op": "*", "b": 3, "scale": 0.99999999999999995}}',
    ]
    assert _accepted(real_compiler, smollm2_tok, tools, excluded) == [False] * len(excluded)
    others = [
        {"a": 249, "op": "*", "b": 5},
        {"a": 249.5, "op": "*", "b": 3},
        {"a": 248, "op": "*", "b": 3},
        {"a": 249, "op": "+", "b": 3},
        {"a": 249, "op": "**", "b": 3},
        {"a": 249, "op": "", "b": 3},
        {"a": 249, "op": "*", "b": 3, "scale": 2},
        {"a": 249, "op": "*", "b": 4},  # scale differs from the answered call's 2
        {"a": 1, "op": 'say "hi"', "b": 0},
        {"a": 1, "op": 'say "hi"\\\\', "b": 0},
        {"a": 1, "op": "line\nbreaks", "b": 0},
        {"a": 1, "op": "line break", "b": 0},
    ]
    assert _accepted(real_compiler, smollm2_tok, tools, others) == [True] * len(others)


def test_nested_models_and_enums_are_excluded_exactly(
    real_compiler: GrammarCompiler, smollm2_tok: Any
) -> None:
    point = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    params = {
        "type": "object",
        "properties": {
            "a": {"$ref": "#/$defs/P"},
            "rest": {"type": "array", "items": {"$ref": "#/$defs/P"}},
            "kind": {"enum": ["x", "y", "z"]},
        },
        "required": ["a", "rest", "kind"],
        "$defs": {"P": point},
    }
    done = [{"a": {"x": 1}, "rest": [], "kind": "x"}, {"a": {"x": 2}, "rest": [], "kind": "y"}]
    calls = [
        *done,
        {"a": {"x": 1}, "rest": [], "kind": "y"},
        {"a": {"x": 3}, "rest": [], "kind": "x"},
        {"a": {"x": 1}, "rest": [{"x": 1}], "kind": "x"},
    ]
    assert _accepted(real_compiler, smollm2_tok, [_tool(params, done)], calls) == [
        False,
        False,
        True,
        True,
        True,
    ]


def test_exclusions_are_linear_in_the_answered_calls() -> None:
    """A trie over the properties: one branch per distinct value prefix, not a product of
    per-call negations."""
    done = [{"a": 249, "op": "*", "b": b} for b in range(8)]
    narrowed = exclude_arguments(CALC, done)
    # a differs | op differs | b differs (one range left) | for each b: scale differs
    assert len(narrowed["anyOf"]) == 3 + 8
    assert narrowed["anyOf"][2]["properties"]["b"] == {
        "type": "integer",
        "minimum": 8,
        "maximum": 9,
    }
    assert exclude_arguments(CALC, []) is CALC
