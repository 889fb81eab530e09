"""The reply reader: what one engine request wrote -> its reasoning, its text and its tool
calls, as it streams (`ReplyReader`) or whole (`read_reply`). The SDK backend (and so the
Agent), chat completions and the Responses endpoint all read replies here.

What a reply may hold comes from its turn (`ReplyShape`): reasoning (the request's
`ReasoningRequest`), tool calls in the served model's style, or calls or an answer in a
format. It is read two ways, by one rule:

- from its token ids where every marker in play is one token of the tokenizer (Qwen3's
  `<think>` / `</think>`, Qwen's `<tool_call>` / `</tool_call>`: agentrt.reply_tokens): a
  marker is its id, so a tag's characters written as ordinary tokens are text, and a
  decoder that skips special tokens loses no tag;
- from its text otherwise: the reasoning split at its markers' text
  (grammar.reasoning.ReasoningStream), the calls scanned from the answer's text by the tool
  streams (agentrt.reply_calls).

Either way the calls follow `agentrt.tool_calls.ReplyCalls` (an exact repeat or the cap ends
them; a call cut off is dropped, never passed off as text), streamed as OpenAI tool-call
deltas: the first call as it grows, a later one whole once it closed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agentrt.reasoning import ReasoningRequest, count_reasoning_tokens, split
from agentrt.reply_calls import (
    CallsOrAnswerStreamer,
    ReplyKind,
    TextThenCallsStreamer,
    ToolCallStreamer,
)
from agentrt.reply_tokens import CALL, REASONING, ReplySplitter, reply_markers
from agentrt.tool_calls import (
    MAX_PARALLEL_TOOL_CALLS,
    ReplyCalls,
    read_call_blocks,
    read_tool_calls,
)


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


@dataclass(slots=True)
class Reply:
    """A finished reply read whole: `reasoning` (None: it did not reason), `text` (the answer
    as written, call tags spelled), `content` (the answer apart from its calls), `calls`
    (None: no tools, or plain text), `raw_text` (all it wrote, markers spelled: what a
    history re-sends), `num_reasoning_tokens` (markers included) and `call_blocks` (the
    calls' JSON texts where read from token ids, a last one cut off included)."""

    reasoning: str | None
    text: str
    content: str
    calls: ReplyCalls | None
    raw_text: str
    num_reasoning_tokens: int = 0
    call_blocks: list[str] | None = None

    def finish_reason(self, reason: str | None) -> str | None:
        """The reply's finish reason from the engine's (`ReplyCalls.finish_reason`)."""
        if self.calls is None or self.calls.invalid or not self.calls.calls:
            return reason
        return self.calls.finish_reason(reason)


class ReplyReader:
    """Feed an engine request's deltas (`feed(text, token_ids)`), then `finish()`; each
    returns a `ReplyDelta`. The detokenizer options are the request's
    (`skip_special_tokens`, `stop`, `include_stop_str_in_output`); `prompt_token_ids` prime
    the decoding of the first part (token ids only)."""

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
        self.reasoning_done = False  # the reasoning's end came (or it did not reason)
        self.markers = reply_markers(tokenizer, shape.reasoning.spec, shape.tool_style)
        self.splitter: ReplySplitter | None = None
        self._thinking = None  # the reasoning split from the text (ReasoningStream)
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
            # The calls' text, tags spelled, read as deltas; where the call tags are no
            # tokens (the reasoning's are), the calls are read from the answer's text.
            self._calls = ToolCallStreamer("hermes", max_calls=shape.max_calls)
            if self.markers.call_open is None:
                self._calls = _answer_streamer(shape)
        else:
            self._thinking = shape.reasoning.stream()
            self._calls = _answer_streamer(shape)

    def feed(self, text: str, token_ids: Sequence[int]) -> ReplyDelta:
        self.token_ids += token_ids
        if self.splitter is not None:
            return self._from_pieces(self.splitter.feed(token_ids))
        if self._thinking is None:
            return self._answer(ReplyDelta(), text)
        thought, answer = self._thinking.feed(text)
        return self._answer(ReplyDelta(reasoning=thought), answer)

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
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        """The reply's finish reason from the engine's, after `finish`."""
        if self._calls is None:
            return reason
        return self._calls.finish_reason(reason)

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
    if shape.tool_style == "hermes":  # text may precede the calls
        return TextThenCallsStreamer(max_calls=shape.max_calls)
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
    """A finished reply (`text`, `token_ids`: the engine's output) read whole."""
    markers = reply_markers(tokenizer, shape.reasoning.spec, shape.tool_style)
    if markers is not None:
        splitter = ReplySplitter(
            tokenizer,
            markers,
            opened=shape.reasoning.opened,
            prompt_token_ids=prompt_token_ids,
            skip_special_tokens=skip_special_tokens,
            stop=stop,
            include_stop_str_in_output=include_stop_str_in_output,
        )
        splitter.feed(token_ids)
        splitter.finish()
        if shape.tool_style is not None and markers.call_open is None:
            # The reasoning's markers are tokens, the call tags not: calls from the text.
            return _with_calls(
                shape,
                splitter.reasoning,
                splitter.text,
                splitter.raw_text,
                splitter.num_reasoning_tokens,
            )
        calls = None
        if shape.tool_style is not None and splitter.calls:
            calls = read_call_blocks(
                splitter.calls, cut=splitter.in_call, max_calls=shape.max_calls
            )
        return Reply(
            splitter.reasoning,
            splitter.text,
            splitter.content,
            calls,
            splitter.raw_text,
            splitter.num_reasoning_tokens,
            list(splitter.calls) if shape.tool_style is not None else None,
        )
    reasoning, answer = split(text, shape.reasoning)
    num_reasoning = count_reasoning_tokens(tokenizer, list(token_ids), shape.reasoning)
    return _with_calls(shape, reasoning, answer, text, num_reasoning)


def _with_calls(
    shape: ReplyShape, reasoning: str | None, answer: str, raw_text: str, num_reasoning: int
) -> Reply:
    """The reply whose answer is `answer`, its calls read from that text."""
    content, calls = answer, None
    if shape.tool_style is not None and not _is_answer(shape, answer):
        content, calls = read_tool_calls(answer, shape.tool_style, max_calls=shape.max_calls)
        content = answer if calls is None else content
    return Reply(reasoning, answer, content, calls, raw_text, num_reasoning)


def _is_answer(shape: ReplyShape, text: str) -> bool:
    """With an answer format too: whether the reply is the answer, not calls."""
    if not shape.answer_too:
        return False
    kind = ReplyKind(shape.tool_style, set(shape.tool_names))
    kind.feed(text)
    return kind.finish() == "answer"
