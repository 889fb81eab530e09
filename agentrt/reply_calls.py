"""The tool calls in a reply's text, read as it grows: OpenAI tool-call deltas and the
content around them (the text parts of agentrt.reply's reader).

The grammar makes a reply either plain text (under `tool_choice="auto"`) or calls, in one
of the styles of `agentrt.tool_formats`: bare JSON ("json": one call `{"name": ...,
"arguments": {...}}` or a list of them; "llama3": one call, its arguments under
"parameters"; text then never starts with `{` or `[`), or tagged ("hermes", "phi4"), one
`<tool_call>\n{...}\n</tool_call>` block per call (text never starts with the opening
tag; it may start with `<`, so the mode waits while the text so far could still become the
tag).

- `ToolCallStreamer` scans the JSON incrementally (strings, escapes and nesting depth; the
  tags between blocks hold no JSON punctuation, so they pass through the same scan)
  and turns it into OpenAI's deltas: the first delta of a call carries its `id`, `type` and
  `name`; later ones append raw text to `function.arguments`, so the client's concatenation
  is the arguments' JSON text. The first call streams as it grows; each later one is held
  until it closes, then sent whole if it is one of the reply's calls (`ReplyCalls`: an exact
  repeat of an earlier call, or one past the cap, ends the calls and nothing after it is
  sent). A call cut off by the reply's end is never released as text.
- `TextThenCallsStreamer`: text, then calls in spelled tags (a tokenizer without tag
  tokens). Under "auto" the text cannot hold the opening tag, so the first `<tool_call>`
  opens the first call: the text streams as content, holding back only a tail that could
  still become the tag, and from the tag on the reply goes to a `ToolCallStreamer`.
- `ReplyKind` / `CallsOrAnswerStreamer`: tools and an answer format together (the grammar
  of agentrt.server.calls_or_answer): a reply that starts like a call of the tools is
  calls, any other is the answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from agentrt.tool_calls import MAX_PARALLEL_TOOL_CALLS, ReplyCalls, new_call_id
from agentrt.tool_formats import call_format

# A compact call in the "json" style starts with exactly this (`COMPACT_JSON` separators).
_CALL_HEAD = '{"name": "'


@dataclass(slots=True)
class _Call:
    start: int  # offset of the call object in the text
    id: str = field(default_factory=new_call_id)
    name: str | None = None
    args_start: int | None = None  # offset of the arguments value in the text
    args_end: int | None = None  # one past its end, once closed
    end: int | None = None  # one past the call object's end, once closed
    offered: bool = False  # given to `ReplyCalls` (once closed)
    counted: bool = True  # one of the reply's calls (False: a repeat, or past the cap)
    sent_header: bool = False
    sent_args: int = 0  # characters of the arguments already sent


class ToolCallStreamer:
    """Feed text deltas; get content deltas (plain-text replies) or tool-call deltas."""

    def __init__(
        self, style: str = "json", *, max_calls: int | None = MAX_PARALLEL_TOOL_CALLS
    ) -> None:
        fmt = call_format(style)
        self.opening = fmt.open  # None: bare JSON
        self.arguments_key = fmt.arguments_key  # "parameters" in Llama 3's calls
        self.reply_calls = ReplyCalls(max_calls)
        self.text = ""
        self.mode: str | None = None  # None until the first non-space character: "text" / "json"
        self.calls: list[_Call] = []
        self._pos = 0  # next character to scan
        self._depth = 0
        self._call_depth = 1  # depth of a call object: 1, or 2 inside a list
        self._in_string = False
        self._escape = False
        self._string_start = 0
        self._last_string: str | None = None  # last closed string at the call's depth
        self._key: str | None = None  # key whose value comes next (at the call's depth)
        self._value_key: str | None = None  # key whose value is being read

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """Add a text delta; returns (content delta, tool-call deltas)."""
        self.text += text
        if self.mode is None:
            stripped = self.text.lstrip()
            if not stripped:
                return "", []
            if self.opening is None:
                self.mode = "json" if stripped[0] in "{[" else "text"
            elif stripped.startswith(self.opening):
                self.mode = "json"
            elif self.opening.startswith(stripped):
                return "", []  # `<tool` may still become the tag
            else:
                self.mode = "text"
            if self.mode == "text":
                return self.text, []
            if stripped[0] == "[":
                self._call_depth = 2
        elif self.mode == "text":
            return text, []
        self._scan()
        return "", self._deltas()

    def finish(self) -> str:
        """At the reply's end: the text no delta has carried, as plain text: all of it when
        the reply stopped while it could still have become a call (`<tool` or spaces only);
        nothing once a call opened (a call cut off is not text)."""
        if self.mode is not None:
            return ""
        self.mode = "text"  # no call after all
        return self.text

    @property
    def is_tool_calls(self) -> bool:
        return self.mode == "json"

    def finish_reason(self, reason: str | None) -> str | None:
        """The reply's finish reason from the engine's (`ReplyCalls.finish_reason`)."""
        if self.reply_calls.calls:
            return self.reply_calls.finish_reason(reason)
        return "tool_calls" if self.is_tool_calls and reason == "stop" else reason

    def result(self) -> tuple[ReplyCalls | None, list[str]]:
        """After `finish`: the reply's calls (None: it is text) and the JSON texts of the
        calls it wrote (a last one cut off included). `cut`: a call never closed (inside
        its JSON, or after its opening tag)."""
        if self.mode != "json":
            return None, []
        num_closed = sum(call.end is not None for call in self.calls)
        self.reply_calls.cut = self._depth > 0 or (
            self.opening is not None and self.text.count(self.opening) > num_closed
        )
        blocks = [self.text[c.start : c.end or len(self.text)] for c in self.calls]
        if self.arguments_key != "arguments":  # as OpenAI names the key
            blocks = [_openai_block(block, self.arguments_key) for block in blocks]
        return self.reply_calls, blocks

    def _scan(self) -> None:
        text = self.text
        while self._pos < len(text):
            i, ch = self._pos, text[self._pos]
            self._pos += 1
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
                    self._close_string(i)
                continue
            if ch == '"':
                self._in_string = True
                self._string_start = i
                self._open_value(i)
            elif ch in "{[":
                self._open_value(i)
                self._depth += 1
                if ch == "{" and self._depth == self._call_depth:
                    self.calls.append(_Call(start=i))
            elif ch in "}]":
                self._depth -= 1
                self._close_container(i)
                if ch == "}" and self._depth == self._call_depth - 1 and self.calls:
                    self.calls[-1].end = i + 1
            elif ch == ":" and self._depth == self._call_depth:
                self._key = self._last_string
            elif not ch.isspace() and ch != ",":
                self._open_value(i)  # a number / literal value (not part of a call)

    def _open_value(self, i: int) -> None:
        """A value starts at text[i]; if it follows a key of the current call, note it."""
        if self._depth != self._call_depth or self._key is None or not self.calls:
            return
        self._value_key, self._key = self._key, None
        if self._value_key == self.arguments_key:
            self.calls[-1].args_start = i

    def _close_string(self, i: int) -> None:
        value = self.text[self._string_start : i + 1]
        if self._depth != self._call_depth or not self.calls:
            return
        if self._value_key == "name":
            self.calls[-1].name = json.loads(value)
            self._value_key = None
        elif self._value_key == self.arguments_key:  # arguments given as a string value
            self.calls[-1].args_end = i + 1
            self._value_key = None
        else:
            self._last_string = json.loads(value)

    def _close_container(self, i: int) -> None:
        key = self.arguments_key
        if self._depth == self._call_depth and self._value_key == key and self.calls:
            self.calls[-1].args_end = i + 1
            self._value_key = None

    def _deltas(self) -> list[dict[str, Any]]:
        deltas = []
        for index, call in enumerate(self.calls):
            if call.end is not None and not call.offered:
                call.offered = True
                call.counted = self._offer(call) or index == 0  # the first one streamed
            if not call.counted:
                break  # the reply's calls ended before this one
            if call.name is None or (index > 0 and call.end is None):
                continue  # a later call is sent once closed (it may be a repeat)
            if not call.sent_header:
                call.sent_header = True
                deltas.append(
                    {
                        "index": index,
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
            if call.args_start is None:
                continue
            end = call.args_end if call.args_end is not None else len(self.text)
            fragment = self.text[call.args_start + call.sent_args : end]
            if fragment:
                call.sent_args += len(fragment)
                deltas.append({"index": index, "function": {"arguments": fragment}})
        return deltas

    def _offer(self, call: _Call) -> bool:
        """Whether a closed call is one of the reply's (`ReplyCalls.offer`)."""
        try:
            item = json.loads(self.text[call.start : call.end])
        except json.JSONDecodeError:
            item = None
        return self.reply_calls.offer(_as_openai(item, self.arguments_key))


