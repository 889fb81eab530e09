"""Routing (router.py): what each backend's grammar keeps of a schema, and what it leaves to
the final check."""

from __future__ import annotations

from typing import Any

from agentrt.grammar import GrammarSpec
from agentrt.grammar.report import ReportBuilder
from agentrt.grammar.router import SIBLINGS_OF_REF_UNIONS, keys_to_drop, relax_for

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "multipleOf": 5},
        "host": {"type": "string", "format": "hostname"},
        "code": {"type": "string", "pattern": "^(?!x)[a-z]+$"},
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
    },
    "required": ["id"],
    "x-ui": "wide",
}


def relax(backend: str, schema: Any, drop: frozenset[str] = frozenset()) -> tuple[Any, Any]:
    report = ReportBuilder()
    relaxed = relax_for(backend, schema, report, drop)
    return relaxed, report.build(backend)


def test_each_backend_keeps_what_it_enforces_and_reports_the_rest() -> None:
    llg, llg_report = relax("llguidance", SCHEMA)
    xgr, xgr_report = relax("xgrammar", SCHEMA)
    props = llg["properties"]
    assert props["id"]["multipleOf"] == 5 and props["host"]["format"] == "hostname"
    assert "multipleOf" not in xgr["properties"]["id"] and "format" not in xgr["properties"]["host"]
    # Neither enforces look-ahead or uniqueness: both are checked on the finished output.
    for relaxed in (llg, xgr):
        assert "pattern" not in relaxed["properties"]["code"]
        assert "uniqueItems" not in relaxed["properties"]["tags"] and "x-ui" not in relaxed
    assert llg_report.post_checked == {"pattern", "uniqueItems"}
    assert xgr_report.post_checked == {"pattern", "uniqueItems", "multipleOf", "format"}
    assert "x-ui" in llg_report.annotations and "required" in xgr_report.enforced
    assert SCHEMA["properties"]["id"]["multipleOf"] == 5  # the input is not modified


def test_keyword_values_a_backend_cannot_enforce_are_post_checked() -> None:
    fractional, report = relax("llguidance", {"type": "number", "multipleOf": 0.5})
    assert "multipleOf" not in fractional and report.post_checked == {"multipleOf"}
    optional = {"type": "object", "properties": {"a": {}}, "minProperties": 1}
    assert "minProperties" not in relax("llguidance", optional)[0]
    required = {**optional, "required": ["a"]}
    assert relax("llguidance", required)[0]["minProperties"] == 1


def test_one_of_is_routed_as_any_of_and_its_exclusivity_checked_after() -> None:
    relaxed, report = relax("xgrammar", {"oneOf": [{"type": "integer"}, {"minimum": 0}]})
    assert relaxed == {"anyOf": [{"type": "integer"}, {"minimum": 0}]}
    assert "oneOf" in report.post_checked and "anyOf" not in report.post_checked


def test_dropping_pattern_properties_also_drops_additional_properties() -> None:
    # Without its patterns, additionalProperties: false would forbid keys the schema allows.
    schema = {"type": "object", "patternProperties": {"^a": {}}, "additionalProperties": False}
    relaxed, report = relax("xgrammar", schema)
    assert relaxed == {"type": "object"}
    assert report.post_checked == {"patternProperties", "additionalProperties"}


def test_siblings_of_a_recursive_union_can_be_dropped() -> None:
    schema = {"anyOf": [{"$ref": "#/$defs/A"}, {"type": "null"}], "minProperties": 1}
    relaxed, report = relax("llguidance", schema, frozenset({SIBLINGS_OF_REF_UNIONS}))
    assert relaxed == {"anyOf": [{"$ref": "#/$defs/A"}, {"type": "null"}]}
    assert "minProperties" in report.post_checked


def test_backend_errors_name_what_to_relax_next() -> None:
    unimplemented = 'llguidance: Unimplemented keys: ["contains", "if"]'
    assert keys_to_drop(unimplemented, frozenset()) == {"contains", "if"}
    assert keys_to_drop(unimplemented, frozenset({"if"})) == {"contains"}
    circular = "circular references with sibling keys are not supported"
    first = keys_to_drop(circular, frozenset())
    assert first == {SIBLINGS_OF_REF_UNIONS}
    assert keys_to_drop(circular, first) == {"patternProperties"}  # the next candidate
    assert keys_to_drop("some other failure", frozenset()) == frozenset()


def test_the_router_picks_a_backend_per_schema(auto_compiler) -> None:
    # llguidance first; every keyword a backend leaves out is listed as post-checked.
    exact = auto_compiler.compile(GrammarSpec.from_json_schema({"type": "integer"}))
    assert exact.backend == "llguidance" and exact.report.exact and not exact.gate_eos
    loose = auto_compiler.compile(GrammarSpec.from_json_schema(SCHEMA))
    assert loose.backend == "llguidance" and loose.gate_eos  # post-checks gate the stop token
    assert loose.report.post_checked == {"pattern", "uniqueItems"}
