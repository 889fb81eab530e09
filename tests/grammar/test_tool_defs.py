"""Tool parameters with their own `$defs` (what Pydantic emits for nested models) compile:
the definitions move to the payload root under `<tool>__<name>` and references follow."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agentrt.grammar import GrammarCompiler, GrammarSpec
from agentrt.grammar.tools import tool_calls_schema

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
