"""A named `tool_choice` (`{"type": "function", "function": {"name": ...}}`) is answered with
exactly one call of that function, as OpenAI and vLLM answer it (older Instructor versions
assert it), even with parallel tool calls on and a model that would write several."""

from __future__ import annotations

import json

import openai

from tests.agentrt.server.test_chat import WEATHER_TOOL


def _call(call_id: str, city: str) -> dict:
    arguments = json.dumps({"city": city})
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }


# An earlier turn answered with two calls, so the 135M model writes two again when it may.
ASK = [
    {"role": "user", "content": "What is the weather in Oslo and in Lima?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [_call("c1", "Oslo"), _call("c2", "Lima")],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "Snow, -3 C"},
    {"role": "tool", "tool_call_id": "c2", "content": "Cloudy, 18 C"},
    {"role": "assistant", "content": "Oslo: snow, -3 C. Lima: cloudy, 18 C."},
    {"role": "user", "content": "What is the weather in Paris and in Rome?"},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _create(client: openai.OpenAI, model_name: str, tool_choice, **kwargs):
    return client.chat.completions.create(
        model=model_name,
        messages=ASK,
        tools=[WEATHER_TOOL],
        tool_choice=tool_choice,
        max_tokens=100,
        temperature=0,
        **kwargs,
    )


def test_named_tool_choice_is_exactly_one_call(client: openai.OpenAI, model_name: str):
    # The model writes two calls when it may (parallel tool calls are on by default) ...
    required = _create(client, model_name, "required").choices[0]
    assert [json.loads(c.function.arguments) for c in required.message.tool_calls] == [
        {"city": "Paris"},
        {"city": "Rome"},
    ]
    # ... and exactly one when the request names the function.
    choice = _create(client, model_name, NAMED).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}


def test_named_tool_choice_streams_one_call(client: openai.OpenAI, model_name: str):
    whole = _create(client, model_name, NAMED).choices[0].message.tool_calls
    chunks = list(_create(client, model_name, NAMED, stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert {d.index for d in deltas} == {0}
    assert [d.function.name for d in deltas if d.function.name] == ["get_weather"]
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(arguments) == json.loads(whole[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
