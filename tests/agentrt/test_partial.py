"""completed_members: the members of an unfinished JSON object or array whose values can no
longer change, so every partial a stream shows is a prefix of the final value."""

from __future__ import annotations

import json

import pytest

from agentrt.partial import completed_members


@pytest.mark.parametrize("text", ["", "   ", "4", "42", '"a string"', "true", "nul"])
def test_nothing_started_or_a_scalar_has_no_members(text):
    assert completed_members(text) is None


@pytest.mark.parametrize(
    ("text", "members"),
    [
        ("{", {}),
        ('{"a"', {}),
        ('{"a": ', {}),
        ('{"a": 1', {}),  # more digits could follow
        ('{"a": 1 ', {"a": 1}),
        ('{"a": 12,', {"a": 12}),
        ('{"a": -1.5e3}', {"a": -1500.0}),
        ('{"a": true', {"a": True}),  # a literal cannot grow
        ('{"a": nul', {}),
        ('{"a": "x', {}),
        ('{"a": "x\\"y", "b"', {"a": 'x"y'}),
        ('{"a": [1, 2], "b": {"c"', {"a": [1, 2]}),
        ('{"a": {"b": [1, {"c": null}]}, "d": [', {"a": {"b": [1, {"c": None}]}}),
        ('\n {\n  "a" :\t"b" ,\n  "c": "d"}', {"a": "b", "c": "d"}),
        ("[", []),
        ("[1, 2, 3", [1, 2]),
        ("[1, 3.", [1]),  # regression: "3." was read as a complete 3 (final 3.25)
        ('{"a": 2e', {}),
        ('{"a": -', {}),
        ('[{"a": 1}, {"b"', [{"a": 1}]),
        ('["x", ["y"], ', ["x", ["y"]]),
        ("[1, 2, 3]", [1, 2, 3]),
    ],
)
def test_members_whose_values_are_complete(text, members):
    assert completed_members(text) == members


@pytest.mark.parametrize(
    "value",
    [
        {"name": 'Ann \u00e9 "quoted"', "age": 31, "tags": ["a", "b"], "ok": False},
        {"nested": {"deep": [1, 2.5, {"x": None}]}, "n": -7, "s": "}]{["},
        [{"id": 1, "v": "one"}, {"id": 22, "v": "two"}, 3.25, "end"],
    ],
)
def test_every_prefix_shows_a_prefix_of_the_final_value(value):
    for text in (json.dumps(value), json.dumps(value, indent=2)):
        shown = 0
        for end in range(len(text) + 1):
            members = completed_members(text[:end])
            if members is None:
                assert text[:end].strip() == ""
                continue
            if isinstance(value, dict):
                assert all(value[k] == v for k, v in members.items())
                assert list(members) == list(value)[: len(members)]
            else:
                assert members == value[: len(members)]
            assert len(members) >= shown  # members never disappear as text grows
            shown = len(members)
        assert completed_members(text) == value
