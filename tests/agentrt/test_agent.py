"""The agent loop on the embedded model: replies are constrained to valid tool calls, tools
run, their results and exceptions go back as tool messages, and the run ends with a final
answer of the declared type or an AgentError carrying the trace."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

import agentrt
from agentrt import AgentError

pytestmark = pytest.mark.anyio

CALLS: list[tuple[str, dict]] = []


@agentrt.tool
def multiply(a: float, b: float) -> float:
    """Multiply two numbers."""
    CALLS.append(("multiply", {"a": a, "b": b}))
    return a * b


@agentrt.tool
def flaky_lookup(key: str) -> str:
    """Look a key up in the company directory."""
    CALLS.append(("flaky_lookup", {"key": key}))
    raise ConnectionError("directory service unavailable")


class Answer(BaseModel):
    value: float


async def test_forced_tool_call_runs_and_the_run_ends_typed(rt):
    CALLS.clear()
    agent = agentrt.Agent(
        rt,
        tools=[multiply],
        system="You are a calculator. Use the tools, then give the final answer.",
        output=Answer,
        max_steps=3,
        tool_choice="multiply",
    )
    try:
        result = await agent.run("What is 6 times 7?")
        steps, output = result.steps, result.output
        assert isinstance(output, Answer)
    except AgentError as exc:  # a 135M model may keep calling tools: the trace says so
        steps = exc.trace.steps
    first = steps[0]
    assert [c.name for c in first.calls] == ["multiply"]
    assert CALLS[0] == ("multiply", first.calls[0].arguments)
    assert first.results[0].output == first.calls[0].arguments["a"] * first.calls[0].arguments["b"]
    for step in steps:  # every reply was a valid call (the grammar allowed nothing else)
        for call in step.calls:
            assert call.name in ("multiply", "final_answer")


async def test_failing_tool_goes_back_as_a_tool_message(rt):
    CALLS.clear()
    agent = agentrt.Agent(
        rt, tools=[flaky_lookup, multiply], max_steps=2, tool_choice="flaky_lookup", max_tokens=64
    )
    try:
        result = await agent.run("Find the phone number of Ada.")
        messages, steps = result.messages, result.steps
    except AgentError as exc:
        messages, steps = exc.trace.messages, exc.trace.steps
    assert steps[0].results[0].error == "ConnectionError: directory service unavailable"
    tool_messages = [m for m in messages if m["role"] == "tool"]
    assert tool_messages[0]["content"] == "error: ConnectionError: directory service unavailable"
    assert tool_messages[0]["tool_call_id"] == steps[0].calls[0].id
    assert CALLS[0][0] == "flaky_lookup"
    # The second reply saw the failure and still produced a valid call or a text answer.
    assert len(steps) == 2


async def test_parallel_calls_run_concurrently(rt):
    import anyio

    running, peak = 0, 0

    @agentrt.tool
    async def slow_echo(word: str) -> str:
        """Echo a word slowly."""
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await anyio.sleep(0.2)
        running -= 1
        return word

    agent = agentrt.Agent(rt, tools=[slow_echo], max_steps=1, parallel_tool_calls=True)
    agent.tool_choice = "required"
    with pytest.raises(AgentError) as info:  # max_steps=1: one step of calls, no answer
        await agent.run("Echo the words 'red' and 'blue', both at once.")
    (step,) = info.value.trace.steps
    assert all(
        r.output == c.arguments["word"] for r, c in zip(step.results, step.calls, strict=True)
    )
    assert peak == len(step.calls) and json.loads(step.text)


def test_bad_agent_configuration():
    with pytest.raises(agentrt.SchemaError):
        agentrt.Agent(object(), tools=[multiply, multiply])
    with pytest.raises(AgentError):
        agentrt.Agent(object(), tools=[multiply], max_steps=0)
