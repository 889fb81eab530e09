"""Text then `<tool_call>` blocks in spelled tags, streamed (TextThenCallsStreamer): the
content and the calls' deltas add up to what the reader reads of the whole reply, however
the text is cut into deltas."""

from __future__ import annotations

import json

import pytest

from agentrt.reply import ReplyShape, read_reply
from agentrt.reply_calls import TextThenCallsStreamer

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _stream(text: str, size: int) -> tuple[str, list[dict], bool]:
    streamer = TextThenCallsStreamer()
    content, calls = "", {}
    for start in range(0, len(text), size):
        delta, deltas = streamer.feed(text[start : start + size])
        content += delta
        for part in deltas:
            entry = calls.setdefault(part["index"], {"name": None, "arguments": ""})
            entry["name"] = part["function"].get("name") or entry["name"]
            entry["arguments"] += part["function"]["arguments"]
    content += streamer.finish()
    return content, [calls[i] for i in sorted(calls)], streamer.is_tool_calls


@pytest.mark.parametrize("size", [1, 3, 1000])
@pytest.mark.parametrize(
    "text", [CALL, "Let me check.\n" + CALL, "Sure.\n" + CALL + "\n" + CALL, "a <b> and <tool"]
)
def test_streamed_text_then_calls_match_the_whole_reply(text, size):
    content, calls, is_calls = _stream(text, size)
    whole = read_reply(None, ReplyShape(tool_style="hermes"), text, ())
    whole_content, whole_calls = whole.content, whole.calls.calls if whole.calls else None
    assert is_calls is (whole_calls is not None)
    if whole_calls is None:
        assert content == text  # plain text, held tails released at the end
        return
    assert content == whole_content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (c.name, c.arguments) for c in whole_calls
    ]
