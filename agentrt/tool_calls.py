"""Tool calls in chat, shared by the SDK and the server.

The reply format is the grammar layer's (`agentrt.grammar` `GrammarSpec.from_tools`): one call
`{"name": ..., "arguments": {...}}`, or with parallel calls a JSON list of them; with
`tool_choice="auto"` plain text (not starting with `{` or `[`) is the other option. Chat
templates that take `tools` (Qwen, Llama 3.1, ...) render the tool definitions and the tool
messages themselves; for templates that do not (SmolLM2's ChatML), the definitions go into the
system message and tool turns become plain text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any


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


def parse_tool_calls(text: str) -> list[ToolCall] | None:
    """The calls in a constrained reply, or None when the reply is plain text."""
    stripped = text.strip()
    if not stripped.startswith(("{", "[")):
        return None
    try:
        payload = json.loads(stripped)
    except json.JSONDecodeError:
        return None
    items = payload if isinstance(payload, list) else [payload]
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


def render_messages(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    tokenizer,
    *,
    parallel: bool = True,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Messages (OpenAI format, tool calls included) and the tools to hand the chat template.
    Templates that take `tools` get everything as is; for others the tools are described in
    the system message and tool turns are rewritten as text."""
    if template_supports_tools(tokenizer):
        return messages, tools
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
    return rendered, None


def _arguments(function: dict[str, Any]) -> Any:
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments
