"""Requests other servers accept, answered the way their clients expect: llama.cpp's
`response_format` json_object with a `schema` (older Instructor sends it) is enforced, and a
token-id prompt holding something other than integers is a 400 naming `prompt`."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
TEAL = {
    "type": "object",
    "properties": {"color": {"enum": ["teal"]}, "count": {"type": "integer", "minimum": 7}},
    "required": ["color", "count"],
    "additionalProperties": False,
}


def _ask(client: openai.OpenAI, response_format: dict) -> str:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a color and a number as JSON."}],
        response_format=response_format,
        max_tokens=40,
        temperature=0,
    )
    assert reply.choices[0].finish_reason == "stop"
    return reply.choices[0].message.content


def test_json_object_with_a_schema_enforces_the_schema(client: openai.OpenAI):
    value = json.loads(_ask(client, {"type": "json_object", "schema": TEAL}))
    assert value["color"] == "teal" and isinstance(value["count"], int) and value["count"] >= 7
    assert set(value) == {"color", "count"}


def test_json_object_without_a_schema_is_any_object(client: openai.OpenAI):
    assert isinstance(json.loads(_ask(client, {"type": "json_object"})), dict)


def test_json_object_schema_errors_name_the_field(http: httpx.Client):
    for response_format, param in [
        ({"type": "json_object", "schema": {"type": "no-such-type"}}, "response_format.schema"),
        (
            {"type": "json_schema", "schema": TEAL, "json_schema": {"name": "x"}},
            "response_format.schema",
        ),
    ]:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": response_format,
        }
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param


@pytest.mark.parametrize("prompt", [[1, "a"], [[1, 2], [3, "x"]], [1.5, 2], [[1], "a"]])
def test_a_prompt_list_with_non_integers_is_400_naming_prompt(http: httpx.Client, prompt):
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt" and error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_request"


def test_the_openai_client_gets_a_bad_request_for_such_a_prompt(client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[1, "a"], max_tokens=2)
    assert info.value.param == "prompt"
