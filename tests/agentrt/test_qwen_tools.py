"""Agents on the real Qwen2.5 tokenizer (a tiny random Qwen2 model): tool calls in the
model's own `<tool_call>` tokens, read back into calls, and no false budget steering."""

from __future__ import annotations

import dataclasses
import logging
from typing import Literal

import pytest
from pydantic import BaseModel, Field

import agentrt
from agentrt.engine.client.llm import LLM
from agentrt.formats import tools_format
from agentrt.reply import ReplyShape, read_reply
from agentrt.tool_formats import tool_call_style

OPEN_TAG = "<tool_call>"

pytestmark = pytest.mark.anyio

OPEN_ID = 151657
PRICES: list[str] = []


@agentrt.tool
def get_price(item: Literal["apple"]) -> str:
    """The price of an item, in euros."""
    PRICES.append(item)
    return "3 euros"


class Answer(BaseModel):
    currency: Literal["EUR"]
    found: Literal[True]


@pytest.fixture(scope="module")
def qwen_llm(tiny_qwen_checkpoint) -> LLM:
    return LLM(
        str(tiny_qwen_checkpoint), dtype="float32", kv_cache_memory_gb=0.02, grammar_timeout_s=120
    )


async def test_an_agent_with_an_output_model_completes(qwen_llm):
    """The first step names the tool, the second can only be final_answer (the one call of
    get_price is answered): both in `<tool_call>` tokens, parsed into calls."""
    assert tool_call_style(qwen_llm.engine.tokenizer) == "hermes_tokens"
    PRICES.clear()
    async with agentrt.Runtime(engine=qwen_llm.engine) as rt:
        agent = agentrt.Agent(
            rt, tools=[get_price], output=Answer, tool_choice="get_price", max_steps=3
        )
        result = await agent.run("What does an apple cost?")
    assert result.output == Answer(currency="EUR", found=True)
    first, second = result.steps
    assert first.text.startswith(OPEN_TAG) and [c.name for c in first.calls] == ["get_price"]
    assert PRICES == ["apple"] and first.results[0].output == "3 euros"
    assert [c.name for c in second.calls] == ["final_answer"]
    # The tool turn went back through Qwen's template as a tool response.
    assert result.messages[-2]["role"] == "tool"


async def test_auto_lets_the_model_open_a_call(qwen_llm):
    """Under "auto" the call token is one of the model's choices: a logit bias on it makes
    the random model take it, and the reply is a call, not text."""
    PRICES.clear()
    async with agentrt.Runtime(engine=qwen_llm.engine) as rt:
        agent = agentrt.Agent(
            rt, tools=[get_price], max_steps=2, max_tokens=40, logit_bias={OPEN_ID: 100.0}
        )
        result = await agent.run("What does an apple cost?")
    first = result.steps[0]
    assert first.text.startswith(OPEN_TAG) and first.calls[0].arguments == {"item": "apple"}
    assert PRICES == ["apple"]


def test_a_scripted_reply_parses_to_its_calls(qwen_llm):
    tokenizer = qwen_llm.engine.tokenizer
    text = (
        '<tool_call>\n{"name": "get_price", "arguments": {"item": "apple"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "final_answer", "arguments": {"currency": "EUR"}}\n</tool_call>'
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(OPEN_ID) == 2
    decoded = tokenizer.decode(ids, skip_special_tokens=True)  # the engine's default
    calls = read_reply(tokenizer, ReplyShape(tool_style="hermes_tokens"), decoded, ids).calls.calls
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_price", {"item": "apple"}),
        ("final_answer", {"currency": "EUR"}),
    ]
    # Under a hermes style only tagged blocks are calls: text that looks like JSON is text.
    fmt = tools_format([get_price.definition()], "auto")
    hermes = dataclasses.replace(fmt, tool_style="hermes_tokens")
    assert hermes.parse('{"name": "get_price", "arguments": {}}') == (
        '{"name": "get_price", "arguments": {}}'
    )
    assert [c.name for c in hermes.parse(decoded)] == ["get_price", "final_answer"]


class Short(BaseModel):
    code: str = Field(max_length=6)
    ok: Literal[True]


async def test_a_short_reply_is_neither_steered_nor_warned_about(qwen_llm, caplog):
    async with agentrt.Runtime(engine=qwen_llm.engine) as rt:
        session = rt.session()
        with caplog.at_level(logging.WARNING, logger="agentrt"):
            value = await session.generate("A code, please.", schema=Short, max_tokens=40)
    assert value.ok is True and session.last.finish_reason == "stop"
    assert session.last.usage.completion_tokens < 25
    assert session.last.num_steered_tokens == 0 and "steered" not in caplog.text


async def test_text_then_a_call_in_one_reply(qwen_llm):
    """Qwen writes a sentence, then its call ("Let me check.\\n<tool_call>..."): under "auto"
    the Agent gets both, the call run and the sentence kept as the turn's content. (The
    random model is pushed along: a bias makes "Hmm" its first token, and a repetition
    penalty, which also weighs the call token the prompt holds, makes the call token beat a
    second "Hmm".)"""
    hmm = qwen_llm.engine.tokenizer.encode("Hmm", add_special_tokens=False)
    PRICES.clear()
    async with agentrt.Runtime(engine=qwen_llm.engine) as rt:
        agent = agentrt.Agent(
            rt,
            tools=[get_price],
            max_steps=2,
            max_tokens=40,
            logit_bias={hmm[0]: 45.0, OPEN_ID: 60.0},
            repetition_penalty=2.0,
        )
        result = await agent.run("What does an apple cost?")
    first = result.steps[0]
    assert first.content == "Hmm" and first.text.startswith("Hmm" + OPEN_TAG)
    assert [(c.name, c.arguments) for c in first.calls] == [("get_price", {"item": "apple"})]
    assert PRICES == ["apple"]
    turn = result.messages[1]  # after the task
    assert turn["role"] == "assistant" and turn["content"] == "Hmm" and turn["tool_calls"]
