"""The store behind `previous_response_id` (bounded in count, age and bytes, oldest out
first), and how a reply that is calls or an answer streams (`ReplyKind`,
`CallsOrAnswerStreamer`)."""

from __future__ import annotations

import json
import time

import pytest

from agentrt.reply_calls import CallsOrAnswerStreamer, ReplyKind
from agentrt.server.response_store import ResponseStore


def _messages(n: int, text: str = "hello") -> list[dict]:
    return [{"role": "user", "content": f"{text} {i}"} for i in range(n)]


def test_the_oldest_response_goes_first_past_the_count():
    store = ResponseStore(max_responses=2)
    for name in ("a", "b", "c"):
        store.put(name, {"id": name}, _messages(1))
    assert store.get("a") is None and len(store) == 2
    assert store.get("b").body == {"id": "b"} and store.get("c") is not None


def test_responses_expire_with_age():
    store = ResponseStore(max_age_s=0.05)
    store.put("a", {"id": "a"}, _messages(1))
    assert store.get("a") is not None
    time.sleep(0.1)
    assert store.get("a") is None and len(store) == 0 and store.num_bytes == 0


def test_the_byte_budget_counts_whole_conversations():
    one = len(json.dumps({"id": "x"})) + sum(len(json.dumps(m)) for m in _messages(10))
    store = ResponseStore(max_bytes=2 * one + one // 2)
    store.put("a", {"id": "a"}, _messages(10))
    store.put("b", {"id": "b"}, _messages(10))
    assert store.num_bytes == 2 * one
    store.put("c", {"id": "c"}, _messages(10))
    assert store.get("a") is None and store.num_bytes == 2 * one
    store.put("huge", {"id": "huge"}, _messages(100))  # over the whole budget: not kept
    assert store.get("huge") is None and store.get("b") is not None


def test_a_continued_conversation_shares_and_counts_its_history():
    store = ResponseStore()
    first = _messages(3)
    store.put("a", {"id": "a"}, first)
    parent = store.get("a")
    longer = [*parent.conversation, *_messages(2, "more")]
    store.put("b", {"id": "b"}, longer, continues=parent)
    child = store.get("b")
    assert child.conversation[0] is parent.conversation[0]  # shared, not copied
    assert child.conversation_bytes == sum(len(json.dumps(m)) for m in longer)
    assert store.delete("a") and not store.delete("a")
    assert store.get("b").conversation == tuple(longer)  # a child outlives its parent


@pytest.mark.parametrize(
    ("style", "text", "kind"),
    [
        ("json", '{"name": "get_weather", "arguments": {"city": "Oslo"}}', "calls"),
        ("json", '[{"name": "get_weather", "arguments": {}}]', "calls"),
        ("json", '{"name": "John \\"Jack\\" Smith", "age": 42}', "answer"),
        ("json", '{"city": "Oslo"}', "answer"),
        ("json", '  {"na', None),
        ("hermes", '<tool_call>\n{"name": "get_weather"', "calls"),
        ("hermes", '{"name": "get_weather"}', "answer"),
    ],
)
def test_reply_kind_tells_calls_from_the_answer_as_soon_as_it_can(style, text, kind):
    reply = ReplyKind(style, {"get_weather"})
    decided = [reply.feed(ch) for ch in text]
    assert decided[-1] == kind
    if kind is not None:  # undecided until the text tells, then decided
        first = decided.index(kind)
        assert set(decided[:first]) <= {None} and set(decided[first:]) == {kind}
    assert reply.finish() == (kind or "answer")


@pytest.mark.parametrize(
    ("text", "is_calls"),
    [
        ('{"name": "Ada", "age": 36}', False),
        ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', True),
    ],
)
def test_calls_or_an_answer_stream_as_content_or_call_deltas(text, is_calls):
    streamer = CallsOrAnswerStreamer("json", {"get_weather"})
    content, deltas = "", []
    for ch in text:
        more, calls = streamer.feed(ch)
        content += more
        deltas += calls
    content += streamer.finish()
    assert streamer.is_tool_calls == is_calls
    if is_calls:
        assert content == "" and deltas[0]["function"]["name"] == "get_weather"
        arguments = "".join(d["function"]["arguments"] for d in deltas)
        assert json.loads(arguments) == {"city": "Oslo"}
    else:
        assert content == text and deltas == []


def test_a_reply_cut_before_it_tells_is_released_as_the_answer():
    streamer = CallsOrAnswerStreamer("json", {"get_weather"})
    assert streamer.feed('{"na') == ("", [])
    assert streamer.finish() == '{"na' and not streamer.is_tool_calls
