"""The agent loop on the embedded model: replies are constrained to valid tool calls, tools
run, their results and exceptions go back as tool messages, a call already answered cannot
be made again, the last step answers, and the run ends with a final answer of the declared
type (or an AgentError carrying the trace)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

import agentrt
from agentrt import AgentError
from agentrt.formats import tools_format
from agentrt.grammar.tools import EXCLUDED_ARGUMENTS

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
    result = await agent.run("What is 6 times 7?")  # the last step answers: no AgentError
    assert isinstance(result.output, Answer)
    first = result.steps[0]
    assert [c.name for c in first.calls] == ["multiply"]
    assert CALLS[0] == ("multiply", first.calls[0].arguments)
    assert first.results[0].output == first.calls[0].arguments["a"] * first.calls[0].arguments["b"]
    for step in result.steps:  # every reply was a valid call (the grammar allowed nothing else)
        for call in step.calls:
            assert call.name in ("multiply", "final_answer")
    assert result.steps[-1].calls[-1].name == "final_answer"


def _same(a: dict, b: dict) -> bool:
    return {k: float(v) for k, v in a.items()} == {k: float(v) for k, v in b.items()}


async def test_an_answered_call_cannot_be_produced_again(rt):
    """Greedy decoding makes the same call every time for the same history; with that call's
    arguments excluded, the grammar makes the model write a different one."""
    session = rt.session(system="You are a calculator. Use the tools.", max_tokens=64)
    definition = multiply.definition()
    fmt = tools_format([definition], "multiply", parallel_tool_calls=False)
    (first,) = await session.fork().generate("What is 6 times 7?", schema=fmt)
    (repeat,) = await session.fork().generate("What is 6 times 7?", schema=fmt)
    assert _same(repeat.arguments, first.arguments)  # what the model wants to write
    definition["function"][EXCLUDED_ARGUMENTS] = [first.arguments]
    fmt = tools_format([definition], "multiply", parallel_tool_calls=False)
    (second,) = await session.fork().generate("What is 6 times 7?", schema=fmt)
    assert second.name == "multiply" and not _same(second.arguments, first.arguments)


async def test_the_agent_never_repeats_a_call_and_its_last_step_answers(rt):
    """Left to itself the 135M model calls multiply again and again; every call it makes is
    new, and step max_steps is the final answer."""
    CALLS.clear()
    agent = agentrt.Agent(
        rt, tools=[multiply], output=Answer, max_steps=4, tool_choice="multiply", max_tokens=64
    )
    result = await agent.run("What is 6 times 7?")
    made = [(c.name, c.arguments) for step in result.steps for c in step.calls]
    tool_calls = [arguments for name, arguments in made if name == "multiply"]
    for i, arguments in enumerate(tool_calls):
        assert not any(_same(arguments, earlier) for earlier in tool_calls[:i]), made
    assert made[-1][0] == "final_answer" and isinstance(result.output, Answer)
    assert len(CALLS) == len(tool_calls)


async def test_the_last_step_is_the_answer(rt):
    # max_steps=1: the first step is the last, so it answers (the forced tool_choice yields).
    typed = agentrt.Agent(
        rt, tools=[multiply], output=Answer, max_steps=1, tool_choice="multiply", max_tokens=64
    )
    result = await typed.run("What is 6 times 7?")
    assert [c.name for c in result.steps[0].calls] == ["final_answer"]
    assert isinstance(result.output, Answer)
    # Without an output type the last step is plain text: no tool call can be written.
    plain = agentrt.Agent(rt, tools=[multiply], max_steps=1, tool_choice="required", max_tokens=32)
    result = await plain.run("What is 6 times 7?")
    assert isinstance(result.output, str) and result.steps[0].calls == []


def _example(name: str):
    path = Path(__file__).resolve().parents[2] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # Pydantic resolves the module's annotations through it
    spec.loader.exec_module(module)
    return module


async def test_the_demo_agent_answers_correctly(rt):
    """`make demo`'s agent part (examples/agent.py) on the embedded model: one lookup, then
    the right quote (3 x 249.00 EUR), computed by the tool and copied by the model."""
    example = _example("agent")
    answer = await example.run(rt)
    assert answer == example.Quote(product="espresso machine", quantity=3, total_eur=747.0)


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


@pytest.mark.slow
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

    agent = agentrt.Agent(
        rt, tools=[slow_echo], max_steps=2, parallel_tool_calls=True, max_tokens=96
    )
    agent.tool_choice = "required"
    result = await agent.run("Make two tool calls: slow_echo('red') and slow_echo('blue').")
    step = result.steps[0]  # the calls; step 2 (the last) answers in text
    # Greedy on the embedded model, this prompt gets both calls in one reply (the earlier
    # "both at once" got one, so a sequential run passed too): both ran at the same time.
    assert [c.arguments for c in step.calls] == [{"word": "red"}, {"word": "blue"}]
    assert [r.output for r in step.results] == ["red", "blue"]
    assert peak == 2 and json.loads(step.text)


def test_bad_agent_configuration():
    with pytest.raises(agentrt.SchemaError):
        agentrt.Agent(object(), tools=[multiply, multiply])
    with pytest.raises(AgentError):
        agentrt.Agent(object(), tools=[multiply], max_steps=0)
