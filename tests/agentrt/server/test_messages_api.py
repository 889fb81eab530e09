"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) driven by the
official `anthropic` client against a real `agentrt serve` on the embedded model: whole and
streamed replies, a tool round trip, a forced tool, stop sequences, token counts, and errors
in Anthropic's shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from agentrt.server.state import ServerConfig, ServerState
from tests.agentrt.server.helpers import API_KEY, ServerProcess

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
    },
}
TIME = {
    "name": "get_time",
    "description": "The local time in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def claude(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)


def test_a_whole_message(claude: anthropic.Anthropic):
    message = claude.messages.create(
        model=MODEL,
        max_tokens=20,
        system="You are a helpful assistant.",
        messages=[{"role": "user", "content": "Say hello."}],
        extra_body={"temperature": 0},
    )
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text.strip()
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    assert message.usage.output_tokens > 0 and message.usage.output_tokens <= 20
    # The prompt's tokens: those computed plus those read from the prefix cache.
    cached = message.usage.cache_read_input_tokens or 0
    counted = claude.messages.count_tokens(
        model=MODEL,
        system="You are a helpful assistant.",
        messages=[{"role": "user", "content": "Say hello."}],
    )
    assert message.usage.input_tokens + cached == counted.input_tokens > 10


def test_max_tokens_is_the_stop_reason_when_it_cuts_the_reply(claude: anthropic.Anthropic):
    message = claude.messages.create(
        model=MODEL,
        max_tokens=3,
        messages=[{"role": "user", "content": "Write a long story about a dragon."}],
        extra_body={"temperature": 0},
    )
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3


def test_a_streamed_message_is_the_whole_one(claude: anthropic.Anthropic):
    kwargs = {
        "model": MODEL,
        "max_tokens": 30,
        "messages": [{"role": "user", "content": "Name three colors."}],
        "extra_body": {"temperature": 0},
    }
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        events = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "content_block_stop" in events
    assert events.index("message_delta") < events.index("message_stop")
    assert streamed.content[0].text == whole.content[0].text
    assert streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens


def test_the_raw_stream_has_anthropic_event_lines(server: ServerProcess):
    body = {
        "model": MODEL,
        "max_tokens": 5,
        "stream": True,
        "messages": [{"role": "user", "content": "Hi"}],
    }
    headers = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
    response = httpx.post(server.url + "/v1/messages", json=body, headers=headers, timeout=60)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    names = [line[len("event: ") :] for line in response.text.splitlines() if line[:6] == "event:"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names[1:4] == ["content_block_start", "content_block_delta", "content_block_delta"]


def test_a_tool_round_trip(claude: anthropic.Anthropic):
    first = claude.messages.create(
        model=MODEL,
        max_tokens=60,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "any"},
        extra_body={"temperature": 0},
    )
    assert first.stop_reason == "tool_use"
    calls = [block for block in first.content if block.type == "tool_use"]
    assert calls and calls[0].name == "get_weather" and calls[0].id.startswith("toolu_")
    assert set(calls[0].input) == {"city"} and isinstance(calls[0].input["city"], str)
    results = [
        {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"} for call in calls
    ]
    second = claude.messages.create(
        model=MODEL,
        max_tokens=40,
        messages=[
            *ASK,
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": results},
        ],
        tools=[WEATHER],
        tool_choice={"type": "none"},
        extra_body={"temperature": 0},
    )
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert [block.type for block in second.content] == ["text"]
    # The result went into the prompt: the conversation counts more tokens than the question.
    asked = claude.messages.count_tokens(model=MODEL, messages=ASK, tools=[WEATHER])
    assert second.usage.input_tokens + (second.usage.cache_read_input_tokens or 0) > (
        asked.input_tokens
    )


def test_a_forced_tool_is_called_and_streams_as_input_json(claude: anthropic.Anthropic):
    kwargs = {
        "model": MODEL,
        "max_tokens": 60,
        "messages": ASK,
        "tools": [WEATHER, TIME],
        "tool_choice": {"type": "tool", "name": "get_time"},
        "extra_body": {"temperature": 0},
    }
    message = claude.messages.create(**kwargs)
    assert message.stop_reason == "tool_use"
    assert [(b.type, b.name) for b in message.content] == [("tool_use", "get_time")]
    assert set(message.content[0].input) == {"city"}
    with claude.messages.stream(**kwargs) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert deltas and set(deltas) == {"input_json_delta"}
    assert [(b.type, b.name, b.input) for b in streamed.content] == [
        ("tool_use", "get_time", message.content[0].input)
    ]
    assert streamed.stop_reason == "tool_use"


def test_a_tool_result_error_and_text_blocks_are_read(claude: anthropic.Anthropic):
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
    result = {
        "type": "tool_result",
        "tool_use_id": "toolu_1",
        "is_error": True,
        "content": [{"type": "text", "text": "the weather service is down"}],
    }
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
        {"role": "assistant", "content": [use]},
        {"role": "user", "content": [result]},
    ]
    plain = [*messages[:2], {"role": "user", "content": [{**result, "is_error": False}]}]
    counted = claude.messages.count_tokens(model=MODEL, messages=messages, tools=[WEATHER])
    without_error = claude.messages.count_tokens(model=MODEL, messages=plain, tools=[WEATHER])
    assert counted.input_tokens > without_error.input_tokens  # the error is marked


def test_stop_sequences(claude: anthropic.Anthropic):
    kwargs = {
        "model": MODEL,
        "max_tokens": 40,
        "messages": [{"role": "user", "content": "Count from 1 to 10, separated by commas."}],
        "extra_body": {"temperature": 0},
    }
    free = claude.messages.create(**kwargs).content[0].text
    assert "5" in free
    message = claude.messages.create(**kwargs, stop_sequences=["5"])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "5"
    assert message.content[0].text == free[: free.index("5")]
    with claude.messages.stream(**kwargs, stop_sequences=["5"]) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "stop_sequence" and streamed.stop_sequence == "5"


def test_a_wrong_key_is_an_authentication_error(server: ServerProcess):
    wrong = anthropic.Anthropic(base_url=server.url, api_key="not-the-key", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        wrong.messages.create(model=MODEL, max_tokens=5, messages=ASK)
    body = info.value.body
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    # OpenAI's routes keep OpenAI's shape.
    response = httpx.get(server.url + "/v1/models", headers={"x-api-key": "nope"})
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


def test_bad_requests_are_in_anthropic_shape(claude: anthropic.Anthropic):
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model=MODEL, max_tokens=0, messages=ASK)
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in info.value.body["error"]["message"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(
            model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [image]}]
        )
    assert "'image'" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(
            model=MODEL,
            max_tokens=5,
            messages=ASK,
            tools=[WEATHER],
            tool_choice={"type": "tool", "name": "no_such_tool"},
        )
    assert info.value.body["type"] == "error"
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.messages.create(model="claude-opus", max_tokens=5, messages=ASK)
    assert info.value.body["error"]["type"] == "not_found_error"


