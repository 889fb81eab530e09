"""`POST /v1/responses` on a reasoning model through a real `agentrt serve` (a tiny random
Qwen3 whose tokenizer has `<think>` / `</think>`, fp32, greedy), driven by the `openai`
client: the reasoning as a `reasoning` item before the message, whole and streamed (the
events validated as the client's own types), `reasoning.effort` turning thinking on and off,
reasoning tokens in `usage`, a reply cut off in its reasoning; and the store's bounds set by
`agentrt serve` flags."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from agentrt.engine.loader.tokenizer import load_tokenizer
from agentrt.grammar.reasoning import detect_reasoning
from agentrt.reasoning import ReasoningRequest, count_reasoning_tokens
from tests.agentrt.server.helpers import ServerProcess

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"code": {"type": "string", "maxLength": 6}, "ok": {"const": True}},
    "required": ["code", "ok"],
    "additionalProperties": False,
}
MAX_STORED = 2
STORE_TTL_S = 3.0
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def think_server(tiny_think_checkpoint) -> Iterator[ServerProcess]:
    args = ("--model", str(tiny_think_checkpoint), "--dtype", "float32")
    args += ("--kv-cache-memory-gb", "0.02", "--grammar-timeout-s", "120")
    store = ("--max-stored-responses", str(MAX_STORED), "--stored-response-ttl", str(STORE_TTL_S))
    with ServerProcess(*args, *store) as server:
        yield server


@pytest.fixture(scope="module")
def think_client(think_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=think_server.url + "/v1", api_key="none", max_retries=0)


def _body(client: openai.OpenAI, **extra) -> dict:
    """A request that reasons (effort "high": the grammar opens the block) for at most 6
    tokens (then `</think>` is forced), then answers in SCHEMA."""
    body = dict(
        model=client.models.list().data[0].id,
        input="A code, please.",
        temperature=0,
        max_output_tokens=60,
        reasoning={"effort": "high"},
        text={"format": {"type": "json_schema", "name": "code", "schema": SCHEMA}},
        extra_body={"max_reasoning_tokens": 6},
    )
    return body | extra


def test_a_reasoning_item_comes_before_the_message(think_client: openai.OpenAI):
    response = think_client.responses.create(**_body(think_client))
    assert response.status == "completed"
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.status == "completed"
    [part] = reasoning.content
    assert part.type == "reasoning_text" and part.text and "</think>" not in part.text
    assert reasoning.summary == []
    assert message.type == "message" and json.loads(response.output_text)["ok"] is True
    assert response.usage.output_tokens_details.reasoning_tokens == 1 + 6 + 1
    assert response.reasoning.effort == "high"
    # The chat endpoint reasons the same way for the same messages (thinking on).
    chat = think_client.chat.completions.create(
        model=response.model,
        messages=[{"role": "user", "content": "A code, please."}],
        temperature=0,
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
        extra_body={"max_reasoning_tokens": 6, "chat_template_kwargs": {"enable_thinking": True}},
    )
    assert chat.choices[0].message.reasoning_content == part.text
    assert chat.choices[0].message.content == response.output_text
    assert chat.usage.completion_tokens == response.usage.output_tokens


def test_a_streamed_reasoning_item_arrives_as_the_client_parses_it(
    think_client: openai.OpenAI, think_server: ServerProcess
):
    whole = think_client.responses.create(**_body(think_client))
    with think_client.responses.stream(**_body(think_client)) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.reasoning_text.delta"]
    n = len(deltas)
    assert n >= 1
    assert types[: 4 + n + 4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.reasoning_text.delta"] * n,
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
    ]
    assert types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    reasoning_id = events[2].item.id
    assert events[2].item.type == "reasoning" and events[3].part.type == "reasoning_text"
    assert all(e.item_id == reasoning_id and e.output_index == 0 for e in deltas)
    text = "".join(e.delta for e in deltas)
    assert text == events[4 + n].text == whole.output[0].content[0].text
    assert events[4 + n + 3].output_index == 1  # the message follows the reasoning
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output_text == whole.output_text
    assert final.usage.output_tokens_details.reasoning_tokens == 1 + 6 + 1
    # The raw events are the openai package's own types.
    body = {k: v for k, v in _body(think_client).items() if k != "extra_body"}
    body |= {"max_reasoning_tokens": 6, "stream": True}
    with httpx.stream("POST", think_server.url + "/v1/responses", json=body, timeout=60) as r:
        raw = [
            EVENTS.validate_python(json.loads(line[len("data: ") :]))
            for line in r.iter_lines()
            if line.startswith("data: ")
        ]
    assert [e.type for e in raw] == types


@pytest.mark.parametrize("effort", ["none", "minimal"])
def test_effort_none_turns_thinking_off(think_client: openai.OpenAI, effort: str):
    response = think_client.responses.create(**_body(think_client, reasoning={"effort": effort}))
    [message] = response.output
    assert message.type == "message" and json.loads(response.output_text)["ok"] is True
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    # Without `reasoning` the template's default: this model opens the block itself (greedy).
    default = think_client.responses.create(**_body(think_client, reasoning=openai.omit))
    assert [item.type for item in default.output] == ["reasoning", "message"]
    assert default.usage.output_tokens_details.reasoning_tokens == 1 + 6 + 1


def test_a_reply_that_does_not_reason_counts_no_reasoning_tokens(tiny_think_checkpoint):
    tokenizer = load_tokenizer(tiny_think_checkpoint)
    may_reason = ReasoningRequest(detect_reasoning(tokenizer))  # the model opens it, or not

    def count(text: str) -> int:
        ids = tokenizer.encode(text, add_special_tokens=False)
        return count_reasoning_tokens(tokenizer, ids, may_reason)

    assert count('{"ok": true}') == 0
    assert count("<think>hmm") == len(tokenizer.encode("<think>hmm", add_special_tokens=False))
    assert count('<think>hmm</think>{"ok": true}') == count("<think>hmm") + 1


def test_a_reply_cut_off_in_its_reasoning_is_incomplete(think_client: openai.OpenAI):
    body = _body(think_client, max_output_tokens=5, extra_body={})  # no reasoning budget
    whole = think_client.responses.create(**body)
    assert whole.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens"
    [reasoning] = whole.output
    assert reasoning.type == "reasoning" and reasoning.status == "incomplete"
    assert whole.usage.output_tokens == whole.usage.output_tokens_details.reasoning_tokens == 5
    with think_client.responses.stream(**body) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete"
    [streamed] = events[-1].response.output
    assert (streamed.type, streamed.status) == ("reasoning", "incomplete")
    assert streamed.content == reasoning.content


def test_the_store_keeps_as_many_responses_as_served_and_for_as_long(
    think_client: openai.OpenAI,
):
    def ask() -> Response:
        return think_client.responses.create(
            model=think_client.models.list().data[0].id, input="Hi.", max_output_tokens=1
        )

    first, second, third = ask(), ask(), ask()
    with pytest.raises(openai.NotFoundError):  # the oldest went out past --max-stored-responses
        think_client.responses.retrieve(first.id)
    assert think_client.responses.retrieve(second.id).id == second.id
    stored_at = time.monotonic()
    assert think_client.responses.retrieve(third.id).id == third.id
    time.sleep(max(0.0, STORE_TTL_S - (time.monotonic() - stored_at)) + 0.2)
    with pytest.raises(openai.NotFoundError):  # expired past --stored-response-ttl
        think_client.responses.retrieve(third.id)


def test_reasoning_then_a_function_call_continues_without_the_reasoning(
    think_client: openai.OpenAI,
):
    """With tools the reasoning comes before the calls; the continued conversation (the
    stored one, and the same resent with the reasoning item) does not show it again."""
    weather = {
        "type": "function",
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    }
    body = _body(think_client, text=openai.omit, tools=[weather], tool_choice="required")
    body |= {"parallel_tool_calls": False, "input": "Weather in Oslo?"}
    asked = think_client.responses.create(**body)
    reasoning, call = asked.output
    assert reasoning.type == "reasoning" and call.type == "function_call"
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    with think_client.responses.stream(**body) as stream:
        final = stream.get_final_response()
    assert [(i.type, getattr(i, "arguments", None)) for i in final.output] == [
        ("reasoning", None),
        ("function_call", call.arguments),
    ]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny."}
    answer = dict(body, tool_choice="none", reasoning={"effort": "none"}, max_output_tokens=8)
    continued = think_client.responses.create(
        **answer | {"input": [output], "previous_response_id": asked.id}
    )
    resent = think_client.responses.create(
        **answer | {"input": [{"role": "user", "content": body["input"]}, *asked.output, output]}
    )
    assert continued.usage.input_tokens == resent.usage.input_tokens
    assert continued.output_text == resent.output_text
