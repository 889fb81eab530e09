"""The reply reader: what one engine request wrote -> its reasoning, its text and its tool
calls, as it streams (`ReplyReader.feed`) or whole (`read_reply`: the same reader fed the
whole reply at once, so a reply streamed and one read whole cannot differ). The SDK backend
(and so the Agent), chat completions, the Responses and the Messages endpoints all read
replies here, and only here.

What a reply may hold comes from its turn (`ReplyShape`): reasoning (the request's
`ReasoningRequest`), tool calls in the served model's style, or calls or an answer in a
format. It is read two ways, by one rule:

- from its token ids where every marker in play is one token of the tokenizer (Qwen3's
  `<think>` / `</think>`, Qwen's `<tool_call>` / `</tool_call>`: agentrt.reply_tokens): a
  marker is its id, so a tag's characters written as ordinary tokens are text, and a
  decoder that skips special tokens loses no tag;
- from its text otherwise: the reasoning split at its markers' text (`_ReasoningInText`), the
  calls scanned from the answer's text (agentrt.reply_calls).

Either way the calls follow `agentrt.tool_calls.ReplyCalls` (an exact repeat or the cap ends
them; a call cut off is dropped, never passed off as text), streamed as OpenAI tool-call
deltas: the first call as it grows, a later one whole once it closed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agentrt.grammar.reasoning import ReasoningSpec
from agentrt.reasoning import ReasoningRequest, count_reasoning_tokens
from agentrt.reply_calls import (
    CallsOrAnswerStreamer,
    TextThenCallsStreamer,
    ToolCallStreamer,
)
from agentrt.reply_tokens import CALL, REASONING, ReplySplitter, reply_markers
from agentrt.tool_calls import MAX_PARALLEL_TOOL_CALLS, ReplyCalls
from agentrt.tool_formats import call_format


@dataclass(frozen=True, slots=True)
class ReplyShape:
    """What a reply may hold: reasoning per `reasoning`; tool calls in `tool_style` (None:
    no tools); with `answer_too`, calls of `tool_names` or an answer in a format; at most
    `max_calls` calls."""

    reasoning: ReasoningRequest = field(default_factory=lambda: ReasoningRequest(None))
    tool_style: str | None = None
    answer_too: bool = False
    tool_names: frozenset[str] = frozenset()
    max_calls: int | None = MAX_PARALLEL_TOOL_CALLS


@dataclass(slots=True)
class ReplyDelta:
    """What one engine delta added: `reasoning` text; the `answer` text as written (call tags
    spelled); that answer read as `content` and OpenAI tool-call deltas (`calls`; with no
    tools the answer is all content); `reasoning_ended`: the reasoning's end came."""

    reasoning: str = ""
    answer: str = ""
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)
    reasoning_ended: bool = False

    def __iadd__(self, other: ReplyDelta) -> ReplyDelta:
        self.reasoning += other.reasoning
        self.answer += other.answer
        self.content += other.content
        self.calls += other.calls
        self.reasoning_ended = self.reasoning_ended or other.reasoning_ended
        return self


@dataclass(slots=True)
class Reply:
    """A finished reply: `reasoning` (None: it did not reason), `text` (the answer as
    written, call tags spelled), `content` (the answer apart from its calls), `calls`
    (None: no tools, plain text, or not calls after all; never `invalid`), `raw_text` (all
    it wrote, markers spelled: what a history re-sends), `num_reasoning_tokens` (markers
    included) and `call_blocks` (the calls' JSON texts, a last one cut off included; None:
    no tools)."""

    reasoning: str | None
    text: str
    content: str
    calls: ReplyCalls | None
    raw_text: str
    num_reasoning_tokens: int = 0
    call_blocks: list[str] | None = None

    def finish_reason(self, reason: str | None) -> str | None:
        """The reply's finish reason from the engine's (`ReplyCalls.finish_reason`)."""
        if self.calls is None or not self.calls.calls:
            return reason
        return self.calls.finish_reason(reason)


