"""Replies read from their token ids (agentrt.reply_tokens) with the real Qwen2.5 tokenizer,
plus Qwen3's `<think>` / `</think>`: the markers are their ids, so the tag's characters
written as ordinary tokens are text, and a decoder that skips special tags loses no call."""

from __future__ import annotations

import pytest

from agentrt.engine.loader.tokenizer import load_tokenizer
from agentrt.grammar.reasoning import REASONING_PARSERS
from agentrt.reply import ReplyShape, read_reply
from agentrt.reply_tokens import CALL, CONTENT, REASONING, ReplySplitter, reply_markers

OPEN_ID, CLOSE_ID = 151657, 151658
CALL_JSON = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
WEATHER = f"<tool_call>\n{CALL_JSON}\n</tool_call>"
QWEN3 = REASONING_PARSERS["qwen3"]


@pytest.fixture(scope="module")
def think_tok(qwen_tokenizer_dir):
    tokenizer = load_tokenizer(qwen_tokenizer_dir)
    tokenizer.add_tokens(["<think>", "</think>"], special_tokens=False)
    return tokenizer


def split_reply(tokenizer, markers, token_ids: list[int], **options) -> ReplySplitter:
    """A finished reply read whole: fed at once, then finished."""
    splitter = ReplySplitter(tokenizer, markers, **options)
    splitter.feed(token_ids)
    splitter.finish()
    return splitter


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _spelled(tokenizer, text: str) -> list[int]:
    """`text` in ordinary tokens only: each tag token spelled `<` / `</` + `tool_call>`."""
    ids = []
    for token_id in _ids(tokenizer, text):
        if token_id in (OPEN_ID, CLOSE_ID):
            ids += _ids(tokenizer, "<" if token_id == OPEN_ID else "</")
            ids += _ids(tokenizer, "tool_call>")
        else:
            ids.append(token_id)
    return ids


def test_markers_are_read_only_where_every_one_is_a_token(think_tok, qwen_tokenizer_dir):
    markers = reply_markers(think_tok, QWEN3, "hermes_tokens")
    assert (markers.call_open, markers.call_close) == (OPEN_ID, CLOSE_ID)
    assert think_tok.convert_ids_to_tokens([markers.think_start, markers.think_end]) == [
        "<think>",
        "</think>",
    ]
    assert reply_markers(think_tok, None, "hermes") is None  # spelled tags: read the text
    plain = load_tokenizer(qwen_tokenizer_dir)  # no <think> token: the reasoning is text
    assert reply_markers(plain, QWEN3, "hermes_tokens") is None
    assert reply_markers(plain, None, "hermes_tokens").think_end is None


def test_the_tag_spelled_in_ordinary_tokens_is_text(think_tok):
    """The same characters as a call, but in ordinary tokens: the text reader takes them
    for a call, the token reader sees content."""
    ids = _spelled(think_tok, WEATHER)
    assert OPEN_ID not in ids and think_tok.decode(ids) == WEATHER
    as_text = read_reply(None, ReplyShape(tool_style="hermes_tokens"), think_tok.decode(ids), ())
    assert [c.name for c in as_text.calls.calls] == ["get_weather"]
    reply = split_reply(think_tok, reply_markers(think_tok, None, "hermes_tokens"), ids)
    assert reply.calls == [] and reply.content == WEATHER == reply.text


def test_special_tags_that_the_decoder_skips_are_not_lost(qwen_tokenizer_dir):
    tokenizer = load_tokenizer(qwen_tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    ids = _ids(tokenizer, "Sure.\n" + WEATHER)
    decoded = tokenizer.decode(ids, skip_special_tokens=True)  # the engine's default
    as_text = read_reply(None, ReplyShape(tool_style="hermes_tokens"), decoded, ())
    assert "<tool_call>" not in decoded and as_text.calls is None
    markers = reply_markers(tokenizer, None, "hermes_tokens")
    reply = split_reply(tokenizer, markers, ids, skip_special_tokens=True)
    assert reply.calls == [CALL_JSON] and reply.content == "Sure."
    assert reply.text == reply.raw_text == "Sure.\n" + WEATHER  # the tags spelled back


def test_streamed_pieces_add_up_to_the_whole_reply(think_tok):
    """Reasoning (which mentions a tag), a sentence, then two calls, fed one token at a time:
    each kind's pieces concatenate to the whole reply's part; the newlines before and
    between the calls are no content."""
    markers = reply_markers(think_tok, QWEN3, "hermes_tokens")
    text = "<think>\nI write <tool_call> when I call.\n</think>\n\nLet me check.\n"
    ids = _ids(think_tok, text + WEATHER + "\n" + WEATHER)
    splitter = ReplySplitter(think_tok, markers)
    pieces = [p for token_id in ids for p in splitter.feed([token_id])] + splitter.finish()
    whole = split_reply(think_tok, markers, ids)
    assert whole.reasoning == "\nI write <tool_call> when I call.\n"
    assert whole.content == "\n\nLet me check." and whole.calls == [CALL_JSON, CALL_JSON]
    assert whole.num_reasoning_tokens == ids.index(markers.think_end) + 1
    assert whole.raw_text == think_tok.decode(ids)  # what the model wrote, markers and all
    joined = {
        kind: "".join(p.text for p in pieces if p.kind == kind) for kind in (REASONING, CONTENT)
    }
    assert joined == {REASONING: whole.reasoning, CONTENT: whole.content}
    assert "".join(p.text for p in pieces if p.kind == CALL) == WEATHER + WEATHER
    assert {p.index for p in pieces if p.kind == CALL} == {0, 1}


def test_an_opened_block_a_cut_call_and_a_stop_string(think_tok):
    markers = reply_markers(think_tok, QWEN3, "hermes_tokens")
    # The template opened the block (DeepSeek-R1 style): the reply starts inside it.
    opened = split_reply(think_tok, markers, _ids(think_tok, "hmm</think>Done."), opened=True)
    assert (opened.reasoning, opened.content, opened.num_reasoning_tokens) == ("hmm", "Done.", 3)
    assert opened.raw_text == "hmm</think>Done."
    # max_tokens cut the call: what it wrote is the last call's text, unclosed.
    cut = split_reply(think_tok, markers, _ids(think_tok, WEATHER)[:5])
    assert cut.calls == ['{"name":'] and cut.reasoning is None
    # A stop string ends the content where the engine's detokenizer ends it.
    stopped = split_reply(think_tok, markers, _ids(think_tok, "one. STOP two"), stop=["STOP"])
    assert stopped.content == "one. "
