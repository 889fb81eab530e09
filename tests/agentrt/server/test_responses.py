"""`POST /v1/responses` on a real `agentrt serve` (the embedded SmolLM2, greedy), driven
by the official `openai` client: plain and streamed responses (events in the order the
client's stream parser expects), `responses.parse` to a typed object, function tools,
`previous_response_id` on the prefix cache, GET / DELETE, and OpenAI-shaped errors. Bodies
and events are validated against the `openai` package's own Responses types."""

from __future__ import annotations

import json
import time
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from tests.agentrt.server.helpers import metrics, wait_idle

MODEL = "SmolLM2-135M-Instruct"
BLOCK_SIZE = 16  # the server's KV block size (the default): the prefix cache's unit
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
EVENTS = TypeAdapter(ResponseStreamEvent)


class Person(BaseModel):
    name: str
    age: int
    mood: Literal["happy", "sad"]


def _ask(client: openai.OpenAI, **kwargs) -> Response:
    kwargs = {"model": MODEL, "temperature": 0, "max_output_tokens": 16, **kwargs}
    return client.responses.create(**kwargs)


def _raw_events(http: httpx.Client, body: dict) -> list:
    """The SSE events of a streamed response, each validated as the typed event its
    `event:` line names."""
    events = []
    with http.stream("POST", "/v1/responses", json={"model": MODEL, **body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                event = EVENTS.validate_python(json.loads(line[len("data: ") :]))
                assert event.type == name
                events.append(event)
    return events


def test_a_plain_response_is_the_chat_reply_to_the_same_messages(
    client: openai.OpenAI, http: httpx.Client
):
    system, user = "You answer in one short sentence.", "What is the capital of France?"
    body = {"model": MODEL, "input": user, "instructions": system, "temperature": 0}
    raw = http.post("/v1/responses", json={**body, "max_output_tokens": 12})
    assert raw.status_code == 200, raw.text
    response = Response.model_validate(raw.json())
    assert response.status in ("completed", "incomplete") and response.object == "response"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        max_tokens=12,
        temperature=0,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.instructions == system and response.model == MODEL


def test_a_streamed_response_arrives_as_the_client_parses_it(
    client: openai.OpenAI, http: httpx.Client
):
    kwargs = {"input": "Name three colors.", "max_output_tokens": 10}
    plain = _ask(client, **kwargs)
    with client.responses.stream(model=MODEL, temperature=0, **kwargs) as stream:
        events = list(stream)
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert types[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    final = "response.completed" if plain.status == "completed" else "response.incomplete"
    assert types[4 + len(deltas) :] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        final,
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in deltas)
    text = "".join(e.delta for e in deltas)
    assert text == plain.output_text  # greedy: the same reply, streamed
    assert events[-1].response.output[0].id == item_id
    assert events[-1].response.output_text == text
    assert client.responses.retrieve(events[-1].response.id).output_text == text  # stored
    raw = _raw_events(http, {"temperature": 0, **kwargs})
    assert [e.type for e in raw] == types


def test_parse_returns_a_typed_object(client: openai.OpenAI):
    parsed = client.responses.parse(
        model=MODEL,
        instructions="Extract the person as JSON.",
        input="John Smith is 42 and feels happy today.",
        text_format=Person,
        temperature=0,
        max_output_tokens=40,
    )
    assert parsed.status == "completed"
    assert isinstance(parsed.output_parsed, Person)
    assert parsed.text.format.type == "json_schema" and parsed.text.format.strict


def test_json_object_format_is_a_json_object(client: openai.OpenAI):
    response = _ask(
        client,
        input="Describe a cat as JSON.",
        text={"format": {"type": "json_object"}},
        max_output_tokens=24,
    )
    assert response.status == "completed"
    assert isinstance(json.loads(response.output_text), dict)


def test_previous_response_id_continues_on_the_prefix_cache(
    client: openai.OpenAI, http: httpx.Client
):
    first = _ask(client, input="My name is Ada and I like tea.", instructions="Be brief.")
    hits_before = metrics(http)["agentrt:prefix_cache_hits_total"]
    second = _ask(
        client, previous_response_id=first.id, input="What is my name?", instructions="Be brief."
    )
    cached = second.usage.input_tokens_details.cached_tokens
    # The whole first prompt (its full blocks) is served from the cache, not prefilled again.
    assert cached >= first.usage.input_tokens // BLOCK_SIZE * BLOCK_SIZE > 0
    assert metrics(http)["agentrt:prefix_cache_hits_total"] - hits_before >= cached
    assert second.previous_response_id == first.id
    # The same conversation resent in full is the same prompt, and the same reply.
    history = [{"role": "user", "content": "My name is Ada and I like tea."}]
    history += [item.model_dump(exclude_none=True) for item in first.output]
    resent = _ask(
        client,
        input=[*history, {"role": "user", "content": "What is my name?"}],
        instructions="Be brief.",
    )
    assert resent.usage.input_tokens == second.usage.input_tokens
    assert resent.usage.input_tokens_details.cached_tokens >= cached
    assert resent.output_text == second.output_text


def test_stored_responses_are_retrieved_and_deleted(client: openai.OpenAI):
    response = _ask(client, input="Say hi.", max_output_tokens=8)
    assert client.responses.retrieve(response.id) == response
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError) as info:
        _ask(client, input="Again.", previous_response_id=response.id)
    assert info.value.status_code == 404 and info.value.param == "previous_response_id"


def test_store_false_keeps_nothing(client: openai.OpenAI):
    response = _ask(client, input="Say hi.", max_output_tokens=8, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError) as info:
        _ask(client, input="Again.", previous_response_id=response.id)
    assert info.value.body["code"] == "previous_response_not_found"


def test_a_function_tool_round_trip(client: openai.OpenAI):
    # The 135M model rarely picks a tool by itself: tool_choice="required" asks for a call.
    question = "What is the weather in Paris?"
    one_call = {"tools": [WEATHER], "parallel_tool_calls": False, "max_output_tokens": 24}
    asked = _ask(client, input=question, tool_choice="required", **one_call)
    assert asked.output and all(item.type == "function_call" for item in asked.output)
    call = asked.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    outputs = [
        {"type": "function_call_output", "call_id": item.call_id, "output": "Sunny, 21 C."}
        for item in asked.output
    ]
    answered = _ask(
        client, previous_response_id=asked.id, input=outputs, tool_choice="none", **one_call
    )
    [message] = answered.output
    assert message.type == "message" and answered.output_text
    # Resent statelessly (what an agent without previous_response_id does), it reads the same.
    resent = _ask(
        client,
        input=[{"role": "user", "content": question}, *asked.output, *outputs],
        tool_choice="none",
        **one_call,
    )
    assert resent.output_text == answered.output_text


def test_a_named_tool_choice_without_parallel_calls_is_one_call(client: openai.OpenAI):
    response = _ask(
        client,
        input="Tell me about Rome.",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=True,
        max_output_tokens=24,
    )
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    single = _ask(
        client, input="Weather in Oslo?", tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=24,
    )  # fmt: skip
    assert len(single.output) == 1 and single.parallel_tool_calls is False


def test_streamed_function_calls_build_the_final_arguments(
    client: openai.OpenAI, http: httpx.Client
):
    body = {"input": "What is the weather in Paris?", "tools": [WEATHER], "temperature": 0}
    body |= {"tool_choice": "required", "parallel_tool_calls": False, "max_output_tokens": 24}
    plain = _ask(client, **body)
    with client.responses.stream(model=MODEL, **body) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for item in final.output:
        deltas = [
            e.delta
            for e in events
            if e.type == "response.function_call_arguments.delta" and e.item_id == item.id
        ]
        [done] = [
            e
            for e in events
            if e.type == "response.function_call_arguments.done" and e.item_id == item.id
        ]
        assert "".join(deltas) == done.arguments == item.arguments
    assert [(i.name, json.loads(i.arguments)) for i in final.output] == [
        (i.name, json.loads(i.arguments)) for i in plain.output
    ]
    assert [e.type for e in _raw_events(http, body)] == types


def test_tools_and_a_format_give_calls_or_the_answer(client: openai.OpenAI):
    """tool_choice "auto" with `text.format`: the reply is calls of the tools or the answer
    in its schema (what the Agents SDK sends with an output_type); here (greedy) the
    answer, the same streamed."""
    person = Person.model_json_schema()
    body = {
        "input": "John Smith is 42 and feels happy today. Extract the person.",
        "tools": [WEATHER],
        "text": {"format": {"type": "json_schema", "name": "person", "schema": person}},
        "max_output_tokens": 40,
    }
    response = _ask(client, **body)
    [item] = response.output
    if item.type == "function_call":
        jsonschema.validate(json.loads(item.arguments), WEATHER["parameters"])
    else:
        Person.model_validate_json(response.output_text)
    with client.responses.stream(model=MODEL, temperature=0, **body) as stream:
        final = stream.get_final_response()
    assert [i.type for i in final.output] == [item.type]
    assert final.output_text == response.output_text


def test_errors_are_openai_errors(client: openai.OpenAI, http: httpx.Client):
    def error(body: dict, status: int = 400) -> dict:
        response = http.post("/v1/responses", json={"model": MODEL, "input": "hi", **body})
        assert response.status_code == status, response.text
        return response.json()["error"]

    missing = error({"previous_response_id": "resp_nope"}, 404)
    assert missing["param"] == "previous_response_id"
    no_schema = {"format": {"type": "json_schema", "name": "x"}}
    assert error({"text": no_schema})["param"] == "text.format"
    bad_schema = {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}
    assert error({"text": bad_schema})["param"] == "text.format.schema"
    hosted = error({"tools": [{"type": "web_search"}]})
    assert hosted["param"] == "tools.0.type" and "web search" in hosted["message"]
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]
    assert error({"input": image})["param"] == "input.0.content.0"
    assert error({"background": True})["param"] == "background"
    assert error({"input": [{"type": "item_reference", "id": "x"}]})["param"] == "input.0.type"
    assert error({"tool_choice": "required"})["param"] == "tool_choice"
    assert error({"frequency_penalty": 1})["type"] == "invalid_request_error"
    assert error({"input": []})["param"] == "input"
    assert error({"input": [[]]})["param"].startswith("input")  # no item at all: a 400
    assert error({"model": "gpt-4o"}, 404)["code"] == "model_not_found"
    assert http.get("/v1/responses/resp_nope").status_code == 404
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="hi", tools=[{"type": "file_search"}])
    assert info.value.param == "tools.0.type"


