"""A reply read from its token ids: reasoning, text and tool calls apart, where the markers
are single tokens of the tokenizer (Qwen3's `<think>` / `</think>`, Qwen's `<tool_call>` /
`</tool_call>`, Phi-4-mini's `<|tool_call|>` / `<|/tool_call|>`: agentrt.tool_formats).

Reading the decoded text back for markers fails two ways: a model may write a marker's
characters as ordinary tokens (the prose "<tool_call>" as `<`, `tool`, `_call`, `>`), which
text cannot tell from the marker token; and a tokenizer that marks its tags special loses
them in a decoder that skips special tokens. Token ids have neither problem: a marker is its
id. (vLLM's reasoning parsers test `end_token_id in delta_token_ids`, then split the delta's
text at the marker's text; here each part is decoded on its own, so no text is searched.)

The parts, in order: the `reasoning` (after the start marker, or from the first token when
the template opened the block; up to the end marker), then the answer: `content` text and
`calls`, the JSON text between each `<tool_call>` and its `</tool_call>`. Each part has its
own incremental detokenizer (the engine's, with the request's stop strings), primed with the
tokens before it, so deltas stream as tokens come. Markers add no text of their own; the
answer's `text` spells the call tags back (`<tool_call>` ... `</tool_call>`), so it reads as
the model's own reply.

Content that is only whitespace so far (the "\\n" before a call, between calls) is held back:
it is released when more content follows, or at the end of a reply that made no call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentrt.engine.client.detokenizer import IncrementalDetokenizer
from agentrt.grammar.reasoning import ReasoningSpec, single_token_id
from agentrt.tool_formats import TOKENS, call_format

REASONING, CONTENT, CALL = "reasoning", "content", "call"
_PRIMER_TOKENS = 24  # the detokenizer primes with at most this many tokens before a part


@dataclass(frozen=True, slots=True)
class ReplyMarkers:
    """The marker token ids a reply is split at (None: that marker plays no part)."""

    think_start: int | None = None
    think_end: int | None = None
    call_open: int | None = None
    call_close: int | None = None


def reply_markers(
    tokenizer: Any, reasoning: ReasoningSpec | None, tool_style: str | None
) -> ReplyMarkers | None:
    """The markers of a reply that reasons per `reasoning` (None: it does not) and calls
    tools in `tool_style` (None: no tools), when it is to be read from its token ids: every
    marker in play is one token, and there is at least one. None: read it from its text."""
    if tokenizer is None:  # a reply given as text alone
        return None
    think_start = think_end = call_open = call_close = None
    if reasoning is not None:
        think_start = single_token_id(tokenizer, reasoning.start)
        think_end = single_token_id(tokenizer, reasoning.end)
        if think_start is None or think_end is None:
            return None
    if tool_style is not None and tool_style.endswith(TOKENS):  # "hermes_tokens", "phi4_tokens"
        fmt = call_format(tool_style)
        call_open = single_token_id(tokenizer, fmt.open)
        call_close = single_token_id(tokenizer, fmt.close)
    if think_end is None and call_open is None:
        return None
    return ReplyMarkers(think_start, think_end, call_open, call_close)


@dataclass(frozen=True, slots=True)
class ReplyPiece:
    """A delta of one part: `kind` REASONING, CONTENT or CALL (`index`: the call's number;
    a call's pieces open with `<tool_call>` and close with `</tool_call>`, spelled)."""

    kind: str
    text: str
    index: int = 0


@dataclass(slots=True)
class _Part:
    kind: str
    decoder: IncrementalDetokenizer
    closed: bool = False


class ReplySplitter:
    """Feed a reply's token ids as they come (`feed`), then `finish()`; each returns the
    new pieces. After `finish`: `reasoning` (None: the reply did not reason), `content`,
    `calls` (JSON texts; an unclosed last call is in it too, as far as it got), `text`
    (the answer as written, call tags spelled), `raw_text` (the whole reply as written,
    every marker spelled: what a history re-sends) and `num_reasoning_tokens` (markers
    included).

    `opened`: the prompt opened the reasoning block (the reply starts inside it). The
    detokenizer options are the request's (`skip_special_tokens`, `stop`,
    `include_stop_str_in_output`); `prompt_token_ids` prime the first part."""

    def __init__(
        self,
        tokenizer: Any,
        markers: ReplyMarkers,
        *,
        opened: bool = False,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.markers = markers
        self._options = {
            "skip_special_tokens": skip_special_tokens,
            "stop": tuple(stop),
            "include_stop_str_in_output": include_stop_str_in_output,
        }
        self._ids: list[int] = list(prompt_token_ids)[-_PRIMER_TOKENS:]
        self.reasoning: str | None = None
        self.content = ""
        self.calls: list[str] = []
        self.text = ""
        self.raw_text = ""  # all the reply wrote, every marker spelled
        self.num_reasoning_tokens = 0
        self._answered = False  # content other than whitespace was written
        self._held = ""  # trailing whitespace of the content, not yet released
        self._part = self._open(REASONING) if opened else self._open(CONTENT)
        if opened:
            self.reasoning = ""

    # -- feeding --------------------------------------------------------------------------

    def feed(self, token_ids: Sequence[int]) -> list[ReplyPiece]:
        pieces: list[ReplyPiece] = []
        for token_id in token_ids:
            self._feed_one(token_id, pieces)
            self._ids = (self._ids + [token_id])[-_PRIMER_TOKENS:]
        return [p for p in pieces if p.text]

    def finish(self) -> list[ReplyPiece]:
        """The end of the reply: the current part's last text; whitespace-only content is
        released if no call was made."""
        pieces: list[ReplyPiece] = []
        self._close(pieces)
        held, self._held = self._held, ""
        if held and not self.calls:
            self._emit_content(pieces, held, force=True)
        return [p for p in pieces if p.text]

    def _feed_one(self, token_id: int, pieces: list[ReplyPiece]) -> None:
        m, kind = self.markers, self._part.kind
        if kind == REASONING:
            self.num_reasoning_tokens += 1
            if token_id == m.think_end:
                self._close(pieces)
                self.raw_text += self._spelled(token_id)
                self._part = self._open(CONTENT)
                return
        elif kind == CONTENT:
            if token_id == m.think_start and self._may_start_reasoning():
                self._close(pieces)
                self._held = ""
                self.reasoning = ""
                self.num_reasoning_tokens += 1
                self.raw_text += self._spelled(token_id)
                self._part = self._open(REASONING)
                return
            if token_id == m.call_open:
                self._close(pieces)
                self._part = self._open(CALL)
                self.calls.append("")
                self.raw_text += self._spelled(token_id)
                self._emit(pieces, self._spelled(token_id))
                return
        elif kind == CALL and token_id == m.call_close:
            self._close(pieces)
            self.raw_text += self._spelled(token_id)
            self._emit(pieces, self._spelled(token_id))
            self._part = self._open(CONTENT)
            return
        self._part.decoder.append([token_id])
        self._take(pieces, self._part.decoder.get_delta(streaming=True))

    @property
    def in_reasoning(self) -> bool:
        """The reply is inside its reasoning (it has not reached the end marker yet)."""
        return self._part.kind == REASONING

    @property
    def may_start_reasoning(self) -> bool:
        """A start marker would still open the reasoning (nothing else was written yet)."""
        return self._may_start_reasoning()

    @property
    def in_call(self) -> bool:
        """The reply is (after `finish`: ended) inside a call: its last call never closed."""
        return self._part.kind == CALL

    def _may_start_reasoning(self) -> bool:
        """A start marker opens the block only before anything else was written."""
        return (
            self.markers.think_end is not None
            and self.reasoning is None
            and not self._answered
            and not self.calls
        )

    def _spelled(self, token_id: int) -> str:
        """A marker token's text (an added token's text is its token string)."""
        return self.tokenizer.convert_ids_to_tokens(token_id)

    # -- parts ----------------------------------------------------------------------------

    def _open(self, kind: str) -> _Part:
        decoder = IncrementalDetokenizer(self.tokenizer, self._ids, **self._options)
        return _Part(kind, decoder)

    def _close(self, pieces: list[ReplyPiece]) -> None:
        part = self._part
        if part.closed:
            return
        part.closed = True
        self._take(pieces, part.decoder.get_delta(streaming=False))
        if part.kind == CALL:
            self.calls[-1] = self.calls[-1].strip()

    def _take(self, pieces: list[ReplyPiece], text: str) -> None:
        if not text:
            return
        self.raw_text += text
        kind = self._part.kind
        if kind == REASONING:
            self.reasoning += text
            pieces.append(ReplyPiece(REASONING, text))
        elif kind == CALL:
            self.calls[-1] += text
            self._emit(pieces, text)
        else:
            self.text += text
            self._emit_content(pieces, text)

    def _emit(self, pieces: list[ReplyPiece], text: str) -> None:
        """Answer text of the current call (or a tag)."""
        self.text += text
        pieces.append(ReplyPiece(CALL, text, len(self.calls) - 1))

    def _emit_content(self, pieces: list[ReplyPiece], text: str, *, force: bool = False) -> None:
        """Content text (already in `text`); trailing whitespace waits for what follows."""
        text, self._held = self._held + text, ""
        body = text.rstrip()
        if not force and len(body) < len(text):
            text, self._held = body, text[len(body) :]
        if not text:
            return
        if text.strip():
            self._answered = True
        self.content += text
        pieces.append(ReplyPiece(CONTENT, text))
