"""Tools and an answer format in one request: the reply is either tool calls or the answer
in its format (OpenAI accepts both together; the OpenAI Agents SDK sends its `output_type`
and its tools on every turn).

Under `tool_choice="auto"` the grammar is the union of the two: the calls in the served
model's style (`agentrt.tool_calls`) or one JSON value of the answer's schema. Under
"required" or a named tool the calls alone (this turn gives no answer); under "none" the
answer alone. `ReplyKind` tells the two apart as a reply streams (one that starts like a
call of the tools is calls, any other is the answer); `CallsOrAnswerStreamer` streams such a
reply as content or tool-call deltas. `answer_possible` says when a reply may be the answer.
"""

from __future__ import annotations

import json
from typing import Any

from agentrt.engine.sampling_params import StructuredOutputsParams
from agentrt.formats import OutputFormat
from agentrt.grammar import GrammarSpec
from agentrt.grammar.tools import compact, tool_call_spec_text, tool_calls_schema
from agentrt.server.tool_stream import ToolCallStreamer
from agentrt.tool_calls import MAX_PARALLEL_TOOL_CALLS, hermes_spec

# A compact call in the "json" style starts with exactly this (`COMPACT_JSON` separators).
_CALL_HEAD = '{"name": "'


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
    if tools.tool_style == "json":
        payload = compact(
            tool_calls_schema(canonical, "required", parallel=tools.parallel_tool_calls)
        )
        lines = [
            "start: calls | answer",
            f"calls: %json {json.dumps(payload, ensure_ascii=False)}",
            answer_rule,
        ]
        return StructuredOutputsParams(spec=GrammarSpec.from_ebnf("\n".join(lines)))
    # Tagged styles: the grammar of "required" calls, its start rule renamed, or the answer
    # (JSON never starts with the opening tag).
    special = {"special": True} if tools.tool_style == "hermes_tokens" else {}
    tagged = hermes_spec(
        list(tools.tools),
        "required",
        parallel=tools.parallel_tool_calls,
        max_calls=tools.max_parallel_tool_calls,
        **special,
    ).text
    if not tagged.startswith("start:"):
        raise AssertionError(f"a tagged calls grammar starts with its start rule: {tagged!r}")
    grammar = "start: tagged | answer\ntagged:" + tagged[len("start:") :] + answer_rule
    return StructuredOutputsParams(spec=GrammarSpec.from_ebnf(grammar))


class ReplyKind:
    """Tells, as a reply streams, whether it is calls or the answer: `feed(text)` returns
    "calls", "answer", or None while the text so far could be either."""

    def __init__(self, tool_style: str, tool_names: set[str]) -> None:
        self.tool_style = tool_style
        self.tool_names = tool_names
        self.text = ""

    def feed(self, text: str) -> str | None:
        self.text += text
        head = self.text.lstrip()
        if not head:
            return None
        if self.tool_style != "json":
            return "calls" if head[0] == "<" else "answer"
        if head[0] == "[":
            return "calls"
        if not head.startswith(_CALL_HEAD):
            return None if _CALL_HEAD.startswith(head) else "answer"
        name = _closed_string(head[len(_CALL_HEAD) - 1 :])
        if name is None:
            return None
        return "calls" if name in self.tool_names else "answer"

    def finish(self) -> str:
        """The kind of a reply that ended before `feed` could tell."""
        return self.feed("") or "answer"


class CallsOrAnswerStreamer:
    """`ToolCallStreamer`'s interface for a reply that is calls or the answer: `feed(text)`
    returns (content delta, tool-call deltas); the text is held until `ReplyKind` tells,
    then the answer streams as content and calls as tool-call deltas. `finish()` releases
    text still held when the reply ends (a reply cut before it could tell: the answer)."""

    def __init__(
        self,
        tool_style: str,
        tool_names: set[str],
        *,
        max_calls: int | None = MAX_PARALLEL_TOOL_CALLS,
    ) -> None:
        self._kind = ReplyKind(tool_style, tool_names)
        self._calls = ToolCallStreamer(tool_style, max_calls=max_calls)
        self.kind: str | None = None  # "calls" or "answer", once told
        self._held = ""

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self.kind is None:
            self._held += text
            self.kind = self._kind.feed(text)
            if self.kind is None:
                return "", []
            text, self._held = self._held, ""
        if self.kind == "answer":
            return text, []
        return self._calls.feed(text)

    def finish(self) -> str:
        """At the reply's end: the content still held back, as `ToolCallStreamer.finish`."""
        if self.kind is None:
            self.kind = "answer"
            held, self._held = self._held, ""
            return held
        return self._calls.finish() if self.kind == "calls" else ""

    @property
    def is_tool_calls(self) -> bool:
        return self.kind == "calls" and self._calls.is_tool_calls

    def finish_reason(self, reason: str | None) -> str | None:
        return self._calls.finish_reason(reason) if self.kind == "calls" else reason


def _closed_string(text: str) -> str | None:
    """The JSON string `text` starts with, once its closing quote is in; else None."""
    escaped = False
    for i, ch in enumerate(text[1:], start=1):
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            return json.loads(text[: i + 1])
    return None


def tool_names(tools: list[dict[str, Any]] | None) -> set[str]:
    """The names of chat-format tool definitions."""
    return {t["function"]["name"] for t in tools or ()}