def test_the_api_key_and_metrics_cover_the_endpoint(server, http: httpx.Client):
    before = metrics(http)
    unauthorized = httpx.post(server.url + "/v1/responses", json={"model": MODEL, "input": "hi"})
    assert unauthorized.status_code == 401
    assert httpx.get(server.url + "/v1/responses/resp_x").status_code == 401
    ok = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 4})
    assert ok.status_code == 200
    after = metrics(http)
    success = "agentrt:request_success_total"
    assert after[success] == before[success] + 1
    status = 'agentrt:http_responses_total{model_name="%s",status="%s"}'
    assert after[status % (MODEL, 401)] >= before.get(status % (MODEL, 401), 0) + 2
    assert after["agentrt:prompt_tokens_total"] > before["agentrt:prompt_tokens_total"]


def test_reasoning_items_sent_back_are_accepted(client: openai.OpenAI):
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": []}
    response = _ask(
        client,
        input=[{"role": "user", "content": "Hi."}, reasoning, {"role": "user", "content": "Bye."}],
        max_output_tokens=4,
    )
    assert response.output[0].type == "message"


def test_a_disconnect_mid_stream_aborts_the_request(http: httpx.Client):
    before = wait_idle(http)
    baseline = before["agentrt:kv_cache_usage_perc"]
    body = {"model": MODEL, "input": "Count to a thousand.", "stream": True}
    with http.stream("POST", "/v1/responses", json={**body, "max_output_tokens": 400}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        while "response.output_text.delta" not in next(lines):
            pass
        assert metrics(http)["agentrt:num_requests_running"] == 1
    started = time.monotonic()
    after = wait_idle(http, timeout_s=10)
    assert time.monotonic() - started < 10
    assert after["agentrt:kv_cache_usage_perc"] == baseline
    # Aborted, not finished: the reply (~100 tokens when left alone) ended by the disconnect.
    aborted = f'agentrt:request_success_total{{finished_reason="abort",model_name="{MODEL}"}}'
    assert after.get(aborted, 0) == before.get(aborted, 0) + 1


def test_chat_takes_tools_with_a_response_format_too(client: openai.OpenAI):
    """What the Agents SDK's chat model sends for an agent with an output_type: under "auto"
    the reply is a call of the tools or the answer in its schema."""
    tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "John Smith is 42 and feels happy today."}],
        "tools": [tool],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": Person.model_json_schema()},
        },
        "parallel_tool_calls": False,
        "max_tokens": 40,
        "temperature": 0,
    }
    message = client.chat.completions.create(**body).choices[0].message
    content, calls = "", ""
    for chunk in client.chat.completions.create(**body, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += "".join(c.function.arguments or "" for c in delta.tool_calls or ())
    # A statement about a person, no weather asked: the model answers, in the schema.
    assert not message.tool_calls
    person = Person.model_validate_json(message.content)
    assert (person.name, person.mood) == ("John Smith", "happy")
    assert content == message.content and calls == ""


def test_logprobs_come_with_the_text_whole_and_streamed(client: openai.OpenAI):
    body = {"input": "Hello!", "max_output_tokens": 4}
    body |= {"include": ["message.output_text.logprobs"], "top_logprobs": 2}
    whole = _ask(client, **body)
    logprobs = whole.output[0].content[0].logprobs
    assert len(logprobs) == whole.usage.output_tokens
    assert all(len(lp.top_logprobs) == 2 for lp in logprobs)
    assert "".join(lp.token for lp in logprobs) == whole.output_text
    with client.responses.stream(model=MODEL, temperature=0, **body) as stream:
        deltas = [e for e in stream if e.type == "response.output_text.delta"]
    streamed = [lp for e in deltas for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in logprobs]
    # The second run prefills less (the prefix cache), so the last bits may differ.
    expected = [lp.logprob for lp in logprobs]
    assert [lp.logprob for lp in streamed] == pytest.approx(expected, abs=1e-3)


CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}


