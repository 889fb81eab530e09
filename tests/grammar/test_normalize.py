from __future__ import annotations

from agentrt.grammar.normalize import normalize_schema
from agentrt.grammar.refs import localize_refs
from agentrt.grammar.report import ReportBuilder


def norm(schema: dict) -> tuple[dict, ReportBuilder]:
    report = ReportBuilder()
    return normalize_schema(schema, report).schema, report


def test_pointer_refs_move_to_defs_and_recursion_stays() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/properties/a"},
                       "child": {"$ref": "#"}},
    }  # fmt: skip
    out = localize_refs(schema)
    ref = out["properties"]["b"]["$ref"]
    assert ref.startswith("#/$defs/") and out["$defs"][ref.split("/")[-1]] == {"type": "integer"}
    assert out["properties"]["child"] == {"$ref": "#"}  # recursion kept as recursion


def test_allof_merges_exactly_and_keeps_property_order() -> None:
    schema = {
        "$defs": {"Base": {"type": "object", "properties": {"id": {"type": "integer"}},
                           "required": ["id"]}},
        "allOf": [{"$ref": "#/$defs/Base"},
                  {"properties": {"name": {"type": "string"}}, "required": ["name"]}],
    }  # fmt: skip
    out, _ = norm(schema)
    assert "allOf" not in out
    assert list(out["properties"]) == ["id", "name"]
    assert out["required"] == ["id", "name"]


def test_allof_with_closed_branch_is_not_merged() -> None:
    schema = {"allOf": [
        {"properties": {"a": {}}, "additionalProperties": False},
        {"properties": {"b": {}}},
    ]}  # fmt: skip
    out, _ = norm(schema)
    assert "allOf" in out  # merging would wrongly allow "b"


def test_oneof_becomes_anyof_only_when_disjoint() -> None:
    by_type, _ = norm({"oneOf": [{"type": "string"}, {"type": "integer"}]})
    assert "anyOf" in by_type and "oneOf" not in by_type
    by_tag, _ = norm({"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "a"}}, "required": ["kind"]},
        {"type": "object", "properties": {"kind": {"const": "b"}}, "required": ["kind"]},
    ]})  # fmt: skip
    assert "anyOf" in by_tag
    closed, _ = norm({"oneOf": [
        {"type": "object", "properties": {"x": {}}, "required": ["x"],
         "additionalProperties": False},
        {"type": "object", "properties": {"y": {}}, "required": ["y"],
         "additionalProperties": False},
    ]})  # fmt: skip
    assert "anyOf" in closed
    overlapping, _ = norm({"oneOf": [{"type": "integer"}, {"type": "number"}]})
    assert "oneOf" in overlapping  # 1 matches both: exclusivity must be post-checked


def test_unknown_format_and_annotations_are_reported() -> None:
    out, report = norm({"type": "string", "format": "topic", "title": "T", "x-ui": 1})
    assert out == {"type": "string"}
    built = report.build("none")
    assert {"format", "title", "x-ui"} <= built.annotations
    kept, _ = norm({"type": "string", "format": "date"})
    assert kept["format"] == "date"


def test_draft4_spellings_are_rewritten() -> None:
    out, _ = norm({"type": "array", "items": [{"type": "string"}], "additionalItems": False})
    assert out == {"type": "array", "prefixItems": [{"type": "string"}], "items": False}
    out, _ = norm({"type": "number", "minimum": 3, "exclusiveMinimum": True})
    assert out == {"type": "number", "exclusiveMinimum": 3}
    out, _ = norm({"type": ["string"]})
    assert out == {"type": "string"}


def test_pydantic_nullable_and_defs_are_kept_working() -> None:
    schema = {
        "$defs": {"Pet": {"type": "object", "properties": {"n": {"type": "string"}},
                          "title": "Pet"}},
        "properties": {"pet": {"anyOf": [{"$ref": "#/$defs/Pet"}, {"type": "null"}],
                               "default": None}},
        "type": "object", "title": "Owner",
    }  # fmt: skip
    out, _ = norm(schema)
    assert out["properties"]["pet"] == {"anyOf": [{"$ref": "#/$defs/Pet"}, {"type": "null"}]}
    assert out["$defs"]["Pet"] == {"type": "object", "properties": {"n": {"type": "string"}}}


def test_ref_siblings_follow_the_draft() -> None:
    defs = {"D": {"type": "object", "properties": {"a": {"type": "integer"}}}}
    new, _ = norm({"$defs": defs, "properties": {"x": {"$ref": "#/$defs/D", "required": ["a"]}}})
    assert new["properties"]["x"] == {**defs["D"], "required": ["a"]}  # intersection, inlined
    old, report = norm({
        "$schema": "http://json-schema.org/draft-04/schema#", "definitions": defs,
        "properties": {"x": {"$ref": "#/definitions/D", "type": "string"}},
    })  # fmt: skip
    assert old["properties"]["x"] == {"$ref": "#/definitions/D"}  # sibling ignored (draft 4)
    assert "type" in report.build("none").annotations


def test_anchor_refs_resolve() -> None:
    schema = {
        "properties": {"p": {"$ref": "#prio"}},
        "definitions": {"x": {"$id": "#prio", "type": "integer"}},
    }
    out = localize_refs(schema)
    ref = out["properties"]["p"]["$ref"]
    assert out["$defs"][ref.split("/")[-1]]["type"] == "integer"


def test_not_empty_schema_is_false_and_oneof_by_nested_discriminator_is_anyof() -> None:
    out, report = norm({"properties": {"a": {"not": {"description": "nothing"}}, "b": {}}})
    assert out["properties"]["a"] is False  # enforced by every backend, not post-checked
    assert "not" in report.build("none").enforced
    root, _ = norm({"not": {}})
    assert root == {"not": {}}  # an unsatisfiable root is left to the post-check
    by_nested_type, _ = norm({"oneOf": [
        {"type": "object", "properties": {"p": {"type": "string"}}, "required": ["p"]},
        {"type": "object", "properties": {"p": {"type": "object"}}, "required": ["p"]},
    ]})  # fmt: skip
    assert "anyOf" in by_nested_type and "oneOf" not in by_nested_type
