"""One turn, one reader (agentrt.turn, agentrt.reply) on the real Qwen2.5 tokenizer: the SDK
and the chat endpoint build the same prompt for the same conversation, and a reply reads the
same streamed token by token as whole, from its token ids and from its text."""

from __future__ import annotations

import dataclasses
import json

import pytest

from agentrt.engine.loader.tokenizer import load_tokenizer
from agentrt.formats import tools_format
from agentrt.grammar.reasoning import REASONING_PARSERS
from agentrt.reasoning import ReasoningRequest
from agentrt.reply import ReplyReader, ReplyShape, read_reply
from agentrt.server.chat import chat_prompt
from agentrt.server.params import chat_constraint
from agentrt.server.protocol import ChatCompletionRequest
from agentrt.server.state import ServerConfig, ServerState
from agentrt.tool_formats import tool_call_style
from agentrt.turn import ChatConstraint, prepare_turn
from tests.agentrt.server.test_repeated_calls import _Engine

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps(CALL["arguments"])},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny."},
]


@pytest.fixture(scope="module")
def qwen(qwen_tokenizer_dir):
    return load_tokenizer(qwen_tokenizer_dir)


@pytest.fixture(scope="module")
def think_qwen(qwen_tokenizer_dir):
    tokenizer = load_tokenizer(qwen_tokenizer_dir)
    tokenizer.add_tokens(["<think>", "</think>"], special_tokens=False)
    return tokenizer


def test_the_sdk_and_the_chat_endpoint_build_the_same_prompt(qwen):
    style = tool_call_style(qwen)
    fmt = dataclasses.replace(tools_format(TOOLS), tool_style=style)
    turn = prepare_turn(qwen, MESSAGES, ChatConstraint.of(fmt))
    request = ChatCompletionRequest(model="qwen", messages=MESSAGES, tools=TOOLS)
    state = ServerState(ServerConfig(served_model_name="qwen"), _Engine(qwen, ""))
    assert chat_prompt(state, request, chat_constraint(request, style)) == turn.prompt_ids
    text = qwen.decode(turn.prompt_ids)
    assert "<tools>" in text and "Sunny." in text and text.endswith("<|im_start|>assistant\n")
    assert turn.shape.tool_style == "hermes_tokens" and turn.shape.max_calls == 8


def _streamed(reader: ReplyReader, tokenizer, ids: list[int]) -> tuple[str, str, dict]:
    """(reasoning, content, calls by index) of a reply fed one token at a time."""
    reasoning, content, calls = "", "", {}
    deltas = [reader.feed(tokenizer.decode([i]), [i]) for i in ids] + [reader.finish()]
    for delta in deltas:
        reasoning += delta.reasoning
        content += delta.content
        for part in delta.calls:
            call = calls.setdefault(part["index"], {"name": None, "arguments": ""})
            call["name"] = part["function"].get("name") or call["name"]
            call["arguments"] += part["function"].get("arguments") or ""
    return reasoning, content, calls


@pytest.mark.parametrize("mode", ["token ids", "text"])
def test_a_reply_reads_the_same_streamed_and_whole(think_qwen, qwen, mode):
    """Reasoning, a sentence, then a call: from the token ids (the markers are tokens) or,
    with the tags spelled and no reasoning markers, from the text."""
    call = f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>"
    if mode == "token ids":
        tokenizer, spec, style = think_qwen, REASONING_PARSERS["qwen3"], "hermes_tokens"
        reply = "<think>It is a lookup.</think>\n\nLet me check.\n" + call
    else:
        tokenizer, spec, style = qwen, None, "hermes"
        reply = "Let me check.\n" + call
    shape = ReplyShape(ReasoningRequest(spec), style, tool_names=frozenset({"get_weather"}))
    ids = tokenizer.encode(reply, add_special_tokens=False)
    reader = ReplyReader(tokenizer, shape)
    assert (reader.splitter is not None) == (mode == "token ids")
    reasoning, content, calls = _streamed(reader, tokenizer, ids)
    whole = read_reply(tokenizer, shape, tokenizer.decode(ids), ids)
    assert (whole.reasoning or "") == reasoning
    assert reasoning == ("It is a lookup." if spec else "")
    assert content.strip() == whole.content.strip() == "Let me check."
    [read] = whole.calls.calls
    assert calls == {0: {"name": "get_weather", "arguments": json.dumps(read.arguments)}}
    assert (read.name, read.arguments) == (CALL["name"], CALL["arguments"])
    assert reader.finish_reason("stop") == whole.finish_reason("stop") == "tool_calls"


@pytest.mark.parametrize("cut", range(0, 40, 3))
def test_reasoning_read_from_text_is_the_same_in_any_split(qwen, cut):
    """Markers that are no tokens of the tokenizer: the reasoning ends at its first end
    marker (text that may still become one is held back), and the answer may spell it."""
    text = "<think>a </thi b</think>" + json.dumps({"x": "</think>"})
    shape = ReplyShape(ReasoningRequest(REASONING_PARSERS["qwen3"]))
    reader = ReplyReader(qwen, shape)
    deltas = [reader.feed(text[:cut], []), reader.feed(text[cut:], []), reader.finish()]
    assert "".join(d.reasoning for d in deltas) == "a </thi b"
    assert "".join(d.answer for d in deltas) == text[24:]
    whole = read_reply(qwen, shape, text, [])
    assert (whole.reasoning, whole.text, whole.raw_text) == ("a </thi b", text[24:], text)
