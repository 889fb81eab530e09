"""`/v1/chat/completions` through the official openai client against a real server process:
text, streaming, structured outputs (`parse`), tool calls (streamed and not), n, logprobs,
stop, usage with cached prompt tokens."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel, Field

from tests.agentrt.server.helpers import wait_idle

HELLO = [{"role": "user", "content": "Say hello to Ada."}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a timezone.",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["tz"],
        },
    },
}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)


def test_chat_text_and_stream_agree(client: openai.OpenAI, model_name: str):
    reply = client.chat.completions.create(
        model=model_name, messages=HELLO, max_tokens=12, temperature=0
    )
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.model == model_name
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens <= 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens

    chunks = list(
        client.chat.completions.create(
            model=model_name,
            messages=HELLO,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content  # greedy: the stream spells the same reply
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == choice.finish_reason and not any(finals[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == (
        reply.usage.completion_tokens
    )


def test_parse_returns_the_pydantic_model(client: openai.OpenAI, model_name: str):
    completion = client.chat.completions.parse(
        model=model_name,
        messages=[{"role": "user", "content": "Ada Lovelace is 36. Give her as JSON."}],
        response_format=Person,
        max_tokens=40,
        temperature=0,
    )
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and "Ada" in person.name  # the prompt's person, typed
    assert 0 <= person.age <= 120


def test_json_object_and_vllm_structured_outputs(client: openai.OpenAI, model_name: str):
    reply = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "A JSON object with a key 'ok'."}],
        response_format={"type": "json_object"},
        max_tokens=30,
        temperature=0,
    )
    assert reply.choices[0].finish_reason == "stop"  # the object closes within 30 tokens
    assert "ok" in json.loads(reply.choices[0].message.content)
    pick = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Pick a fruit."}],
        extra_body={"structured_outputs": {"choice": ["apple", "pear"]}},
        max_tokens=5,
        temperature=0,
    )
    assert pick.choices[0].message.content in ("apple", "pear")
    code = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "A product code."}],
        extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}},
        max_tokens=10,
        temperature=0,
    )
    text = code.choices[0].message.content
    assert len(text) == 6 and text[:2].isupper() and text[2] == "-" and text[3:].isdigit()


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_tool_calls_follow_the_declared_schema(client, model_name, tool_choice):
    reply = client.chat.completions.create(
        model=model_name,
        messages=WEATHER_ASK,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=40,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    # Under "required" the model picks the weather tool itself, as the named choice forces.
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_tool_calls_stream_as_deltas(client: openai.OpenAI, model_name: str):
    kwargs = dict(
        model=model_name,
        messages=WEATHER_ASK,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=40,
        temperature=0,
    )
    expected = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert len(deltas) >= 2  # the header, then argument fragments
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    assert all(d.index == 0 for d in deltas)
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(arguments) == json.loads(expected.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_round_trip_with_tool_results(client: openai.OpenAI, model_name: str):
    first = client.chat.completions.create(
        model=model_name,
        messages=WEATHER_ASK,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=40,
        temperature=0,
    )
    message = first.choices[0].message
    history = [
        *WEATHER_ASK,
        message,  # the client's own message object is sent back as is
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "Sunny, 21 C"},
    ]
    final = client.chat.completions.create(
        model=model_name,
        messages=history,
        tools=[WEATHER_TOOL],
        tool_choice="none",
        max_tokens=16,
        temperature=0,
    )
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_n_choices_seeds_and_stop(client: openai.OpenAI, model_name: str):
    kwargs = dict(model=model_name, messages=HELLO, max_tokens=8, temperature=1.0, seed=7)
    reply = client.chat.completions.create(**kwargs, n=2)
    assert [c.index for c in reply.choices] == [0, 1]
    again = client.chat.completions.create(**kwargs, n=2)
    # Seeded: the same request gives the same choices.
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]
    # Seeds seed, seed + 1: the choices are different samples.
    assert reply.choices[0].message.content != reply.choices[1].message.content
    assert 2 <= reply.usage.completion_tokens <= 16
    texts = ["", ""]
    for chunk in client.chat.completions.create(**kwargs, n=2, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [c.message.content for c in reply.choices]  # the streams interleave
    greedy = client.chat.completions.create(
        model=model_name, messages=HELLO, max_tokens=12, temperature=0
    ).choices[0]
    word = greedy.message.content.split()[1]
    stopped = client.chat.completions.create(
        model=model_name, messages=HELLO, max_tokens=12, temperature=0, stop=[word]
    ).choices[0]
    assert stopped.finish_reason == "stop"
    assert word not in stopped.message.content
    assert greedy.message.content.startswith(stopped.message.content)


def test_logprobs_and_top_logprobs(client: openai.OpenAI, model_name: str):
    reply = client.chat.completions.create(
        model=model_name, messages=HELLO, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # Greedy: the sampled token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
        ranked = [t.logprob for t in entry.top_logprobs]
        assert ranked == sorted(ranked, reverse=True)
    assert "".join(e.token for e in content) == reply.choices[0].message.content


def test_usage_reports_cached_tokens_on_a_repeated_prefix(client, model_name, http):
    wait_idle(http)
    system = "You answer questions about the solar system in one short sentence. " * 6
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Mars?"}]
    first = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=4, temperature=0
    )
    second = client.chat.completions.create(
        model=model_name,
        messages=[messages[0], {"role": "user", "content": "Venus?"}],
        max_tokens=4,
        temperature=0,
    )
    assert first.usage.prompt_tokens > 64
    cached = second.usage.prompt_tokens_details.cached_tokens
    # The shared system prompt is served from the prefix cache (full blocks of 16 tokens).
    assert cached >= 48 and cached % 16 == 0 and cached < second.usage.prompt_tokens


def test_max_completion_tokens_caps_the_reply(client: openai.OpenAI, model_name: str):
    reply = client.chat.completions.create(
        model=model_name, messages=HELLO, max_completion_tokens=3, temperature=0
    )
    assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"
