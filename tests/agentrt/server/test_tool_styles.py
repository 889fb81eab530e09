"""A model whose chat template defines `<tool_call>` blocks (Qwen / Hermes) is constrained to
its own format, and the server still answers with OpenAI `tool_calls`, whole and streamed."""

from __future__ import annotations

import json

import openai
import pytest

from agentrt.engine.client.llm import LLM
from agentrt.server.state import ServerConfig
from tests.agentrt.server.helpers import in_process_server
from tests.agentrt.test_tool_style import HERMES_TEMPLATE

pytestmark = pytest.mark.anyio

TOOL = {
    "type": "function",
    "function": {
        "name": "record",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["city", "days"],
        },
    },
}


async def test_hermes_template_tool_calls(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("qwen2")), dtype="float32", kv_cache_memory_gb=0.02)
    llm.engine.tokenizer.chat_template = HERMES_TEMPLATE
    config = ServerConfig(served_model_name="qwen")
    async with in_process_server(config, llm.engine) as server:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        kwargs = dict(
            model="qwen",
            messages=[{"role": "user", "content": "Record a trip to Oslo."}],
            tools=[TOOL],
            tool_choice={"type": "function", "function": {"name": "record"}},
            parallel_tool_calls=False,
            max_tokens=80,
            temperature=0,
        )
        reply = await client.chat.completions.create(**kwargs)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert call.function.name == "record" and 1 <= arguments["days"] <= 9
        assert len(arguments["city"]) <= 12
        deltas = []
        async for chunk in await client.chat.completions.create(**kwargs, stream=True):
            deltas += [d for c in chunk.choices for d in c.delta.tool_calls or []]
            assert not any(c.delta.content for c in chunk.choices)  # no tags leak as text
        assert deltas[0].function.name == "record"
        assert json.loads("".join(d.function.arguments or "" for d in deltas)) == arguments
        await client.close()
        server.stop()
    assert server.exit_code == 0