def _as_openai(item: Any, arguments_key: str) -> Any:
    """A call object with its arguments under "arguments" (Llama 3 writes "parameters")."""
    if arguments_key == "arguments" or not isinstance(item, dict):
        return item
    return {("arguments" if k == arguments_key else k): v for k, v in item.items()}


def _openai_block(block: str, arguments_key: str) -> str:
    """A call's JSON text with its arguments under "arguments" (one cut off: as it is)."""
    try:
        return json.dumps(_as_openai(json.loads(block), arguments_key))
    except json.JSONDecodeError:
        return block


class TextThenCallsStreamer:
    """`ToolCallStreamer`'s interface (`feed`, `finish`, `is_tool_calls`) for text, then
    calls, in spelled tags."""

    def __init__(
        self, style: str = "hermes", *, max_calls: int | None = MAX_PARALLEL_TOOL_CALLS
    ) -> None:
        self.style = style
        self.tag = call_format(style).open
        self.max_calls = max_calls
        self._calls: ToolCallStreamer | None = None  # set once the opening tag came
        self._held = ""  # the text's tail that may start the tag, or is whitespace

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """Add a text delta; returns (content delta, tool-call deltas)."""
        if self._calls is not None:
            return self._calls.feed(text)
        text, self._held = self._held + text, ""
        at = text.find(self.tag)
        if at >= 0:  # the whitespace before the tag is no content
            self._calls = ToolCallStreamer(self.style, max_calls=self.max_calls)
            _, deltas = self._calls.feed(text[at:])
            return text[:at].rstrip(), deltas
        body = text[: len(text) - _partial_tag(text, self.tag)].rstrip()
        self._held = text[len(body) :]
        return body, []

    def finish(self) -> str:
        """At the reply's end: the text still held (no call came), or what the calls held."""
        if self._calls is not None:
            return self._calls.finish()
        held, self._held = self._held, ""
        return held

    @property
    def is_tool_calls(self) -> bool:
        return self._calls is not None and self._calls.is_tool_calls

    def finish_reason(self, reason: str | None) -> str | None:
        return reason if self._calls is None else self._calls.finish_reason(reason)

    def result(self) -> tuple[ReplyCalls | None, list[str]]:
        return (None, []) if self._calls is None else self._calls.result()


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


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
        if call_format(self.tool_style).tagged:
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

    def result(self) -> tuple[ReplyCalls | None, list[str]]:
        return self._calls.result() if self.kind == "calls" else (None, [])


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
