"""Compiler + matcher behaviour on a small synthetic vocabulary, for each backend."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from agentrt.grammar import (
    GrammarCompileError,
    GrammarCompiler,
    GrammarCompileTimeout,
    GrammarSpec,
    MatcherStateError,
    SchemaLimitError,
    SchemaLimits,
    allocate_bitmask,
    allowed_token_ids,
)

from .helpers import SYNTH_VOCAB, accept_all, allowed_now, drive

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}


def test_json_schema_accepts_valid_and_rejects_invalid(synth_compiler, synth_tok) -> None:
    grammar = synth_compiler.compile(GrammarSpec.from_json_schema(PERSON))
    assert grammar.backend == synth_compiler.order[0]
    assert drive(grammar.matcher(), synth_tok, '{"name": "Al", "ok": true}') == (True, True)
    assert drive(grammar.matcher(), synth_tok, '{"name": "Al", "ok": 1}')[0] is False
    assert drive(grammar.matcher(), synth_tok, '{"name": "Al"')[1] is False  # incomplete


def test_regex_and_choice(synth_compiler, synth_tok) -> None:
    g = synth_compiler.compile(GrammarSpec.from_regex(r"[a-c]{2}\d"))
    assert drive(g.matcher(), synth_tok, "ab7") == (True, True)
    assert drive(g.matcher(), synth_tok, "ad7")[0] is False
    choice = GrammarSpec.from_choice(["yes", "no"])
    g = synth_compiler.compile(choice)
    assert drive(g.matcher(), synth_tok, "no") == (True, True)
    assert drive(g.matcher(), synth_tok, "nope")[0] is False


def test_ebnf(synth_compiler, synth_tok) -> None:
    if synth_compiler.order == ("xgrammar",):
        spec = GrammarSpec.from_ebnf('root ::= "a"+ "b"', syntax="gbnf")
    else:
        spec = GrammarSpec.from_ebnf('start: "a"+ "b"')
    g = synth_compiler.compile(spec)
    assert drive(g.matcher(), synth_tok, "aaab") == (True, True)
    assert drive(g.matcher(), synth_tok, "ba")[0] is False


def test_padded_vocab_and_stop_token(synth_compiler, synth_tok) -> None:
    g = synth_compiler.compile(GrammarSpec.from_regex("x"))
    m = g.matcher()
    bitmask = allocate_bitmask(3, SYNTH_VOCAB)  # all ones initially
    m.fill_bitmask(bitmask, 1)
    assert allowed_token_ids(bitmask, 1, SYNTH_VOCAB) == [synth_tok.convert_tokens_to_ids("x")]
    assert (bitmask[0] == -1).all() and (bitmask[2] == -1).all()  # other rows untouched
    assert m.accept_token(synth_tok.convert_tokens_to_ids("x"))
    m.fill_bitmask(bitmask, 1)
    assert allowed_token_ids(bitmask, 1, SYNTH_VOCAB) == [0]  # only <eos>
    assert not m.accept_token(SYNTH_VOCAB - 1)  # padded id: never allowed
    assert m.accept_token(0)
    m.fill_bitmask(bitmask, 1)
    assert allowed_token_ids(bitmask, 1, SYNTH_VOCAB) == []


def test_rollback_restores_state(synth_compiler, synth_tok) -> None:
    g = synth_compiler.compile(GrammarSpec.from_json_schema(PERSON))
    m = g.matcher()
    ids = synth_tok.encode('{"name": "Al", "ok": true}', add_special_tokens=False)
    assert accept_all(m, ids) == len(ids)
    bitmask = allocate_bitmask(2, SYNTH_VOCAB)
    m.rollback(3)
    m.fill_bitmask(bitmask, 0)
    assert accept_all(m, ids[-3:]) == 3 and m.can_terminate()
    m.rollback(len(ids))
    fresh = g.matcher()
    fresh.fill_bitmask(bitmask, 1)
    m.fill_bitmask(bitmask, 0)
    assert np.array_equal(bitmask[0], bitmask[1])  # back at the start
    with pytest.raises(MatcherStateError):
        m.rollback(1)


def test_forced_tokens_jump_forward(synth_compiler, synth_tok) -> None:
    g = synth_compiler.compile(GrammarSpec.from_json_schema(PERSON))
    m = g.matcher()
    forced = m.forced_tokens()
    text = synth_tok.decode(forced)
    assert text and '{"name": "'.startswith(text)
    assert accept_all(m, forced) == len(forced)
    assert m.num_tokens == len(forced)


def test_post_checked_keywords_gate_eos(auto_compiler, synth_tok) -> None:
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    g = auto_compiler.compile(GrammarSpec.from_json_schema(schema))
    assert "uniqueItems" in g.report.post_checked and "items" in g.report.enforced
    assert drive(g.matcher(), synth_tok, "[1, 2]") == (True, True)
    m = g.matcher()
    assert drive(m, synth_tok, "[1, 1]") == (True, False)  # grammar ok, cannot stop
    assert not m.accept_token(0)  # <eos> refused
    bitmask = allocate_bitmask(1, SYNTH_VOCAB)
    m.fill_bitmask(bitmask, 0)
    assert 0 not in allowed_token_ids(bitmask, 0, SYNTH_VOCAB)
    assert any("non-unique" in e for e in m.validate_final())


def test_report_lists_every_dropped_keyword(auto_compiler) -> None:
    schema = {
        "type": "object", "title": "T",
        "properties": {"a": {"type": "string", "format": "zip-code"},
                       "b": {"not": {"type": "null"}}},
        "dependentRequired": {"a": ["b"]},
    }  # fmt: skip
    report = auto_compiler.compile(GrammarSpec.from_json_schema(schema)).report
    assert report.backend == "llguidance"
    assert {"title", "format"} <= report.annotations
    assert {"not", "dependentRequired"} <= report.post_checked
    assert {"type", "properties"} <= report.enforced
    assert "post_checked" in str(report)


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "strng"}, "strng"),
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "missing"),
        ({"$ref": "http://example.com/s.json"}, "not a local reference"),
        ({"type": "object", "properties": {"a": 3}}, "properties/a"),
    ],
)
def test_bad_schemas_name_the_problem(auto_compiler, schema: Any, message: str) -> None:
    with pytest.raises(GrammarCompileError, match=message):
        auto_compiler.compile(GrammarSpec.from_json_schema(schema))


def test_schema_limits(synth_tok) -> None:
    compiler = GrammarCompiler(synth_tok, schema_limits=SchemaLimits(max_depth=5))
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(6):
        deep = {"type": "array", "items": deep}
    with pytest.raises(SchemaLimitError, match="depth"):
        compiler.compile(GrammarSpec.from_json_schema(deep))
    small = GrammarCompiler(synth_tok, schema_limits=SchemaLimits(max_enum_values=10))
    with pytest.raises(SchemaLimitError, match="enum"):
        small.compile(GrammarSpec.from_json_schema({"enum": list(range(11))}))


def test_memory_cache_lru_by_bytes_and_disk_cache(synth_tok, tmp_path) -> None:
    compiler = GrammarCompiler(synth_tok, disk_cache_dir=str(tmp_path))
    spec = GrammarSpec.from_json_schema(PERSON)
    first = compiler.compile(spec)
    assert compiler.compile(spec) is first and compiler.cache.hits == 1
    compiler.cache.max_bytes = first.memory_bytes  # room for exactly one such grammar
    compiler.compile(GrammarSpec.from_regex("a+"))
    assert len(compiler.cache) == 1 and compiler.cache.num_bytes <= first.memory_bytes
    assert len(list(tmp_path.glob("*.json"))) == 2
    again = GrammarCompiler(synth_tok, disk_cache_dir=str(tmp_path)).compile(spec)
    assert again.report == first.report and again.backend == first.backend


def test_compile_async_returns_future(auto_compiler, synth_tok) -> None:
    future = auto_compiler.compile_async(GrammarSpec.from_regex("[0-9]+"))
    grammar = future.result(timeout=10)
    assert drive(grammar.matcher(), synth_tok, "42") == (True, True)
    bad = auto_compiler.compile_async(GrammarSpec.from_json_schema({"type": "strng"}))
    with pytest.raises(GrammarCompileError):
        bad.result(timeout=10)


def pathological_schema(depth: int = 4, enum_n: int = 1500) -> dict[str, Any]:
    """Deep anyOf nesting around a large enum: xgrammar needs seconds for this."""
    big = {"enum": [f"v{i}x{(i * 7919) % 10007}" for i in range(enum_n)]}
    node: dict[str, Any] = big
    for _ in range(depth):
        node = {"anyOf": [
            {"type": "object", "properties": {
                "a": node, "b": {"type": "array", "items": {"anyOf": [big, {"type": "integer"}]}}}},
            {"type": "array", "items": node},
            big,
        ]}  # fmt: skip
    return node


def test_pathological_schema_hits_time_budget_and_others_go_on(synth_tok) -> None:
    compiler = GrammarCompiler(synth_tok, backend="xgrammar", timeout_s=0.3)
    spec = GrammarSpec.from_json_schema(pathological_schema())
    start = time.monotonic()
    with pytest.raises(GrammarCompileTimeout, match="did not compile within"):
        compiler.compile(spec)
    assert time.monotonic() - start < 2.5  # the budget, not the (multi-second) compile
    slow = compiler.compile_async(spec)
    quick = compiler.compile_async(GrammarSpec.from_json_schema(PERSON), timeout_s=30)
    assert quick.result(timeout=30).backend == "xgrammar"  # not queued behind the slow one
    with pytest.raises(GrammarCompileTimeout):
        slow.result(timeout=30)
    assert compiler._workers.wait_idle(60)  # abandoned native work drains in the background


def test_rollback_over_the_stop_token(synth_compiler, synth_tok) -> None:
    g = synth_compiler.compile(GrammarSpec.from_json_schema(PERSON))
    m = g.matcher()
    ids = synth_tok.encode('{"name": "Al", "ok": true}', add_special_tokens=False)
    assert accept_all(m, [*ids, 0]) == len(ids) + 1 and allowed_now(m) == []
    m.rollback(1)  # a rejected speculative <eos>
    assert allowed_now(m) == [0] and m.can_terminate()
    m.rollback(1)
    assert not m.can_terminate() and m.accept_token(ids[-1]) and m.can_terminate()


def test_final_validation_checks_formats_without_optional_packages(auto_compiler) -> None:
    schema = {
        "type": "object",
        "properties": {"when": {"type": "string", "format": "duration"},
                       "link": {"type": "string", "format": "uri-reference"}},
    }  # fmt: skip
    m = auto_compiler.compile(GrammarSpec.from_json_schema(schema)).matcher()
    assert m.validate_final('{"when": "P3DT4H", "link": "../a/b"}') == []
    errors = m.validate_final('{"when": "3 days", "link": "://"}')
    assert len(errors) == 2 and all("is not a" in e for e in errors)
    assert m.validate_final('{"when": ') and "not valid JSON" in m.validate_final("{")[0]


def test_llguidance_refusals_are_relaxed_not_rerouted(auto_compiler, synth_tok) -> None:
    # A recursive union with a sibling keyword: llguidance cannot intersect the two, so the
    # sibling is relaxed (post-checked) and the grammar stays on llguidance.
    schema = {
        "$defs": {"A": {"type": "object", "properties": {"c": {
            "anyOf": [{"$ref": "#/$defs/A"}, {"type": "null"}], "type": "object"}}}},
        "$ref": "#/$defs/A",
    }  # fmt: skip
    g = auto_compiler.compile(GrammarSpec.from_json_schema(schema))
    assert g.backend == "llguidance" and "type" in g.report.post_checked
    assert drive(g.matcher(), synth_tok, '{"c": {"c": {}}}') == (True, True)
    assert drive(g.matcher(), synth_tok, '{"c": null}') == (True, False)  # EOS gate: type


def test_a_regex_too_deep_for_a_backend_is_a_limit_error(auto_compiler) -> None:
    # 400 nested groups pass Python's `re` but not a backend's recursive reader: that used to
    # fail as "internal: RecursionError" (reason "backend", a server 500).
    from agentrt.grammar.errors import SchemaLimitError

    spec = GrammarSpec.from_regex("(a|" * 400 + "b" + ")" * 400)
    with pytest.raises(SchemaLimitError, match="nested too deeply"):
        auto_compiler.compile(spec)
    with pytest.raises(SchemaLimitError, match="nested too deeply"):
        auto_compiler.compile_async(spec).result(timeout=30)
