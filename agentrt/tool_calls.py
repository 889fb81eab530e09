"""Tool calls in chat, shared by the SDK and the server: a call (`ToolCall`), the calls of
one reply (`ReplyCalls`), and the prompt's tools and tool turns (`render_messages`).

Each family's call format (Qwen's `<tool_call>` blocks, Phi-4-mini's `<|tool_call|>`, Llama
3's `{"name": ..., "parameters": ...}`, plain JSON otherwise) is its entry in
agentrt.tool_formats. With `tool_choice="auto"` plain text is the other option. Chat
templates that take `tools` render the tool definitions and the tool messages themselves;
for templates that do not (SmolLM2's ChatML, Gemma 3), the definitions go into the system
message and tool turns become text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from agentrt.grammar.tools import EXCLUDED_ARGUMENTS
from agentrt.tool_formats import call_format, tool_call_style

# The most calls one reply makes by default: small models asked for parallel calls tend to
# repeat one call until max_tokens; eight covers real fan-outs and bounds that loop.
MAX_PARALLEL_TOOL_CALLS = 8


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)},
        }


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def template_supports_tools(tokenizer) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


@dataclass(slots=True)
class ReplyCalls:
    """The calls of one reply, offered as each closes (`offer`). They end at the first exact
    repeat of a call already made (same name and arguments: a small model asked for
    parallel calls tends to loop on one call) and after `max_calls`; what follows is not
    read. `cut`: the reply ended inside a call, which is dropped (never passed off as text);
    `invalid`: a closed call was not `{"name": ..., "arguments": {...}}`."""

    max_calls: int | None = MAX_PARALLEL_TOOL_CALLS
    calls: list[ToolCall] = field(default_factory=list)
    end: str | None = None  # "repeat" or "cap" once the calls ended early
    cut: bool = False
    invalid: bool = False
    _seen: set[tuple[str, str]] = field(default_factory=set)

    def offer(self, item: Any) -> bool:
        """A closed call (its parsed JSON); True when it is one of the reply's calls."""
        if self.end is not None or self.invalid:
            return False
        calls = _to_calls([item])
        if calls is None:
            self.invalid = True
            return False
        key = (calls[0].name, json.dumps(calls[0].arguments, sort_keys=True))
        if key in self._seen:
            self.end = "repeat"
            return False
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            self.end = "cap"
            return False
        self._seen.add(key)
        self.calls.append(calls[0])
        return True

    def offer_text(self, block: str) -> bool:
        """`offer` of a call's JSON text (one that is not JSON is invalid)."""
        try:
            item = json.loads(block)
        except json.JSONDecodeError:
            item = None
        return self.offer(item)

    def finish_reason(self, reason: str | None) -> str | None:
        """The reply's finish reason, from the engine's: "tool_calls" when it made calls and
        stopped, or its calls ended early (a repeat, the cap: what came after is dropped);
        "length" when max_tokens cut it, inside a call too."""
        if not self.calls or reason not in ("stop", "length"):
            return reason
        return "tool_calls" if reason == "stop" or self.end is not None else reason


def read_call_blocks(
    blocks: list[str], *, max_calls: int | None = MAX_PARALLEL_TOOL_CALLS
) -> ReplyCalls:
    """The calls of a finished reply from their JSON texts (a remote server's calls, or
    `agentrt.reply.Reply.call_blocks`)."""
    calls = ReplyCalls(max_calls)
    for block in blocks:
        calls.offer_text(block)
    return calls


def _to_calls(items: list[Any]) -> list[ToolCall] | None:
    calls = []
    for item in items:
        if not (
            isinstance(item, dict)
            and isinstance(item.get("name"), str)
            and isinstance(item.get("arguments"), dict)
        ):
            return None
        calls.append(ToolCall(new_call_id(), item["name"], item["arguments"]))
    return calls or None


def tools_instructions(tools: list[dict[str, Any]], *, parallel: bool) -> str:
    """System-prompt text that shows the tools to a model whose template cannot."""
    specs = [
        {
            "name": fn["name"],
            "description": fn.get("description", ""),
            "parameters": fn.get("parameters", {"type": "object", "properties": {}}),
        }
        for fn in (t.get("function", t) for t in tools)
    ]
    calls = (
        'a JSON list of calls, [{"name": <tool name>, "arguments": {...}}, ...]'
        if parallel
        else 'a JSON object {"name": <tool name>, "arguments": {...}}'
    )
    return (
        "You can call these tools:\n"
        + json.dumps(specs, ensure_ascii=False)
        + f"\nTo call tools, reply with only {calls}. Tool results come back in messages from "
        "the tool. When you have the answer, reply to the user."
    )


