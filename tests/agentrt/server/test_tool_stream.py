"""ToolCallStreamer: tool calls read incrementally from a constrained reply, in both styles,
whatever the split of the text into deltas."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentrt.reply import ReplyShape, read_reply
from agentrt.reply_calls import ToolCallStreamer
from agentrt.tool_calls import ReplyCalls

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


def _whole(reply: str, style: str, **shape) -> tuple[str, ReplyCalls | None]:
    """(content, calls) of the reply read whole, by the reader (no tokenizer: its text)."""
    read = read_reply(None, ReplyShape(tool_style=style, **shape), reply, ())
    return read.content, read.calls


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
    expected = CALLS[:1] if name == "json-one" else CALLS
    assert [calls[i]["name"] for i in sorted(calls)] == [c["name"] for c in expected]
    assert [json.loads(calls[i]["arguments"]) for i in sorted(calls)] == [
        c["arguments"] for c in expected
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
def test_a_reply_cut_anywhere_keeps_its_calls_and_passes_no_call_off_as_text(name):
    """max_tokens may end a reply at any character: the first call streams up to the cut,
    a later one comes whole once it closed (it may be a repeat), and nothing after the
    first call opened comes out of `finish` as content (a call cut off is not text)."""
    style, reply = REPLIES[name]
    _, full = _assemble(ToolCallStreamer(style), [reply])
    for end in range(len(reply) + 1):
        cut = reply[:end]
        streamer = ToolCallStreamer(style)
        content, calls = _assemble(streamer, list(cut))
        content += streamer.finish()
        if not streamer.is_tool_calls:  # spaces, or a part of the opening tag, so far
            assert content == cut and "<tool_call>".startswith(cut.strip()) and calls == {}
            continue
        assert content == ""
        assert all(full[i]["name"] == calls[i]["name"] for i in calls)  # none before its name
        if calls:
            first, *later = sorted(calls)
            assert full[first]["arguments"].startswith(calls[first]["arguments"])
            assert all(calls[i]["arguments"] == full[i]["arguments"] for i in later)


REPEATING = {
    "json-list": ("json", json.dumps([CALLS[0], CALLS[1], CALLS[0], CALLS[1]])[:-30]),
    "hermes": (
        "hermes",
        "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>\n" for c in [*CALLS, CALLS[0]])
        + '<tool_call>\n{"name": "get_',
    ),
}


@pytest.mark.parametrize("name", REPEATING)
@given(cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=30))
def test_a_repeated_call_ends_the_calls(name, cuts):
    """A reply that repeats its calls until max_tokens: the distinct calls stream, whole and
    in any split, nothing after the repeat does, and the reply finished its calls."""
    style, reply = REPEATING[name]
    streamer = ToolCallStreamer(style)
    content, calls = _assemble(streamer, _split(reply, cuts))
    assert content + streamer.finish() == ""
    streamed = [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)]
    assert streamed == [(c["name"], c["arguments"]) for c in CALLS]
    assert streamer.finish_reason("length") == "tool_calls"
    _, read = _whole(reply, style)
    assert [(c.name, c.arguments) for c in read.calls] == streamed and read.end == "repeat"


@pytest.mark.parametrize("name", REPEATING)
def test_a_cap_of_one_call(name):
    style, reply = REPEATING[name]
    streamer = ToolCallStreamer(style, max_calls=1)
    _, calls = _assemble(streamer, [reply])
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    _, read = _whole(reply, style, max_calls=1)
    assert [c.name for c in read.calls] == ["get_weather"] and read.end == "cap"


def test_a_list_cut_off_keeps_the_calls_it_completed():
    reply = json.dumps(CALLS)[:-20]
    content, read = _whole(reply, "json")
    assert content == "" and read.cut and [c.name for c in read.calls] == ["get_weather"]
    assert read.finish_reason("length") == "length"
