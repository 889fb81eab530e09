"""Tool calls through a real `agentrt serve` on a tiny random Qwen2 model with the real
Qwen2.5 tokenizer, driven by the official `openai` client: the model's `<tool_call>` tokens
come back as `tool_calls`, whole and streamed, for every tool_choice."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

import agentrt
from tests.agentrt.server.helpers import ServerProcess

pytestmark = pytest.mark.slow

OPEN_ID = 151657
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris"]}},
                "required": ["city"],
            },
        },
    }
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def qwen_server(tiny_qwen_checkpoint) -> Iterator[ServerProcess]:
    args = ("--model", str(tiny_qwen_checkpoint), "--dtype", "float32")
    with ServerProcess(
        *args, "--kv-cache-memory-gb", "0.02", "--grammar-timeout-s", "120"
    ) as server:
        yield server


@pytest.fixture(scope="module")
def qwen_client(qwen_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=qwen_server.url + "/v1", api_key="none", max_retries=0)


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("tool_choice", ["auto", "required", NAMED])
def test_tool_calls_whole_and_streamed(qwen_client, tool_choice):
    options = dict(
        model=qwen_client.models.list().data[0].id,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=tool_choice,
        temperature=0,
        max_tokens=48,
        parallel_tool_calls=False,
        logit_bias={str(OPEN_ID): 100},  # under "auto", the random model takes the call
    )
    whole = qwen_client.chat.completions.create(**options)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in qwen_client.chat.completions.create(**options, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
        for part in delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"name": None, "arguments": ""})
            if part.function.name:
                entry["name"] = part.function.name
            entry["arguments"] += part.function.arguments or ""
    assert content == "" and finish == "tool_calls"
    assert calls == {0: {"name": "get_weather", "arguments": call.function.arguments}}


def test_auto_without_a_push_may_answer_in_text(qwen_client):
    """Under "auto" with no bias, text is one choice: whatever the random model writes, the
    reply is either a parsed call or content, never a refused request."""
    reply = qwen_client.chat.completions.create(
        model=qwen_client.models.list().data[0].id,
        messages=MESSAGES,
        tools=TOOLS,
        temperature=0,
        max_tokens=12,
        logit_bias={str(OPEN_ID): -100},
    )
    choice = reply.choices[0]
    assert choice.message.tool_calls is None and choice.message.content


def test_text_then_a_call_whole_and_streamed(qwen_client):
    """A reply that writes a sentence and then calls: `content` and `tool_calls` both, whole
    and streamed. (A bias makes "Hmm" the random model's first token; a repetition penalty,
    which also weighs the call token the prompt holds, makes the call token beat a second.)"""
    hmm = 80022  # "Hmm" in Qwen2.5's vocabulary, in no prompt here
    options = dict(
        model=qwen_client.models.list().data[0].id,
        messages=MESSAGES,
        tools=TOOLS,
        temperature=0,
        max_tokens=48,
        parallel_tool_calls=False,
        logit_bias={str(hmm): 45, str(OPEN_ID): 60},
        extra_body={"repetition_penalty": 2.0},
    )
    whole = qwen_client.chat.completions.create(**options)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Hmm"
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    content, arguments, names, finish = "", "", [], None
    for chunk in qwen_client.chat.completions.create(**options, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
        for part in delta.tool_calls or []:
            names += [part.function.name] if part.function.name else []
            arguments += part.function.arguments or ""
    assert (content, names, arguments, finish) == (
        "Hmm",
        ["get_weather"],
        call.function.arguments,
        "tool_calls",
    )


@pytest.mark.anyio
async def test_a_remote_agent_gets_the_text_and_the_call(qwen_server):
    """The SDK pointed at the server: the step keeps the sentence as its content and runs the
    call, as with the local backend (tests/agentrt/test_qwen_tools.py)."""
    seen = []

    @agentrt.tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return "sunny"

    async with agentrt.Runtime(base_url=qwen_server.url + "/v1", api_key="none") as rt:
        agent = agentrt.Agent(
            rt,
            tools=[get_weather],
            max_steps=2,
            max_tokens=48,
            logit_bias={80022: 45.0, OPEN_ID: 60.0},  # "Hmm", then the call (see above)
            repetition_penalty=2.0,
        )
        result = await agent.run("What is the weather in Paris?")
    first = result.steps[0]
    assert first.content == "Hmm" and [c.name for c in first.calls] == ["get_weather"]
    assert seen == [first.calls[0].arguments["city"]]
    assert result.messages[1]["content"] == "Hmm" and result.messages[1]["tool_calls"]
