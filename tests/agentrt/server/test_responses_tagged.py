"""`POST /v1/responses` with a model whose calls are tagged in its own tokens (a tiny random
Qwen2 with the real Qwen2.5 tokenizer: `<tool_call>` is one token): function_call items,
whole and streamed, and tools with an answer format (calls or the answer)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from tests.agentrt.server.helpers import ServerProcess

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
    },
}
ANSWER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def qwen(tiny_qwen_checkpoint) -> Iterator[tuple[openai.OpenAI, str]]:
    args = ("--model", str(tiny_qwen_checkpoint), "--dtype", "float32")
    with ServerProcess(*args, "--kv-cache-memory-gb", "0.02") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        yield client, client.models.list().data[0].id


def _whole_and_streamed(client: openai.OpenAI, **body):
    whole = client.responses.create(**body)
    with client.responses.stream(**body) as stream:
        events = list(stream)
        streamed = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return whole, streamed


def test_tagged_calls_are_function_call_items(qwen):
    client, model = qwen
    body = {"model": model, "input": "Weather in Paris?", "tools": [WEATHER], "temperature": 0}
    body |= {"tool_choice": "required", "parallel_tool_calls": False, "max_output_tokens": 40}
    whole, streamed = _whole_and_streamed(client, **body)
    for response in (whole, streamed):
        [call] = response.output
        assert call.type == "function_call" and call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert streamed.output[0].arguments == whole.output[0].arguments


@pytest.mark.parametrize("question", ["Weather in Rome?", "Hello"])
def test_tools_with_a_format_are_tagged_calls_or_the_answer(qwen, question):
    """Either branch is valid (the seeded random model, greedy, takes one on each)."""
    client, model = qwen
    body = {"model": model, "input": question, "tools": [WEATHER], "temperature": 0}
    body |= {"parallel_tool_calls": False, "max_output_tokens": 40}
    body["text"] = {"format": {"type": "json_schema", "name": "weather", "schema": ANSWER}}
    whole, streamed = _whole_and_streamed(client, **body)
    [item] = whole.output
    if item.type == "function_call":
        jsonschema.validate(json.loads(item.arguments), WEATHER["parameters"])
    else:
        jsonschema.validate(json.loads(whole.output_text), ANSWER)
    assert [i.type for i in streamed.output] == [item.type]
    assert streamed.output_text == whole.output_text
