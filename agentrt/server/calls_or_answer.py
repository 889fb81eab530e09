"""Tools and an answer format in one request: the reply is either tool calls or the answer
in its format (OpenAI accepts both together; the OpenAI Agents SDK sends its `output_type`
and its tools on every turn).

Under `tool_choice="auto"` the grammar is the union of the two: the calls in the served
model's style (`agentrt.tool_formats`) or one JSON value of the answer's schema. Under
"required" or a named tool the calls alone (this turn gives no answer); under "none" the
answer alone. `answer_possible` says when a reply may be the answer; agentrt.reply_calls
(`ReplyKind`, `CallsOrAnswerStreamer`) tells the two apart as a reply streams.
"""

from __future__ import annotations

import json
from typing import Any

from agentrt.engine.sampling_params import StructuredOutputsParams
from agentrt.formats import OutputFormat
from agentrt.grammar import GrammarSpec
from agentrt.grammar.tools import compact, tool_call_spec_text
from agentrt.tool_formats import call_format, calls_schema, calls_spec


def answer_possible(tools: OutputFormat) -> bool:
    """Whether, with an answer format too, a reply under these tools may be the answer:
    under tool_choice "auto", or "none" (given, or every call excluded)."""
    _, choice = tool_call_spec_text(list(tools.tools), tools.tool_choice)
    return choice in ("auto", "none")


def calls_or_answer(
    tools: OutputFormat, answer: StructuredOutputsParams
) -> StructuredOutputsParams:
    """The constraint of a reply that is calls of `tools` (an `OutputFormat` of kind
    "tools") or the `answer` (a `json` schema dict or `json_object`). Raises SchemaError
    naming `tools` / `tool_choice` as `OutputFormat` does."""
    calls = tools.structured_outputs()  # checks the tools and tool_choice first
    canonical, choice = tool_call_spec_text(list(tools.tools), tools.tool_choice)
    if choice == "none":
        return answer
    if choice != "auto":
        return calls
    schema = {"type": "object"} if answer.json_object else answer.json
    answer_rule = f"answer: %json {json.dumps(compact(schema), ensure_ascii=False)}"
    if not call_format(tools.tool_style).tagged:
        payload = compact(
            calls_schema(
                canonical, "required", tools.tool_style, parallel=tools.parallel_tool_calls
            )
        )
        lines = [
            "start: calls | answer",
            f"calls: %json {json.dumps(payload, ensure_ascii=False)}",
            answer_rule,
        ]
        return StructuredOutputsParams(spec=GrammarSpec.from_ebnf("\n".join(lines)))
    # Tagged styles: the grammar of "required" calls, its start rule renamed, or the answer
    # (JSON never starts with the opening tag).
    tagged = calls_spec(
        list(tools.tools),
        "required",
        tools.tool_style,
        parallel=tools.parallel_tool_calls,
        max_calls=tools.max_parallel_tool_calls,
    ).text
    if not tagged.startswith("start:"):
        raise AssertionError(f"a tagged calls grammar starts with its start rule: {tagged!r}")
    grammar = "start: tagged | answer\ntagged:" + tagged[len("start:") :] + answer_rule
    return StructuredOutputsParams(spec=GrammarSpec.from_ebnf(grammar))


def tool_names(tools: list[dict[str, Any]] | None) -> set[str]:
    """The names of chat-format tool definitions."""
    return {t["function"]["name"] for t in tools or ()}
