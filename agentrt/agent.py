"""Agent: the tool loop. Each reply is grammar-constrained to tool calls whose arguments match
the chosen tool's schema, or to the final answer; tools run (parallel calls concurrently),
their results and exceptions go back as tool messages, until a final answer or `max_steps`.

With `output=Model` the final answer is a call of the `final_answer` tool whose arguments are
the model, so the reply is always constrained; without it the model may answer in plain
text (tool_choice "auto").

Two rules keep a small model from looping, both enforced by the grammar, not by asking:
a call whose result is already in the history (same tool, same arguments) cannot be made
again, and the last step (`max_steps`) can only be the final answer.

Tools may come from a `ToolSource` too (an MCP server: `agentrt.mcp_server(...)`): its tools
join the agent's when it opens (`async with agent`, or the first `run`), and it closes with
the agent (`close()`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import pydantic

from agentrt.backend import Backend, Usage
from agentrt.errors import AgentError, SchemaError
from agentrt.formats import resolve_format, tools_format
from agentrt.grammar.tools import EXCLUDED_ARGUMENTS
from agentrt.session import check_completion, collect_completion
from agentrt.tool_calls import MAX_PARALLEL_TOOL_CALLS, ToolCall
from agentrt.tools import Tool, ToolSource

FINAL_ANSWER = "final_answer"


@dataclass(slots=True)
class ToolResult:
    call: ToolCall
    output: Any = None
    error: str | None = None  # the tool's exception (or bad arguments), as the model saw it


@dataclass(slots=True)
class Step:
    """One model reply: the tool calls it made and what they returned, or the final text.
    A reasoning model's `reasoning` is kept here, never in the calls: the call grammar
    starts after the reasoning ends, and the history sent back holds the calls alone.
    `content`: the text the reply wrote apart from its calls ("Let me check." before a
    call; the whole text of a final answer)."""

    text: str
    calls: list[ToolCall] = field(default_factory=list)
    results: list[ToolResult] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    reasoning: str | None = None
    content: str | None = None


@dataclass(slots=True)
class AgentResult:
    output: Any  # the final answer: an `output` instance, or text
    steps: list[Step]
    messages: list[dict]
    usage: Usage


class Agent:
    """`Agent(rt, tools=[...], system=..., output=Model | None, max_steps=8)`;
    `await agent.run(task)`. `tools` holds `@tool`s and tool sources (MCP servers), whose
    sessions the agent opens on first use and closes with `close()` / `async with`. `tool_choice` ("auto", "required" or a tool name) applies to the
    first step only, then resets so the agent cannot loop on a forced call.
    `parallel_tool_calls=True` lets one reply call several tools (run concurrently); it is
    off by default because small models tend to repeat calls in an open-ended list (a
    reply's calls end at an exact repeat, and after `max_parallel_tool_calls`).
    A call already answered is not offered again, and step `max_steps` must answer (with
    `max_steps=1` the first step answers: `tool_choice` is overridden)."""

    def __init__(
        self,
        runtime: Any,
        tools: Sequence[Tool | ToolSource],
        *,
        system: str | None = None,
        output: Any = None,
        max_steps: int = 8,
        tool_choice: str = "auto",
        parallel_tool_calls: bool = False,
        max_parallel_tool_calls: int | None = MAX_PARALLEL_TOOL_CALLS,
        **sampling: Any,
    ) -> None:
        self.backend: Backend = getattr(runtime, "backend", runtime)
        self._own_tools = _by_name([t for t in tools if isinstance(t, Tool)])
        self.tools = self._own_tools  # with the sources' once open
        self._sources = [t for t in tools if not isinstance(t, Tool)]
        self._opened = not self._sources
        if max_steps < 1:
            raise AgentError(f"max_steps={max_steps} is invalid: expected >= 1.")
        self.system = system
        self.output = output
        self.max_steps = max_steps
        self.tool_choice = tool_choice
        self.parallel_tool_calls = parallel_tool_calls
        self.max_parallel_tool_calls = max_parallel_tool_calls
        self.sampling = sampling
        self._output_format = resolve_format(output) if output is not None else None
        self._final_definition = (
            self._final_answer_definition() if self._output_format is not None else None
        )

    async def __aenter__(self) -> Agent:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def open(self) -> None:
        """Open the tool sources and add their tools (names stay unique). Open and close
        from the same task (their sessions are anyio context managers)."""
        if self._opened:
            return
        tools = list(self.tools.values())
        try:
            for source in self._sources:
                tools += await source.open()
            self.tools = _by_name(tools)
        except BaseException:
            await self.close()
            raise
        self._opened = True

    async def close(self) -> None:
        """Close the tool sources (the last opened first); `run` opens them again."""
        self._opened = not self._sources
        self.tools = self._own_tools
        for source in reversed(self._sources):
            await source.close()

    async def run(self, task: str) -> AgentResult:
        await self.open()
        messages = [{"role": "system", "content": self.system}] if self.system else []
        messages.append({"role": "user", "content": task})
        steps: list[Step] = []
        usage = Usage()
        answered: dict[str, list[dict]] = {}  # tool name -> arguments whose result was sent
        for number in range(1, self.max_steps + 1):
            choice = self._tool_choice(number)
            fmt = tools_format(
                self._definitions(answered),
                choice,
                parallel_tool_calls=self.parallel_tool_calls,
                max_parallel_tool_calls=self.max_parallel_tool_calls,
            )
            completion = await collect_completion(self.backend.stream(messages, fmt, self.sampling))
            usage = usage + completion.usage
            reply = check_completion(completion, fmt, completion.usage)
            step = Step(
                completion.text,
                usage=completion.usage,
                reasoning=completion.reasoning,
                content=completion.content,
            )
            steps.append(step)
            if isinstance(reply, str) or choice == "none":  # a plain-text final answer
                answer = reply if isinstance(reply, str) else completion.text
                step.content = answer
                messages.append({"role": "assistant", "content": answer})
                return AgentResult(answer, steps, messages, usage)
            step.calls = reply
            content = (completion.content or "").strip() or None
            final = next((c for c in reply if c.name == FINAL_ANSWER), None)
            if final is not None:
                messages.append(_assistant_calls([final], content))
                return AgentResult(self._final_value(final), steps, messages, usage)
            messages.append(_assistant_calls(reply, content))
            step.results = await self._run_tools(reply)
            messages.extend(_tool_message(r) for r in step.results)
            for call in reply:
                answered.setdefault(call.name, []).append(call.arguments)
        raise AgentError(
            f"no final answer after max_steps={self.max_steps} steps.",
            trace=AgentResult(None, steps, messages, usage),
        )

    def _tool_choice(self, number: int) -> str:
        """Step `number` (from 1): the last one answers (no tool call possible), the first
        follows `tool_choice`, the others may call a tool or answer."""
        if number == self.max_steps:
            return FINAL_ANSWER if self._output_format is not None else "none"
        if number == 1 and self.tool_choice != "auto":
            return self.tool_choice
        return "required" if self._output_format is not None else "auto"

    def _definitions(self, answered: dict[str, list[dict]]) -> list[dict[str, Any]]:
        """The tools offered to the next step. Each carries the arguments already answered
        as `excluded_arguments`: the grammar compiles them out of its parameters (and drops
        a tool with no call left), while the prompt keeps showing the tool as it is."""
        definitions = []
        for name, tool in self.tools.items():
            definition = tool.definition()
            if answered.get(name):
                definition["function"][EXCLUDED_ARGUMENTS] = list(answered[name])
            definitions.append(definition)
        if self._final_definition is not None:
            definitions.append(self._final_definition)
        return definitions

    async def _run_tools(self, calls: list[ToolCall]) -> list[ToolResult]:
        results = [ToolResult(call) for call in calls]

        async def run(result: ToolResult) -> None:
            tool = self.tools.get(result.call.name)
            if tool is None:  # only an unconstrained (remote) reply can name one
                result.error = f"unknown tool {result.call.name!r}: use one of {list(self.tools)}"
                return
            try:
                result.output = await tool.call(result.call.arguments)
            except Exception as exc:  # the model sees the failure and may recover
                result.error = f"{type(exc).__name__}: {exc}"

        async with anyio.create_task_group() as tg:
            for result in results:
                tg.start_soon(run, result)
        return results

    def _final_answer_definition(self) -> dict[str, Any]:
        schema = self._output_format.json_schema
        if self._output_format.kind != "json" or schema.get("type") != "object":
            raise SchemaError(
                f"output={self.output!r}: the final answer must be a JSON object type "
                "(a Pydantic model or an object schema)."
            )
        return {
            "type": "function",
            "function": {
                "name": FINAL_ANSWER,
                "description": "Give the final answer to the task. Call it once you know it.",
                "parameters": schema,
            },
        }

    def _final_value(self, call: ToolCall) -> Any:
        return self._output_format.parse(json.dumps(call.arguments))


def _by_name(tools: list[Tool]) -> dict[str, Tool]:
    by_name = {t.name: t for t in tools}
    if len(by_name) != len(tools) or FINAL_ANSWER in by_name:
        raise SchemaError(
            f"tool names must be unique and not {FINAL_ANSWER!r}: {[t.name for t in tools]}"
        )
    return by_name


def _assistant_calls(calls: list[ToolCall], content: str | None = None) -> dict[str, Any]:
    """The assistant turn of a reply that called tools: its text before the calls (None:
    none), and the calls (OpenAI format; the chat template renders them in its own)."""
    return {"role": "assistant", "content": content, "tool_calls": [c.to_openai() for c in calls]}


def _tool_message(result: ToolResult) -> dict[str, Any]:
    if result.error is not None:
        content = f"error: {result.error}"
    else:
        content = _to_text(result.output)
    return {
        "role": "tool",
        "tool_call_id": result.call.id,
        "name": result.call.name,
        "content": content,
    }


def _to_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, pydantic.BaseModel):
        return value.model_dump_json()
    try:
        return json.dumps(value, default=str)
    except (TypeError, ValueError):
        return str(value)