def shown_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The definitions as the model sees them, without grammar-only `excluded_arguments`."""
    return [
        {**t, "function": {k: v for k, v in t["function"].items() if k != EXCLUDED_ARGUMENTS}}
        if EXCLUDED_ARGUMENTS in t.get("function", {})
        else t
        for t in tools
    ]


def render_messages(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    tokenizer,
    *,
    parallel: bool = True,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Messages (OpenAI format, tool calls included) and the tools to hand the chat template.
    Templates that take `tools` get them, and the calls as the family's template reads them
    (`_family_messages`); for others the tools are described in the system message and tool
    turns are rewritten as text (as user turns where the template demands that roles
    alternate: Gemma's). Either way the model sees each tool as defined:
    `excluded_arguments` only narrow the grammar."""
    tools = shown_tools(tools) if tools else tools
    template = getattr(tokenizer, "chat_template", None) or ""
    if template_supports_tools(tokenizer):
        return _family_messages(messages, tools, template, tool_call_style(tokenizer))
    rendered = []
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            calls = [
                {"name": c["function"]["name"], "arguments": _arguments(c["function"])}
                for c in message["tool_calls"]
            ]
            payload = calls if parallel else calls[0]
            rendered.append({"role": "assistant", "content": json.dumps(payload)})
        elif role == "tool":
            name = message.get("name") or message.get("tool_call_id") or "tool"
            rendered.append({"role": "tool", "content": f"[{name}] {message.get('content', '')}"})
        else:
            rendered.append({"role": role, "content": message.get("content") or ""})
    if tools:
        text = tools_instructions(tools, parallel=parallel)
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {"role": "system", "content": rendered[0]["content"] + "\n\n" + text}
        else:
            rendered.insert(0, {"role": "system", "content": text})
    if _ALTERNATE in template:
        rendered = _alternating(rendered)
    return rendered, None


# A template that raises unless user and assistant turns alternate (Gemma's, Llama 2's).
_ALTERNATE = "must alternate user/assistant"
# Phi-4-mini's own template: the tools are a JSON string on the system message.
_SYSTEM_TOOLS = "message['tools']"


def _family_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, template: str, style: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools for a template that takes tools. Qwen's (hermes) takes the
    calls' arguments as JSON text; Llama 3's and Phi-4-mini's write them with `tojson`, so
    they get the arguments as objects. Phi-4-mini's own template reads the tools from the
    system message and writes an assistant turn's content only: the calls go there, in its
    `<|tool_call|>` tags."""
    if style.startswith("hermes"):
        return messages, tools
    fmt = call_format(style)
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            calls = [
                {**c, "function": {**c["function"], "arguments": _arguments(c["function"])}}
                for c in calls
            ]
            message = {**message, "tool_calls": calls}
            if _SYSTEM_TOOLS in template and fmt.tagged:
                blocks = [
                    fmt.open + json.dumps(c["function"], ensure_ascii=False) + fmt.close
                    for c in calls
                ]
                content = (message.get("content") or "") + "".join(blocks)
                message = {"role": "assistant", "content": content}
        out.append(message)
    if tools and _SYSTEM_TOOLS in template:
        functions = json.dumps([t.get("function", t) for t in tools], ensure_ascii=False)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "tools": functions}
        else:
            out.insert(0, {"role": "system", "content": "", "tools": functions})
    return out, tools


def _alternating(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool turns as user turns, and a turn of the same role as the one before it merged
    into it (two tool results in a row), so user and assistant turns alternate."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role = "user" if message["role"] == "tool" else message["role"]
        if out and out[-1]["role"] == role and role != "system":
            out[-1] = {"role": role, "content": out[-1]["content"] + "\n\n" + message["content"]}
        else:
            out.append({"role": role, "content": message["content"]})
    return out


def _arguments(function: dict[str, Any]) -> Any:
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments
