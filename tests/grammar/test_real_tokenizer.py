"""The grammar layer with SmolLM2's real tokenizer (49,152 tokens)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel

from agentrt.grammar import GrammarCompiler, GrammarSpec, allocate_bitmask, allowed_token_ids

from .helpers import TOOLS, accept_all, drive

MASKBENCH = (
    Path(__file__).resolve().parents[3] / "shared" / "data" / "maskbench"
)  # beside the checkout


class Address(BaseModel):
    street: str
    city: str


class Person(BaseModel):
    name: str
    age: int
    address: Address | None = None
    tags: list[str] = []
    role: Literal["admin", "user"] = "user"


def test_pydantic_model_round_trip(real_compiler, smollm2_tok) -> None:
    grammar = real_compiler.compile(GrammarSpec.from_type(Person))
    assert grammar.backend == "llguidance" and grammar.report.exact
    good = Person(name="Ann", age=41, address=Address(street="1 Main St", city="Oslo"))
    text = json.dumps(good.model_dump(), ensure_ascii=False)
    m = grammar.matcher()
    assert drive(m, smollm2_tok, text) == (True, True)
    assert Person.model_validate_json(m.text()) == good and m.validate_final() == []
    bad = '{"name": "Ann", "age": "41"'
    assert drive(grammar.matcher(), smollm2_tok, bad)[0] is False


def test_list_of_models_and_enum_union(real_compiler, smollm2_tok) -> None:
    g = real_compiler.compile(GrammarSpec.from_type(list[Address]))
    assert drive(g.matcher(), smollm2_tok, '[{"street": "a", "city": "b"}]') == (True, True)
    u = real_compiler.compile(GrammarSpec.from_type(int | Literal["none"]))
    assert drive(u.matcher(), smollm2_tok, '"none"') == (True, True)
    assert drive(u.matcher(), smollm2_tok, "17") == (True, True)
    assert drive(u.matcher(), smollm2_tok, '"some"')[0] is False


def test_tool_calls(real_compiler, smollm2_tok) -> None:
    call = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
    required = real_compiler.compile(GrammarSpec.from_tools(TOOLS, "required"))
    assert drive(required.matcher(), smollm2_tok, f"[{call}]") == (True, True)
    assert drive(required.matcher(), smollm2_tok, "Hello")[0] is False
    wrong_args = '[{"name": "add", "arguments": {"city": "x"}}]'
    assert drive(required.matcher(), smollm2_tok, wrong_args)[0] is False
    named = real_compiler.compile(
        GrammarSpec.from_tools(TOOLS, "get_weather", parallel_tool_calls=False)
    )
    assert drive(named.matcher(), smollm2_tok, call)[0] is False
    weather = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    assert drive(named.matcher(), smollm2_tok, weather) == (True, True)
    auto = real_compiler.compile(GrammarSpec.from_tools(TOOLS, "auto"))
    assert drive(auto.matcher(), smollm2_tok, "It is sunny.") == (True, True)
    assert drive(auto.matcher(), smollm2_tok, f"[{call}]") == (True, True)
    assert drive(auto.matcher(), smollm2_tok, '[{"name": "nope"')[0] is False


def test_padded_logits_width(smollm2_tok) -> None:
    compiler = GrammarCompiler(smollm2_tok, vocab_size=49_152 + 128)
    g = compiler.compile(GrammarSpec.from_choice(["yes", "no"]))
    bitmask = allocate_bitmask(2, compiler.vocab_size)
    assert bitmask.shape == (2, (49_152 + 128) // 32)
    g.matcher().fill_bitmask(bitmask, 1)
    allowed = allowed_token_ids(bitmask, 1, compiler.vocab_size)
    assert allowed and max(allowed) < 49_152
    assert {smollm2_tok.decode([t]) for t in allowed} <= {"y", "ye", "yes", "n", "no"}


def test_forced_tokens_follow_the_schema(real_compiler, smollm2_tok) -> None:
    g = real_compiler.compile(GrammarSpec.from_type(Address))
    m = g.matcher()
    forced = m.forced_tokens()
    assert smollm2_tok.decode(forced) == '{"street": "'[: len(smollm2_tok.decode(forced))]
    assert len(forced) >= 2 and accept_all(m, forced) == len(forced)


@pytest.mark.skipif(not MASKBENCH.exists(), reason="MaskBench data not present")
@pytest.mark.parametrize(
    "name", ["Github_easy---o10010.json", "Kubernetes---kb_9_Normalized.json",
             "Snowplow---sp_1_Normalized.json", "WashingtonPost---wp_13_Normalized.json",
             "JsonSchemaStore---openrewrite.json"],
)  # fmt: skip
def test_maskbench_cases(real_compiler, smollm2_tok, name: str) -> None:
    item = json.loads((MASKBENCH / name).read_text())
    g = real_compiler.compile(GrammarSpec.from_json_schema(item["schema"]))
    for test in item["tests"]:
        text = json.dumps(test["data"], ensure_ascii=False)
        accepted, can_stop = drive(g.matcher(), smollm2_tok, text)
        assert (accepted and can_stop) == test["valid"], (test["description"], g.report)