def test_a_raw_missing_max_tokens_is_a_400(server: ServerProcess):
    headers = {"x-api-key": API_KEY}
    body = {"model": MODEL, "messages": ASK}
    response = httpx.post(server.url + "/v1/messages", json=body, headers=headers)
    assert response.status_code == 400
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in error["error"]["message"]


def test_output_config_format_is_enforced(claude: anthropic.Anthropic):
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["teal"]}, "count": {"type": "integer", "minimum": 7}},
        "required": ["color", "count"],
        "additionalProperties": False,
    }
    message = claude.messages.create(
        model=MODEL,
        max_tokens=40,
        messages=[{"role": "user", "content": "Name a color and a number as JSON."}],
        # In extra_body: older clients have no output_config argument.
        extra_body={
            "temperature": 0,
            "output_config": {"format": {"type": "json_schema", "schema": schema}},
        },
    )
    value = json.loads(message.content[0].text)
    assert value["color"] == "teal" and value["count"] >= 7 and message.stop_reason == "end_turn"


def test_hostile_requests_are_refused_in_anthropic_shape(server: ServerProcess):
    headers = {"x-api-key": API_KEY}
    url = server.url + "/v1/messages"
    too_many = {"model": MODEL, "max_tokens": 5, "messages": ASK * 5000}
    response = httpx.post(url, json=too_many, headers=headers, timeout=60)
    assert response.status_code == 400, response.text
    assert "at most 4096" in response.json()["error"]["message"]
    huge = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "a" * 2**20}]}
    response = httpx.post(url, json=huge, headers=headers, timeout=60)
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "request_too_large"
    # Client-side tools only: a server tool type is refused by name.
    bash = {"model": MODEL, "max_tokens": 5, "messages": ASK, "tools": [{"type": "bash_1"}]}
    bash["tools"][0]["name"] = "bash"
    response = httpx.post(url, json=bash, headers=headers, timeout=60)
    assert response.status_code == 400 and "'bash_1'" in response.json()["error"]["message"]


def test_the_x_api_key_is_the_tenant_as_the_bearer_key_is():
    state = ServerState(ServerConfig(cache_isolation="key"), engine=None)
    bearer = state.cache_salt(None, None, {"authorization": "Bearer key-of-alice"})
    x_api_key = state.cache_salt(None, None, {"x-api-key": "key-of-alice"})
    bob = state.cache_salt(None, None, {"x-api-key": "key-of-bob"})
    nobody = state.cache_salt(None, None, {})
    assert bearer == x_api_key and len({x_api_key, bob, nobody}) == 3
