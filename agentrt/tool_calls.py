"""Tool calls in chat, shared by the SDK and the server.

Reply styles, chosen from the chat template and the tokenizer:
- "hermes", when the template defines `<tool_call>` (Qwen 2.5 / 3, Hermes): the model's own
  format, one `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` block per call.
  "hermes_tokens" is the same format where the tokenizer has both tags as single tokens (Qwen's
  151657 / 151658): the grammar then names those tokens, the ones the model was trained to
  write, and the tags come back in the decoded text (they are not skipped as special).
- "json" otherwise (the grammar layer's `GrammarSpec.from_tools`): one call
  `{"name": ..., "arguments": {...}}`, or with parallel calls a JSON list of them.
With `tool_choice="auto"` plain text is the other option. Chat templates that take `tools`
render the tool definitions and the tool messages themselves; for templates that do not
(SmolLM2's ChatML), the definitions go into the system message and tool turns become text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from agentrt.grammar import GrammarSpec
from agentrt.grammar.reasoning import single_token_id
from agentrt.grammar.tools import (
    EXCLUDED_ARGUMENTS,
    CallTags,
    tagged_calls_lark,
    tool_call_spec_text,
)

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
# The most calls one reply makes by default: small models asked for parallel calls tend to
# repeat one call until max_tokens; eight covers real fan-outs and bounds that loop.
MAX_PARALLEL_TOOL_CALLS = 8
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


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


def tool_call_style(tokenizer) -> str:
    """The reply style for this tokenizer's chat template: "hermes_tokens", "hermes" or
    "json"."""
    if OPEN_TAG not in (getattr(tokenizer, "chat_template", None) or ""):
        return "json"
    return (
        "hermes_tokens"
        if all(_single_token(tokenizer, t) for t in (OPEN_TAG, CLOSE_TAG))
        else ("hermes")
    )


def _single_token(tokenizer, text: str) -> bool:
    return single_token_id(tokenizer, text) is not None


def hermes_spec(
    tools: list[dict[str, Any]],
    tool_choice: Any,
    *,
    parallel: bool,
    special: bool = False,
    max_calls: int | None = MAX_PARALLEL_TOOL_CALLS,
) -> GrammarSpec:
    """The grammar of `<tool_call>` blocks (llguidance Lark with an embedded JSON schema per
    call; `special`: the tags are the tokenizer's own single tokens; at most `max_calls`
    blocks, None: no cap); under "auto", plain text that does not start with `<tool_call>`
    is the alternative. Raises the grammar layer's GrammarSpecError for bad tools or an
    unknown tool_choice."""
    canonical, choice = tool_call_spec_text(tools, tool_choice)
    if choice == "none":
        return GrammarSpec.any_text()
    tags = CallTags(OPEN_TAG, CLOSE_TAG, open_special=special, close_special=special)
    lark = tagged_calls_lark(canonical, choice, parallel=parallel, tags=tags, max_calls=max_calls)
    return GrammarSpec.from_ebnf(lark)


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
    blocks: list[str], *, cut: bool = False, max_calls: int | None = MAX_PARALLEL_TOOL_CALLS
) -> ReplyCalls:
    """The calls of a finished reply from their JSON texts (`cut`: the last one never
    closed)."""
    calls = ReplyCalls(max_calls)
    for block in blocks[:-1] if cut and blocks else blocks:
        calls.offer_text(block)
    calls.cut = cut
    return calls


def starts_tool_calls(text: str, style: str = "json") -> bool:
    """Whether a reply begins like a call payload of `style` rather than plain text."""
    openers = (OPEN_TAG,) if style.startswith("hermes") else ("{", "[", OPEN_TAG)
    return text.lstrip().startswith(openers)


def parse_tool_calls(text: str, style: str = "json") -> list[ToolCall] | None:
    """The calls of a constrained reply read from its text (`read_tool_calls`), or None
    when it made none."""
    calls = read_tool_calls(text, style)[1]
    return calls.calls if calls is not None and calls.calls else None


def read_tool_calls(
    text: str, style: str = "json", *, max_calls: int | None = MAX_PARALLEL_TOOL_CALLS
) -> tuple[str, ReplyCalls | None]:
    """(content, calls) of a constrained reply read from its text; calls None when it is
    plain text (content is then the whole text). Under a hermes style the calls are the
    `<tool_call>` blocks from the first opening tag on, and the text before it is the
    content ("Let me check." then a call); plain text may start with `{`. The "json" style
    reads a reply that is one call payload, or a list of them: one cut off keeps the calls
    it completed. (A tokenizer whose tags are single tokens is read from the token ids
    instead: agentrt.reply_tokens.)"""
    stripped = text.strip()
    calls = ReplyCalls(max_calls)
    if style.startswith("hermes") or stripped.startswith(OPEN_TAG):
        at = stripped.find(OPEN_TAG)
        if at < 0:
            return text, None
        blocks = _HERMES_CALL.findall(stripped[at:])
        for block in blocks:
            calls.offer_text(block)
        calls.cut = stripped.count(OPEN_TAG, at) > len(blocks)
        if calls.invalid or not (calls.calls or calls.cut):
            return text, None
        return stripped[:at].strip(), calls
    if not stripped.startswith(("{", "[")):
        return text, None
    try:
        payload = json.loads(stripped)
    except json.JSONDecodeError:
        items, calls.cut = _complete_items(stripped), True
    else:
        items = payload if isinstance(payload, list) else [payload]
    for item in items:
        calls.offer(item)
    if calls.invalid or not (calls.calls or calls.cut):
        return text, None
    return "", calls


def _complete_items(text: str) -> list[Any]:
    """The items a JSON list cut off completed (none for anything else)."""
    if not text.startswith("["):
        return []
    decoder, items, at = json.JSONDecoder(), [], 1
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        try:
            item, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return items
        items.append(item)


def parse_call_blocks(blocks: list[str]) -> list[ToolCall] | None:
    """The calls of `{"name": ..., "arguments": {...}}` texts (one per tagged block), or
    None when one is not such a call."""
    try:
        items = [json.loads(block) for block in blocks]
    except json.JSONDecodeError:
        return None
    return _to_calls(items)


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
    Templates that take `tools` get everything as is; for others the tools are described in
    the system message and tool turns are rewritten as text. Either way the model sees
    each tool as defined: `excluded_arguments` only narrow the grammar."""
    tools = shown_tools(tools) if tools else tools
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
