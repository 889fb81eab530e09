"""Tool definitions -> the tool-call grammar: parameters with their own `$defs` (what
Pydantic emits for nested models) compile, with the definitions moved to the payload root
under `<tool>__<name>`; a named tool_choice is exactly one call; a tool whose every call is
excluded is not offered. (How excluded calls are compiled out: test_exclude.py.)"""

from __future__ import annotations

import json
from typing import Any

import pytest

from agentrt.grammar import GrammarCompiler, GrammarSpec, GrammarSpecError
from agentrt.grammar.tools import EXCLUDED_ARGUMENTS, tool_call_spec_text, tool_calls_schema

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


# ---- a tool with no call left --------------------------------------------------------------


def test_a_tool_with_no_call_left_is_not_offered() -> None:
    pick = {
        "type": "object",
        "properties": {"name": {"enum": ["x", "y"]}},
        "required": ["name"],
    }

    def tool(excluded: list[dict]) -> dict:
        function = {"name": "f", "parameters": pick, EXCLUDED_ARGUMENTS: excluded}
        return {"type": "function", "function": function}

    other = {"type": "function", "function": {"name": "g", "parameters": POINT}}
    exhausted = tool([{"name": "x"}, {"name": "y"}])
    canonical, choice = tool_call_spec_text([exhausted, other], "required")
    assert [t["name"] for t in canonical] == ["g"] and choice == "required"
    narrowed, _ = tool_call_spec_text([tool([{"name": "x"}])], "auto")
    assert narrowed[0]["parameters"]["properties"]["name"] == {"enum": ["y"]}
    # Nothing left: "auto" becomes plain text; a call that must be made is an error.
    assert tool_call_spec_text([exhausted], "auto") == ([], "none")
    assert GrammarSpec.from_tools([exhausted], "auto").kind == "text"
    with pytest.raises(GrammarSpecError, match="every call"):
        tool_call_spec_text([exhausted], "required")
    with pytest.raises(GrammarSpecError, match="every call"):
        tool_call_spec_text([exhausted, other], "f")
