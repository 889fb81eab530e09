"""Reasoning through a real `agentrt serve` (a tiny random Qwen3 model whose tokenizer has
`<think>` / `</think>` tokens), driven by the `openai` client: `reasoning_content` apart from
the schema-valid content, whole and streamed, with vLLM's request options."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from tests.agentrt.server.helpers import ServerProcess

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"code": {"type": "string", "maxLength": 6}, "ok": {"const": True}},
    "required": ["code", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def think_client(tiny_think_checkpoint) -> Iterator[openai.OpenAI]:
    args = ("--model", str(tiny_think_checkpoint), "--dtype", "float32")
    with ServerProcess(
        *args, "--kv-cache-memory-gb", "0.02", "--grammar-timeout-s", "120"
    ) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _options(client: openai.OpenAI, **extra) -> dict:
    start_id = 151665  # `<think>`, added after Qwen2.5's 151,665 tokens
    return dict(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "A code, please."}],
        temperature=0,
        max_tokens=60,
        logit_bias={str(start_id): 100},  # the random model opens the block
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
        extra_body={"max_reasoning_tokens": 6, **extra},
    )


def test_reasoning_content_whole_and_streamed(think_client):
    whole = think_client.chat.completions.create(**_options(think_client))
    message = whole.choices[0].message
    assert message.reasoning_content and "</think>" not in message.reasoning_content
    assert json.loads(message.content)["ok"] is True
    assert whole.usage.completion_tokens_details.reasoning_tokens == 1 + 6 + 1

    reasoning, content = "", ""
    stream = think_client.chat.completions.create(**_options(think_client), stream=True)
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, message.content)


def test_include_reasoning_and_enable_thinking(think_client):
    hidden = think_client.chat.completions.create(**_options(think_client, include_reasoning=False))
    message = hidden.choices[0].message
    assert getattr(message, "reasoning_content", None) is None
    assert json.loads(message.content)["ok"] is True
    off = think_client.chat.completions.create(
        **_options(think_client, chat_template_kwargs={"enable_thinking": False})
    )
    assert getattr(off.choices[0].message, "reasoning_content", None) is None
    assert json.loads(off.choices[0].message.content)["ok"] is True
