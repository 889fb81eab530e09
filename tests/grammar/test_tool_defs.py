"""Tool definitions -> the tool-call grammar: parameters with their own `$defs` (what
Pydantic emits for nested models) compile, with the definitions moved to the payload root
under `<tool>__<name>`; a named tool_choice is exactly one call; excluded argument objects
(an agent's answered calls) cannot be produced, and every other call still can."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agentrt.grammar import GrammarCompiler, GrammarSpec, GrammarSpecError
from agentrt.grammar.tools import (
    EXCLUDED_ARGUMENTS,
    exclude_arguments,
    tool_call_spec_text,
    tool_calls_schema,
)
from agentrt.grammar.validate import FinalValidator

from .helpers import drive

POINT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
PARAMS = {
    "type": "object",
    "properties": {
        "a": {"$ref": "#/$defs/P"},
        "rest": {"type": "array", "items": {"$ref": "#/$defs/P"}},
    },
    "required": ["a", "rest"],
    "$defs": {"P": POINT},
}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": PARAMS}}]


def test_defs_are_hoisted_and_renamed() -> None:
    schema = tool_calls_schema([{"name": "f", "parameters": PARAMS}], "required", parallel=True)
    assert schema["$defs"] == {"f__P": POINT}
    args = schema["items"]["properties"]["arguments"]
    assert args["properties"]["a"] == {"$ref": "#/$defs/f__P"}
    assert "$defs" not in args


@pytest.mark.parametrize("parallel", [True, False])
def test_nested_model_arguments_are_enforced(
    real_compiler: GrammarCompiler, smollm2_tok: Any, parallel: bool
) -> None:
    grammar = real_compiler.compile(
        GrammarSpec.from_tools(TOOLS, "required", parallel_tool_calls=parallel)
    )

    def accepts(payload: Any) -> bool:
        matcher = grammar.matcher()
        ids = smollm2_tok.encode(json.dumps(payload), add_special_tokens=False)
        return all(matcher.accept_token(t) for t in ids) and matcher.can_terminate()

    good = {"name": "f", "arguments": {"a": {"x": 1}, "rest": [{"x": 2}]}}
    bad = {"name": "f", "arguments": {"a": {"x": "one"}, "rest": []}}
    assert accepts([good] if parallel else good)
    assert not accepts([bad] if parallel else bad)


# ---- a named tool_choice: exactly one call ------------------------------------------------

NAMED = {"type": "function", "function": {"name": "f"}}


def test_named_choice_is_one_call_even_with_parallel_calls(
    real_compiler: GrammarCompiler, smollm2_tok: Any
) -> None:
    """OpenAI and vLLM answer a named tool_choice with exactly one call of that tool (older
    Instructor asserts it): the grammar allows one call object, never a list."""
    spec = GrammarSpec.from_tools(TOOLS, NAMED, parallel_tool_calls=True)
    grammar = real_compiler.compile(spec)
    call = {"name": "f", "arguments": {"a": {"x": 1}, "rest": []}}
    assert drive(grammar.matcher(), smollm2_tok, json.dumps(call)) == (True, True)
    assert drive(grammar.matcher(), smollm2_tok, json.dumps([call]))[0] is False
    assert drive(grammar.matcher(), smollm2_tok, json.dumps([call, call]))[0] is False
    # "required" with parallel calls still takes a list.
    listed = real_compiler.compile(GrammarSpec.from_tools(TOOLS, "required"))
    assert drive(listed.matcher(), smollm2_tok, json.dumps([call, call])) == (True, True)


# ---- excluded argument objects (an agent's answered calls) ----------------------------------

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
    params = {
        **PARAMS,
        "properties": {**PARAMS["properties"], "kind": {"enum": ["x", "y", "z"]}},
        "required": ["a", "rest", "kind"],
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


def test_a_tool_with_no_call_left_is_not_offered() -> None:
    pick = {
        "type": "object",
        "properties": {"name": {"enum": ["x", "y"]}},
        "required": ["name"],
    }
    other = {"type": "function", "function": {"name": "g", "parameters": CALC}}
    exhausted = _tool(pick, [{"name": "x"}, {"name": "y"}])
    canonical, choice = tool_call_spec_text([exhausted, other], "required")
    assert [t["name"] for t in canonical] == ["g"] and choice == "required"
    narrowed, _ = tool_call_spec_text([_tool(pick, [{"name": "x"}])], "auto")
    assert narrowed[0]["parameters"]["properties"]["name"] == {"enum": ["y"]}
    # Nothing left: "auto" becomes plain text; a call that must be made is an error.
    assert tool_call_spec_text([exhausted], "auto") == ([], "none")
    assert GrammarSpec.from_tools([exhausted], "auto").kind == "text"
    with pytest.raises(GrammarSpecError, match="every call"):
        tool_call_spec_text([exhausted], "required")
    with pytest.raises(GrammarSpecError, match="every call"):
        tool_call_spec_text([exhausted, other], "f")


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
