"""The model's own tool-call format when its chat template defines one: a Qwen/Hermes-style
template gets `<tool_call>` blocks, grammar-constrained, rendered back by the template."""

from __future__ import annotations

import json
from typing import Annotated

import pytest
from pydantic import Field

import agentrt
from agentrt.engine.client.llm import LLM
from agentrt.grammar import GrammarCompiler
from agentrt.grammar.tools import EXCLUDED_ARGUMENTS
from agentrt.reply import ReplyShape, read_reply
from agentrt.tool_calls import render_messages
from agentrt.tool_formats import calls_spec, tool_call_style

pytestmark = pytest.mark.anyio

# The tool parts of Qwen 2.5's template, reduced.
HERMES_TEMPLATE = """
{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
For each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{%- for tc in message.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}
"""

CALLS: list[dict] = []


@agentrt.tool
def record(
    city: Annotated[str, Field(max_length=12)], days: Annotated[int, Field(ge=1, le=9)]
) -> str:
    """Record a trip."""
    CALLS.append({"city": city, "days": days})
    return "recorded"


def test_parse_hermes_blocks():
    text = (
        '<tool_call>\n{"name": "record", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "record", "arguments": {"city": "Rome", "days": 1}}\n</tool_call>'
    )
    shape = ReplyShape(tool_style="hermes")
    calls = read_reply(None, shape, text, ()).calls.calls
    assert [(c.name, c.arguments["city"]) for c in calls] == [
        ("record", "Oslo"),
        ("record", "Rome"),
    ]
    assert read_reply(None, shape, "plain answer", ()).calls is None


@pytest.fixture(scope="module")
def hermes_llm(tiny_checkpoint) -> LLM:
    llm = LLM(str(tiny_checkpoint("qwen2")), dtype="float32", kv_cache_memory_gb=0.02)
    llm.engine.tokenizer.chat_template = HERMES_TEMPLATE
    return llm


async def test_agent_uses_the_templates_own_format(hermes_llm):
    tokenizer = hermes_llm.engine.tokenizer
    assert tool_call_style(tokenizer) == "hermes"
    CALLS.clear()
    async with agentrt.Runtime(engine=hermes_llm.engine) as rt:
        agent = agentrt.Agent(rt, tools=[record], max_steps=2, tool_choice="record", max_tokens=128)
        try:
            result = await agent.run("Record a two-day trip to Oslo.")
            steps, messages = result.steps, result.messages
        except agentrt.AgentError as exc:  # random weights: the second reply may be anything
            steps, messages = exc.trace.steps, exc.trace.messages
    first = steps[0]
    assert first.text.startswith("<tool_call>\n{") and first.text.rstrip().endswith("</tool_call>")
    assert [c.name for c in first.calls] == ["record"] and CALLS == [first.calls[0].arguments]
    assert first.results[0].output == "recorded"
    # Templates with tools render the definitions and the tool turns themselves; the
    # grammar-only excluded_arguments never reach the prompt.
    definition = record.definition()
    definition["function"][EXCLUDED_ARGUMENTS] = [first.calls[0].arguments]
    rendered, tools = render_messages(messages, [definition], tokenizer)
    assert rendered is messages and tools == [record.definition()]
    prompt = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert "<tool_response>\nrecorded\n</tool_response>" in prompt
    assert json.dumps(record.definition()) in prompt.replace("\n", "")


def test_a_named_choice_is_one_tool_call_block(hermes_llm):
    """As in the JSON style, a named tool_choice allows exactly one call, parallel or not."""
    tokenizer = hermes_llm.engine.tokenizer
    compiler = GrammarCompiler(tokenizer)
    block = (
        '<tool_call>\n{"name": "record", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
    )

    def accepts(tool_choice, text: str) -> bool:
        spec = calls_spec([record.definition()], tool_choice, "hermes", parallel=True, max_calls=8)
        matcher = compiler.compile(spec).matcher()
        ids = tokenizer.encode(text, add_special_tokens=False)
        return all(matcher.accept_token(t) for t in ids) and matcher.can_terminate()

    named = {"type": "function", "function": {"name": "record"}}
    assert accepts(named, block) and not accepts(named, block + "\n" + block)
    assert accepts("required", block + "\n" + block)
