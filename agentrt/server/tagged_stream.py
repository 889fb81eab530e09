"""Streaming a reply that may write text and then `<tool_call>` blocks, with the tags spelled
in ordinary tokens (the "hermes" style of a tokenizer without tag tokens; a tokenizer with
them is read from its token ids, agentrt.reply_tokens).

Under tool_choice "auto" the grammar lets text come before the calls, and the text cannot
hold the opening tag: the first `<tool_call>` opens the first call. So the text streams as
content, holding back only a tail that could still become the tag, and from the tag on the
reply goes to a `ToolCallStreamer`, as a reply that starts with its calls does.
"""

from __future__ import annotations

from typing import Any

from agentrt.server.tool_stream import ToolCallStreamer
from agentrt.tool_calls import MAX_PARALLEL_TOOL_CALLS, OPEN_TAG


class TextThenCallsStreamer:
    """`ToolCallStreamer`'s interface (`feed`, `finish`, `is_tool_calls`) for text, then
    calls, in spelled tags."""

    def __init__(self, *, max_calls: int | None = MAX_PARALLEL_TOOL_CALLS) -> None:
        self.max_calls = max_calls
        self._calls: ToolCallStreamer | None = None  # set once the opening tag came
        self._held = ""  # the text's tail that may start the tag, or is whitespace

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """Add a text delta; returns (content delta, tool-call deltas)."""
        if self._calls is not None:
            return self._calls.feed(text)
        text, self._held = self._held + text, ""
        at = text.find(OPEN_TAG)
        if at >= 0:  # the whitespace before the tag is no content
            self._calls = ToolCallStreamer("hermes", max_calls=self.max_calls)
            _, deltas = self._calls.feed(text[at:])
            return text[:at].rstrip(), deltas
        body = text[: len(text) - _partial_tag(text)].rstrip()
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


def _partial_tag(text: str) -> int:
    """The length of the longest end of `text` that is a proper start of the opening tag."""
    for n in range(min(len(OPEN_TAG) - 1, len(text)), 0, -1):
        if OPEN_TAG.startswith(text[-n:]):
            return n
    return 0
