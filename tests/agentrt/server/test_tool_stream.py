"""ToolCallStreamer: tool calls read incrementally from a constrained reply, in both styles,
whatever the split of the text into deltas."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentrt.server.tool_stream import ToolCallStreamer
from agentrt.tool_calls import parse_tool_calls

CALLS = [
    {"name": "get_weather", "arguments": {"city": "Paris", "note": 'a "quoted" }{ brace'}},
    {"name": "get_time", "arguments": {"tz": "CET", "nested": {"a": [1, {"b": None}]}}},
]


def _assemble(streamer: ToolCallStreamer, pieces: list[str]) -> tuple[str, dict[int, dict]]:
    content, calls = "", {}
    for piece in pieces:
        text, deltas = streamer.feed(piece)
        content += text
        for delta in deltas:
            call = calls.setdefault(delta["index"], {"name": None, "arguments": "", "id": None})
            if "id" in delta:
                assert call["id"] is None, "the header comes once"
                call["id"], call["name"] = delta["id"], delta["function"]["name"]
            else:
                assert call["id"] is not None, "arguments come after the header"
            call["arguments"] += delta["function"]["arguments"]
    return content, calls


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


REPLIES = {
    "json-one": ("json", json.dumps(CALLS[0])),
    "json-list": ("json", " " + json.dumps(CALLS, indent=1)),
    "hermes": (
        "hermes",
        "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>\n" for c in CALLS),
    ),
}


@pytest.mark.parametrize("name", REPLIES)
@given(cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=30))
def test_deltas_assemble_to_the_calls(name, cuts):
    style, reply = REPLIES[name]
    streamer = ToolCallStreamer(style)
    content, calls = _assemble(streamer, _split(reply, cuts))
    assert content == "" and streamer.is_tool_calls
    expected = parse_tool_calls(reply)
    assert [calls[i]["name"] for i in sorted(calls)] == [c.name for c in expected]
    assert [json.loads(calls[i]["arguments"]) for i in sorted(calls)] == [
        c.arguments for c in expected
    ]
    assert len({c["id"] for c in calls.values()}) == len(calls)


@pytest.mark.parametrize(("style", "reply"), [("json", "Sure! <b>"), ("hermes", "It is {sunny}.")])
def test_plain_text_replies_stream_as_content(style, reply):
    streamer = ToolCallStreamer(style)
    content, calls = _assemble(streamer, [" ", reply[:3], reply[3:]])
    assert content == " " + reply and calls == {} and not streamer.is_tool_calls


@pytest.mark.parametrize("text", ["<b>bold</b> text", "<tool", "  <tool_c", '{"a": 1}', " "])
@given(cuts=st.lists(st.integers(min_value=0, max_value=20), max_size=8))
def test_hermes_text_may_start_with_a_bracket(text, cuts):
    """Under a hermes style, text that is not the `<tool_call>` tag is content, whatever the
    split: held while it could still become the tag, released at the end."""
    streamer = ToolCallStreamer("hermes_tokens")
    content, calls = _assemble(streamer, _split(text, cuts))
    assert calls == {}
    assert content + streamer.finish() == text and not streamer.is_tool_calls


@pytest.mark.parametrize("name", REPLIES)
def test_a_reply_cut_anywhere_loses_nothing(name):
    """max_tokens may end a reply at any character: the calls announced so far keep their
    arguments' text up to the cut, and what no delta carried comes out of `finish` as
    content (all of it when no call was announced yet, else a last call cut before its
    name)."""
    style, reply = REPLIES[name]
    _, full = _assemble(ToolCallStreamer(style), [reply])
    for end in range(len(reply) + 1):
        cut = reply[:end]
        streamer = ToolCallStreamer(style)
        content, calls = _assemble(streamer, list(cut))
        content += streamer.finish()
        if not calls:
            assert content == cut and not streamer.is_tool_calls
            continue
        assert streamer.is_tool_calls
        *done, last = sorted(calls)
        assert all(calls[i]["arguments"] == full[i]["arguments"] for i in done)
        arguments = calls[last]["arguments"]
        assert full[last]["arguments"].startswith(arguments)
        if arguments != full[last]["arguments"]:  # cut in them: up to the cut
            assert cut.endswith(arguments) and content == ""
        if content:  # a next call, cut before its name
            assert cut.endswith(content) and content.startswith("{")
            assert len(calls) < len(full)