@pytest.mark.parametrize(
    ("max_tokens", "names", "arguments"),
    [(5, [], ""), (14, ["get_weather"], '{"city":')],  # cut in the call's name, its arguments
)
def test_a_reply_cut_off_in_a_tool_call_is_never_text(
    client: openai.OpenAI, max_tokens: int, names: list[str], arguments: str
):
    """max_tokens ends the reply inside its only call: chat returns neither a call nor text
    whole (a cut call is not passed off as text; it completed no call), and streams the call
    as far as it got (the first call streams as it grows), finish_reason "length" both
    ways; Responses makes it an incomplete function call, or an empty incomplete message
    when it was cut before its name."""
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    body = {"model": MODEL, "messages": question, "tools": [CHAT_WEATHER], "temperature": 0}
    body |= {"tool_choice": "required", "parallel_tool_calls": False, "max_tokens": max_tokens}
    whole = client.chat.completions.create(**body).choices[0]
    assert whole.finish_reason == "length"
    assert whole.message.content is None and not whole.message.tool_calls
    content, streamed_names, streamed_arguments, finishes = "", [], "", []
    for chunk in client.chat.completions.create(**body, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or ():
            streamed_names += [call.function.name] if call.function.name else []
            streamed_arguments += call.function.arguments or ""
        finishes += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
    assert (content, streamed_names, streamed_arguments) == ("", names, arguments)
    assert finishes == ["length"]

    responses = {"input": question, "tools": [WEATHER], "tool_choice": "required"}
    responses |= {"parallel_tool_calls": False, "max_output_tokens": max_tokens}
    response = _ask(client, **responses)
    with client.responses.stream(model=MODEL, temperature=0, **responses) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete"
    for final in (response, events[-1].response):
        assert final.status == "incomplete"
        assert final.incomplete_details.reason == "max_output_tokens"
        [item] = final.output
        assert item.status == "incomplete"
        if names:
            assert (item.type, item.name, item.arguments) == ("function_call", *names, arguments)
        else:
            assert item.type == "message" and final.output_text == ""


def test_an_answer_cut_off_streams_what_it_produced(client: openai.OpenAI):
    """Tools with an answer format (calls or the answer), cut off in the answer: its text so
    far, finish_reason "length" in chat; an incomplete message in Responses."""
    person = Person.model_json_schema()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "John Smith is 42 and feels happy today."}],
        "tools": [CHAT_WEATHER],
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": person}},
        "max_tokens": 6,
        "temperature": 0,
    }
    whole = client.chat.completions.create(**body).choices[0]
    assert whole.finish_reason == "length" and whole.message.content.startswith('{"')
    chunks = list(client.chat.completions.create(**body, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]
    responses = {"input": body["messages"], "tools": [WEATHER], "max_output_tokens": 6}
    responses |= {"text": {"format": {"type": "json_schema", "name": "p", "schema": person}}}
    with client.responses.stream(model=MODEL, temperature=0, **responses) as stream:
        events = list(stream)
    final = events[-1].response
    assert events[-1].type == "response.incomplete" and final.status == "incomplete"
    [message] = final.output
    assert message.type == "message" and message.status == "incomplete"
    assert final.output_text == whole.message.content