class ReplyReader:
    """Feed an engine request's deltas (`feed(text, token_ids)`), then `finish()`; each
    returns a `ReplyDelta`; after `finish`, `reply()` is the whole `Reply`. The detokenizer
    options are the request's (`skip_special_tokens`, `stop`, `include_stop_str_in_output`);
    `prompt_token_ids` prime the decoding of the first part (token ids only)."""

    def __init__(
        self,
        tokenizer: Any,
        shape: ReplyShape,
        *,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.shape = shape
        self.token_ids: list[int] = []
        self.text = ""  # all the reply wrote, as the engine decoded it
        self.read = ReplyDelta()  # all the deltas so far, added up
        self.reasoning_done = False  # the reasoning's end came (or it did not reason)
        self.markers = reply_markers(tokenizer, shape.reasoning.spec, shape.tool_style)
        self.splitter: ReplySplitter | None = None
        self._thinking: _ReasoningInText | None = None  # the reasoning split from the text
        # What reads the answer's text as content and call deltas (None: all content).
        self._calls = _answer_streamer(shape)
        if self.markers is not None:
            self.splitter = ReplySplitter(
                tokenizer,
                self.markers,
                opened=shape.reasoning.opened,
                prompt_token_ids=prompt_token_ids,
                skip_special_tokens=skip_special_tokens,
                stop=stop,
                include_stop_str_in_output=include_stop_str_in_output,
            )
            if self.markers.call_open is not None:  # the calls' text, tags spelled
                self._calls = ToolCallStreamer(shape.tool_style, max_calls=shape.max_calls)
        elif shape.reasoning.spec is not None:
            self._thinking = _ReasoningInText(shape.reasoning.spec, opened=shape.reasoning.opened)

    def feed(self, text: str, token_ids: Sequence[int]) -> ReplyDelta:
        self.token_ids += token_ids
        self.text += text
        if self.splitter is not None:
            return self._add(self._from_pieces(self.splitter.feed(token_ids)))
        if self._thinking is None:
            return self._add(self._answer(ReplyDelta(), text))
        thought, answer = self._thinking.feed(text)
        return self._add(self._answer(ReplyDelta(reasoning=thought), answer))

    def finish(self) -> ReplyDelta:
        """The end of the reply: the text still held back."""
        if self.splitter is not None:
            delta = self._from_pieces(self.splitter.finish())
        elif self._thinking is not None:
            thought, answer = self._thinking.finish()
            delta = self._answer(ReplyDelta(reasoning=thought), answer)
        else:
            delta = ReplyDelta()
        held = self._calls.finish() if self._calls is not None else ""
        delta.content += held
        return self._add(delta)

    def finish_reason(self, reason: str | None) -> str | None:
        """The reply's finish reason from the engine's, after `finish`."""
        if self._calls is None:
            return reason
        return self._calls.finish_reason(reason)

    def reply(self) -> Reply:
        """The whole reply, after `finish`: a reply that made no call (or whose calls are
        not calls) is its text; one that did has the text before its calls as content."""
        if self.splitter is not None:
            reasoning, raw_text = self.splitter.reasoning, self.splitter.raw_text
        else:
            reasoning, raw_text = None, self.text
            if self._thinking is not None and self._thinking.reasoned:
                reasoning = self.read.reasoning
        answer, content, calls, blocks = self.read.answer, self.read.answer, None, None
        if self._calls is not None:
            calls, blocks = self._calls.result()
            if self.splitter is not None and self.markers.call_open is not None:
                blocks = list(self.splitter.calls)
            if calls is not None and not calls.invalid and (calls.calls or calls.cut):
                content = self.read.content.strip()
            else:  # plain text (or not calls after all): all of it is content
                calls = None
        return Reply(reasoning, answer, content, calls, raw_text, self.num_reasoning_tokens, blocks)

    @property
    def in_answer(self) -> bool:
        """The reply is in its answer: past its reasoning, or known not to reason."""
        if self.splitter is not None:
            return not (self.splitter.in_reasoning or self.splitter.may_start_reasoning)
        return self._thinking is None or self._thinking.mode == "answer"

    @property
    def num_reasoning_tokens(self) -> int:
        """Tokens of the reasoning so far (its markers included)."""
        if self.splitter is not None:
            return self.splitter.num_reasoning_tokens
        return count_reasoning_tokens(self.tokenizer, self.token_ids, self.shape.reasoning)

    def _add(self, delta: ReplyDelta) -> ReplyDelta:
        self.read += delta
        return delta

    def _from_pieces(self, pieces: list) -> ReplyDelta:
        delta, call_text = ReplyDelta(), ""
        for piece in pieces:
            if piece.kind == REASONING:
                delta.reasoning += piece.text
                continue
            delta.answer += piece.text
            if piece.kind == CALL or self.markers.call_open is None:
                call_text += piece.text
            else:
                delta.content += piece.text
        if self.splitter.reasoning is not None and not self.splitter.in_reasoning:
            delta.reasoning_ended = not self.reasoning_done
            self.reasoning_done = True
        if call_text and self._calls is None:  # no tools: all content
            delta.content += call_text
        elif call_text and self.markers.call_open is None:  # calls in the answer's text
            content, delta.calls = self._calls.feed(call_text)
            delta.content += content
        elif call_text:
            delta.calls = self._calls.feed(call_text)[1]
        return delta

    def _answer(self, delta: ReplyDelta, answer: str) -> ReplyDelta:
        """`delta` with the answer text `answer`, read as content and call deltas."""
        if self._thinking is not None and self._thinking.saw_end and not self.reasoning_done:
            self.reasoning_done = delta.reasoning_ended = True
        delta.answer = answer
        if self._calls is None:
            delta.content = answer
        elif answer:
            delta.content, delta.calls = self._calls.feed(answer)
        return delta


def _answer_streamer(
    shape: ReplyShape,
) -> ToolCallStreamer | CallsOrAnswerStreamer | TextThenCallsStreamer | None:
    """What reads an answer's text as content and call deltas (None: it is all content)."""
    if shape.tool_style is None:
        return None
    if shape.answer_too:
        return CallsOrAnswerStreamer(
            shape.tool_style, set(shape.tool_names), max_calls=shape.max_calls
        )
    if call_format(shape.tool_style).tagged:  # text may precede the calls
        return TextThenCallsStreamer(shape.tool_style, max_calls=shape.max_calls)
    return ToolCallStreamer(shape.tool_style, max_calls=shape.max_calls)


def read_reply(
    tokenizer: Any,
    shape: ReplyShape,
    text: str,
    token_ids: Sequence[int],
    *,
    prompt_token_ids: Sequence[int] = (),
    skip_special_tokens: bool = True,
    stop: Sequence[str] = (),
    include_stop_str_in_output: bool = False,
) -> Reply:
    """A finished reply (`text`, `token_ids`: the engine's output) read whole: the reader
    fed it in one delta. `tokenizer` may be None for a reply read from its text."""
    reader = ReplyReader(
        tokenizer,
        shape,
        prompt_token_ids=prompt_token_ids,
        skip_special_tokens=skip_special_tokens,
        stop=stop,
        include_stop_str_in_output=include_stop_str_in_output,
    )
    reader.feed(text, token_ids)
    reader.finish()
    return reader.reply()


class _ReasoningInText:
    """A reply's text deltas split into reasoning and answer deltas as they come (the
    reader's way where the markers are not single tokens). `opened`: the reply starts
    inside the reasoning (the template opened it); otherwise it reasons only if it starts
    with the start marker. Text that may be the start of a marker is held back until the
    next delta (or `finish`). The grammar keeps the end marker's text out of the reasoning,
    so its first end marker ends it."""

    def __init__(self, spec: ReasoningSpec, *, opened: bool) -> None:
        self.spec = spec
        self.mode = "reasoning" if opened else None  # None: not yet known
        self.reasoned = opened  # the reply reasoned (the block was open at some point)
        self.saw_end = False
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """Add a delta; returns (reasoning delta, answer delta)."""
        text, self._held = self._held + text, ""
        if self.mode is None:
            stripped = text.lstrip()
            if not stripped or self.spec.start.startswith(stripped):
                self._held = text
                return "", ""
            if stripped.startswith(self.spec.start):
                self.mode, self.reasoned = "reasoning", True
                text = stripped[len(self.spec.start) :]
            else:
                self.mode = "answer"
        if self.mode == "answer":
            return "", text
        at = text.find(self.spec.end)
        if at >= 0:
            self.mode, self.saw_end = "answer", True
            return text[:at], text[at + len(self.spec.end) :]
        keep = _partial_suffix(text, self.spec.end)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], ""

    def finish(self) -> tuple[str, str]:
        """The held-back text, at the end of the reply."""
        held, self._held = self._held, ""
        if self.mode == "reasoning":
            return held, ""
        return "", held


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
