"""Generation bounds (bounds.py): caps added where a schema sets none, refused past the cap,
listed in the report, never applied unless asked for, and always a subset of the schema."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from agentrt.grammar import GenerationBounds, GrammarCompiler, GrammarSpec, GrammarSpecError

from .helpers import SYNTH_VOCAB, drive

SMALL = GenerationBounds(max_string_length=5, max_items=3, max_any_depth=1)


@pytest.fixture(scope="module", params=["llguidance", "xgrammar"])
def bounded(request: pytest.FixtureRequest, synth_tok) -> GrammarCompiler:
    return GrammarCompiler(synth_tok, vocab_size=SYNTH_VOCAB, backend=request.param, bounds=SMALL)


@pytest.fixture(scope="module")
def bounded_auto(synth_tok) -> GrammarCompiler:
    return GrammarCompiler(synth_tok, vocab_size=SYNTH_VOCAB, bounds=SMALL)


def bounded_entry(grammar: Any, keyword: str) -> Any:
    return next(e for e in grammar.report.entries if e.keyword == keyword and e.status == "bounded")


def test_string_without_max_length_is_capped_and_reported(bounded, synth_tok) -> None:
    g = bounded.compile(GrammarSpec.from_json_schema({"type": "string"}))
    assert drive(g.matcher(), synth_tok, '"abcde"') == (True, True)
    assert drive(g.matcher(), synth_tok, '"abcdef"')[0] is False  # the 6th character
    entry = bounded_entry(g, "maxLength")
    assert entry.example_path == "#" and "5 characters" in entry.note
    assert "maxLength" in g.report.bounded and "bounded" in str(g.report)


def test_array_without_max_items_is_capped_and_reported(bounded, synth_tok) -> None:
    g = bounded.compile(
        GrammarSpec.from_json_schema({"type": "array", "items": {"type": "integer"}})
    )
    assert drive(g.matcher(), synth_tok, "[1, 2, 3]") == (True, True)
    assert drive(g.matcher(), synth_tok, "[1, 2, 3, 4]")[0] is False
    assert "3 items" in bounded_entry(g, "maxItems").note


def test_the_schemas_own_limits_win(bounded, synth_tok) -> None:
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "maxLength": 8},
                       "t": {"type": "string", "minLength": 7},
                       "a": {"type": "array", "items": {"type": "integer"}, "maxItems": 5}},
        "required": ["s", "t", "a"],
    }  # fmt: skip
    g = bounded.compile(GrammarSpec.from_json_schema(schema))
    text = '{"s": "abcdefgh", "t": "abcdefg", "a": [1, 2, 3, 4, 5]}'
    assert drive(g.matcher(), synth_tok, text) == (True, True)
    assert drive(g.matcher(), synth_tok, '{"s": "abcdefghi"')[0] is False
    assert bounded_entry(g, "maxLength").count == 1  # only "t" (its minLength raised the cap)


def test_objects_with_declared_properties_are_closed(bounded_auto, synth_tok) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    g = bounded_auto.compile(GrammarSpec.from_json_schema(schema))
    assert drive(g.matcher(), synth_tok, '{"a": 1}') == (True, True)
    assert drive(g.matcher(), synth_tok, '{"a": 1, "b": 2}')[0] is False
    assert "undeclared" in bounded_entry(g, "additionalProperties").note
    # Asking for extra keys keeps them (as Pydantic's extra="allow" does), with bounded values.
    open_schema = {**schema, "additionalProperties": True}
    g = bounded_auto.compile(GrammarSpec.from_json_schema(open_schema))
    assert drive(g.matcher(), synth_tok, '{"a": 1, "b": 2}') == (True, True)
    assert drive(g.matcher(), synth_tok, '{"a": 1, "b": [[1]]}')[0] is False  # depth 1


def test_maps_have_bounded_keys_entries_and_depth(bounded_auto, synth_tok) -> None:
    g = bounded_auto.compile(GrammarSpec.from_json_schema({"type": "object"}))
    assert drive(g.matcher(), synth_tok, '{"abcde": [1, "x"], "b": {"c": null}}') == (True, True)
    assert drive(g.matcher(), synth_tok, '{"abcdef": 1}')[0] is False  # key length
    assert drive(g.matcher(), synth_tok, '{"a": 1, "b": 2, "c": 3, "d": 4}')[0] is False
    assert drive(g.matcher(), synth_tok, '{"a": [[1]]}')[0] is False  # nesting
    assert "maxProperties" in g.report.bounded


def test_no_bounds_unless_asked(auto_compiler, bounded_auto, synth_tok) -> None:
    long_text = json.dumps({"s": "x" * 600, "extra": list(range(80))})
    schema = {"type": "object", "properties": {"s": {"type": "string"}}}
    exact = auto_compiler.compile(GrammarSpec.from_json_schema(schema))
    assert drive(exact.matcher(), synth_tok, long_text) == (True, True)
    assert not exact.report.bounded
    spec = GrammarSpec.from_json_schema(schema)
    assert drive(bounded_auto.compile(spec).matcher(), synth_tok, long_text)[0] is False
    # One request can opt out of the compiler's bounds, or bring its own.
    unbounded = bounded_auto.compile(spec.with_bounds(None))
    assert drive(unbounded.matcher(), synth_tok, long_text) == (True, True)
    wide = bounded_auto.compile(spec.with_bounds(GenerationBounds(max_string_length=600)))
    assert drive(wide.matcher(), synth_tok, json.dumps({"s": "x" * 600})) == (True, True)
    with pytest.raises(GrammarSpecError, match="JSON specs"):
        GrammarSpec.from_regex("a+").with_bounds(SMALL)


def test_bounds_are_validated() -> None:
    with pytest.raises(ValueError, match="max_items"):
        GenerationBounds(max_items=0)
    assert GenerationBounds.from_option(SMALL.to_option()) == SMALL
    assert GenerationBounds.from_option("off") is None


def test_oneof_discriminator_is_required_so_oneof_is_enforced(bounded_auto, synth_tok) -> None:
    # The branches differ by "kind" but none requires it: `{"n": 1}` matches both, so the
    # exact grammar can only check exclusivity after generation (a possible dead end).
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "oneOf": [{"properties": {"kind": {"const": "a"}}},
                  {"properties": {"kind": {"const": "b"}}}],
    }  # fmt: skip
    g = bounded_auto.compile(GrammarSpec.from_json_schema(schema))
    assert "oneOf" not in g.report.post_checked and not g.gate_eos
    assert "discriminator 'kind'" in bounded_entry(g, "required").note
    assert drive(g.matcher(), synth_tok, '{"n": 1}')[0] is False  # "kind" is required
    assert drive(g.matcher(), synth_tok, '{"n": 1, "kind": "b"}') == (True, True)


def test_allof_branches_are_not_closed(bounded_auto, synth_tok) -> None:
    # Closing either branch would forbid the key the other one requires.
    schema = {"allOf": [
        {"type": "object", "properties": {"a": {}}, "required": ["a"]},
        {"type": "object", "properties": {"b": {}}, "required": ["b"],
         "additionalProperties": {"type": "integer"}},
    ]}  # fmt: skip
    g = bounded_auto.compile(GrammarSpec.from_json_schema(schema))
    assert drive(g.matcher(), synth_tok, '{"a": 1, "b": 2}') == (True, True)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"tags": {"type": "array"}, "x": {}},
         "required": ["tags", "y"]},
        {"anyOf": [{"type": "string"}, {"type": "object", "patternProperties": {
            "^a": {"type": "array", "items": {"type": "string"}}}}]},
        {"$defs": {"N": {"type": "object", "properties": {"next": {"$ref": "#/$defs/N"},
                                                          "v": {"type": "string"}}}},
         "$ref": "#/$defs/N"},
    ],
)  # fmt: skip
def test_every_bounded_output_is_valid_for_the_schema(bounded_auto, synth_tok, schema) -> None:
    """Walk the bounded grammar by always taking the allowed token the model would (the
    lowest id); whatever it completes must validate against the original schema."""
    from agentrt.grammar import allocate_bitmask, allowed_token_ids

    g = bounded_auto.compile(GrammarSpec.from_json_schema(schema))
    m = g.matcher()
    bitmask = allocate_bitmask(1, SYNTH_VOCAB)
    for _ in range(300):
        if m.can_terminate():
            break
        m.fill_bitmask(bitmask, 0, tokens_left=300 - m.num_tokens)
        allowed = allowed_token_ids(bitmask, 0, SYNTH_VOCAB)
        assert allowed and m.accept_token(allowed[-1])
    assert m.can_terminate()
    jsonschema.validate(json.loads(m.text()), schema)


def test_a_cap_the_schema_cannot_meet_is_dropped_and_reported(bounded_auto, synth_tok) -> None:
    schema = {"type": "string", "pattern": "^a{8}$"}  # longer than max_string_length=5
    g = bounded_auto.compile(GrammarSpec.from_json_schema(schema))
    assert g.backend == "llguidance" and not g.report.bounded
    assert "bounds" in g.report.annotations and "not applied" in str(g.report)
    assert drive(g.matcher(), synth_tok, '"aaaaaaaa"') == (True, True)
