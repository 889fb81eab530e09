"""Reasoning through a real `agentrt serve` (a tiny random Qwen3 model whose tokenizer has
`<think>` / `</think>` tokens), driven by the `openai` client: `reasoning_content` apart from
the schema-valid content, whole and streamed, with vLLM's request options."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from pydantic import BaseModel, Field

import agentrt
from agentrt.backend import Completion
from agentrt.engine.client.llm import LLM
from agentrt.formats import resolve_format
from agentrt.reasoning import ReasoningText
from agentrt.remote import RemoteBackend
from tests.agentrt.server.helpers import ServerProcess

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"code": {"type": "string", "maxLength": 6}, "ok": {"const": True}},
    "required": ["code", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def think_server(tiny_think_checkpoint) -> Iterator[ServerProcess]:
    args = ("--model", str(tiny_think_checkpoint), "--dtype", "float32")
    with ServerProcess(
        *args, "--kv-cache-memory-gb", "0.02", "--grammar-timeout-s", "120"
    ) as server:
        yield server


@pytest.fixture(scope="module")
def think_client(think_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=think_server.url + "/v1", api_key="none", max_retries=0)


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


class Code(BaseModel):
    code: str = Field(max_length=6)
    ok: bool


def test_the_remote_backend_sends_the_reasoning_options():
    backend = RemoteBackend(base_url="http://127.0.0.1:1/v1", model="m")
    options = {
        "reasoning": False,
        "max_reasoning_tokens": 6,
        "reasoning_effort": "low",
        "reasoning_parser": "qwen3",
    }
    request = backend.request([], resolve_format(Code), {}, options)
    assert request["extra_body"] == {
        "chat_template_kwargs": {"enable_thinking": False},
        "max_reasoning_tokens": 6,
        "reasoning_parser": "qwen3",
    }
    assert request["reasoning_effort"] == "low"  # OpenAI's own parameter
    assert "extra_body" not in backend.request([], resolve_format(Code), {}, {"reasoning": "auto"})


async def _turn(backend, **sampling) -> tuple[str, Completion]:
    """One turn's reasoning deltas, joined, and its completion."""
    messages = [{"role": "user", "content": "A code, please."}]
    items = [i async for i in backend.stream(messages, resolve_format(Code), sampling)]
    return "".join(i for i in items if isinstance(i, ReasoningText)), items[-1]


@pytest.mark.anyio
async def test_the_remote_backend_reasons_as_the_local_one(think_server, tiny_think_checkpoint):
    """The SDK pointed at `agentrt serve` passes the reasoning budget and the switch, and gets
    the reasoning back as the local backend gives it: streamed apart, in the completion,
    counted in usage; greedy fp32 makes the two the same text."""
    sampling = {"max_reasoning_tokens": 6, "logit_bias": {151665: 100.0}, "max_tokens": 60}
    llm = LLM(
        str(tiny_think_checkpoint), dtype="float32", kv_cache_memory_gb=0.02, grammar_timeout_s=120
    )
    async with agentrt.Runtime(engine=llm.engine) as local:
        local_streamed, local_done = await _turn(local.backend, **sampling)
    async with agentrt.Runtime(base_url=think_server.url + "/v1", api_key="none") as remote:
        streamed, done = await _turn(remote.backend, **sampling)
        assert done.finish_reason == "stop"
        Code.model_validate_json(done.text)
        assert streamed == done.reasoning == local_done.reasoning == local_streamed
        assert done.text.strip() == local_done.text.strip()
        assert done.usage.reasoning_tokens == local_done.usage.reasoning_tokens == 1 + 6 + 1
        # The switch, as a template variable and as OpenAI's effort: no reasoning at all.
        for off in ({"reasoning": False}, {"reasoning_effort": "none"}):
            streamed, done = await _turn(remote.backend, **sampling, **off)
            assert streamed == "" and done.reasoning is None, off
            assert done.usage.reasoning_tokens == 0
            Code.model_validate_json(done.text)
        session = remote.session()
        await session.generate("A code?", schema=Code, **sampling)
        assert session.last.reasoning and session.last.usage.reasoning_tokens == 8


def test_anthropic_thinking_blocks_whole_and_streamed(think_server):
    """The Messages API's `thinking` turns the reasoning on and caps it; the reasoning is a
    thinking block before the answer, streamed as thinking_delta events."""
    import anthropic

    claude = anthropic.Anthropic(base_url=think_server.url, api_key="none", max_retries=0)
    options = dict(
        model=claude.models.list().data[0].id,
        max_tokens=60,
        messages=[{"role": "user", "content": "A code, please."}],
        thinking={"type": "enabled", "budget_tokens": 6},
        extra_body={
            "temperature": 0,
            "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
        },
    )
    whole = claude.messages.create(**options)
    assert [block.type for block in whole.content] == ["thinking", "text"]
    thinking, text = whole.content
    assert thinking.thinking and "</think>" not in thinking.thinking
    assert json.loads(text.text)["ok"] is True and whole.stop_reason == "end_turn"

    with claude.messages.stream(**options) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert deltas[0] == "thinking_delta" and deltas[-1] == "text_delta"
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in streamed.content] == [
        ("thinking", thinking.thinking),
        ("text", text.text),
    ]

    omitted = claude.messages.create(
        **{**options, "thinking": {"type": "enabled", "budget_tokens": 6, "display": "omitted"}}
    )
    assert [block.type for block in omitted.content] == ["text"]
    off = claude.messages.create(**{**options, "thinking": {"type": "disabled"}})
    assert [block.type for block in off.content] == ["text"]
    assert json.loads(off.content[0].text)["ok"] is True
    assert off.usage.output_tokens < whole.usage.output_tokens
