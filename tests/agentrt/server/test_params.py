"""agentrt.server.params: a response_format schema is checked against its meta-schema once per
schema text (every line of a batch sends the same one), and a bad one is still a 400 naming
the field of each request that sends it."""

from __future__ import annotations

import pytest

from agentrt.errors import SchemaError
from agentrt.server import params
from agentrt.server.protocol import ChatCompletionRequest


def _request(response_format: dict) -> ChatCompletionRequest:
    messages = [{"role": "user", "content": "hi"}]
    return ChatCompletionRequest(model="m", messages=messages, response_format=response_format)


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def test_a_schema_is_checked_once_and_a_bad_one_refused_each_time(monkeypatch):
    checked = []
    resolve_format = params.resolve_format
    monkeypatch.setattr(params, "resolve_format", lambda s: checked.append(s) or resolve_format(s))
    params._cached_schema_error.cache_clear()
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    reordered = {"required": ["n"], "properties": {"n": {"type": "integer"}}, "type": "object"}
    for sent in (schema, reordered, schema):
        constraint = params.chat_constraint(_request(_json_schema(sent)))
        assert constraint.structured.json == sent
    assert checked == [schema]

    bad = {"type": "nonsense"}
    for response_format, field in [
        (_json_schema(bad), "response_format.json_schema.schema"),
        ({"type": "json_object", "schema": bad}, "response_format.schema"),
    ]:
        with pytest.raises(SchemaError, match="invalid") as refused:
            params.chat_constraint(_request(response_format))
        assert refused.value.field == field
    assert checked == [schema, bad]
