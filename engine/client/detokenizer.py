"""Incremental detokenization with stop strings (vLLM's detokenizer, one request at a time).

Text is produced by the fast tokenizer's streaming decoder (`tokenizers.decoders.DecodeStream`),
which buffers tokens until they decode to complete UTF-8: a character split across byte-level
or byte-fallback (`<0xE4>`) tokens is emitted once, whole, and never as U+FFFD. Tokenizers
without a Rust backend get the same prefix/read-offset algorithm in Python.

The stream is primed with a few prompt tokens so the first output token decodes in context
(a SentencePiece `▁Hello` after a prompt is ` Hello`, as in vLLM). For byte-level BPE
tokenizers (SmolLM2, Llama 3, Qwen) the concatenated output equals
`tokenizer.decode(output_token_ids)` exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentrt.engine.errors import EngineError

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens used to prime the stream: the shortest suffix of at least this many tokens
# that decodes cleanly (vLLM's choice), looking back at most `_MAX_PRIMER_TOKENS`.
_MIN_PRIMER_TOKENS = 4
_MAX_PRIMER_TOKENS = 24
# tokenizers' DecodeStream raises a bare `Exception` when earlier text changed: its message is
# the only thing that tells this case from a real failure (vLLM matches it the same way).
_INVALID_PREFIX = "Invalid prefix encountered"


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text deltas and detects stop strings.

    Usage per engine step: `stop = append(new_token_ids)`, then `get_delta(streaming)`.
    Invariants: text handed out by `get_delta(streaming=True)` is never retracted: it holds
    back the longest tail of the text that is a proper prefix of a stop string (at most
    `max(len(stop)) - 1` chars, vLLM's stop buffer, but only chars that could still become a
    stop string). Stop strings are searched only in new text plus `len(stop) - 1` chars back.
    Both cost time linear in the new text (per stop string): the held tail is tracked by a
    KMP automaton per stop string (`_PrefixTracker`), never recomputed from the stop.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool,
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.token_ids: list[int] = []  # every appended output token id
        self.stop_reason: str | None = None  # the stop string that matched, if any
        self._tokenizer = tokenizer
        # What `DecodeStream.step` wants: the Rust tokenizer (or ours for `PyDecodeStream`).
        self._step_tokenizer = _backend(tokenizer) or tokenizer
        self._text = ""  # decoded output, truncated at the stop string once one matched
        self._num_sent = 0  # chars of `_text` already returned by `get_delta`
        self._num_decoded_tokens = 0  # token_ids[:n] are fully represented in `_text`
        self._released = False  # the final `get_delta(streaming=False)` happened
        self._trackers = [_PrefixTracker(stop) for stop in self.stop]
        self._stream = _make_stream(
            tokenizer,
            _primer(tokenizer, prompt_token_ids, skip_special_tokens),
            skip_special_tokens,
        )

    @property
    def output_text(self) -> str:
        """All text so far (without a trailing incomplete UTF-8 sequence before the final
        release), truncated at the stop string, which is kept only if
        `include_stop_str_in_output`."""
        return self._text

    @property
    def finished(self) -> bool:
        """True once a stop string matched or the final `get_delta(streaming=False)` ran."""
        return self.stop_reason is not None or self._released

    def append(self, token_ids: Sequence[int]) -> str | None:
        """Add generated tokens; return the stop string they completed, else None.

        When a stop string matches, the text is cut there and the output ends with the token
        that completed it: the remaining tokens of this call (one step may bring several:
        jump-forward, accepted drafts) and of any later call are dropped, so the output is
        the same as if the tokens had come one per step. Appending after the final release
        raises `EngineError`.
        """
        if self._released:
            raise EngineError(
                "append() after get_delta(streaming=False): that call is the final one for a "
                "request; use streaming=True while tokens may still come."
            )
        if self.stop_reason is not None:
            return None
        for token_id in token_ids:
            self.token_ids.append(token_id)
            chunk = self._step(token_id)
            if not chunk:
                continue
            old_len = len(self._text)
            self._add_text(chunk)
            self._num_decoded_tokens = len(self.token_ids)
            if self.stop and self._check_stop(old_len):
                return self.stop_reason
        return None

    def _add_text(self, chunk: str) -> None:
        self._text += chunk
        for tracker in self._trackers:
            tracker.feed(chunk)

    def get_delta(self, streaming: bool) -> str:
        """Text not returned before.

        `streaming=True` (more tokens may come): holds back the stop buffer, so delivered text
        is never retracted. `streaming=False` is the final call (finished request, or the only
        call of a non-streaming one): releases everything, including a trailing incomplete
        UTF-8 sequence decoded as `tokenizer.decode` would (with U+FFFD).
        """
        if not streaming and not self._released:
            self._released = True
            if self.stop_reason is None:
                self._flush_incomplete()
        end = len(self._text)
        if streaming and not self.finished:
            end = max(self._num_sent, end - self._num_chars_to_hold())
        delta = self._text[self._num_sent : end]
        self._num_sent = end
        return delta

    def _num_chars_to_hold(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        return max((tracker.num_matched for tracker in self._trackers), default=0)

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._step_tokenizer, token_id)
        except (OverflowError, TypeError):
            return None  # an id the tokenizer cannot represent adds no text
        except Exception as error:
            if not str(error).startswith(_INVALID_PREFIX):
                raise
            # The decoder changed earlier text (non-monotonic output): restart unprimed.
            self._stream = _make_stream(self._tokenizer, [], self.skip_special_tokens)
            return self._stream.step(self._step_tokenizer, token_id)

    def _check_stop(self, old_len: int) -> bool:
        """Look for stop strings overlapping text added after `old_len` chars; on a match cut
        the text and set `stop_reason`. Picks the match that ends first (then the longest),
        which is what token-by-token appends would find, however tokens are grouped."""
        best: tuple[int, int, str] | None = None  # (end, -len, stop string)
        for stop in self.stop:
            index = self._text.find(stop, max(0, old_len - len(stop) + 1))
            if index >= 0:
                candidate = (index + len(stop), -len(stop), stop)
                best = candidate if best is None or candidate < best else best
        if best is None:
            return False
        end, neg_len, stop = best
        self._text = self._text[: end if self.include_stop_str_in_output else end + neg_len]
        self.stop_reason = stop
        return True

    def _flush_incomplete(self) -> None:
        """Decode tokens the stream still buffers (an unfinished UTF-8 sequence)."""
        pending = self.token_ids[self._num_decoded_tokens :]
        if not pending:
            return
        start = max(0, self._num_decoded_tokens - _MIN_PRIMER_TOKENS)
        context = self.token_ids[start : self._num_decoded_tokens]  # decodes cleanly
        tail = self._decode(context + pending)[len(self._decode(context)) :]
        if tail:
            old_len = len(self._text)
            self._add_text(tail)
            self._num_decoded_tokens = len(self.token_ids)
            if self.stop:
                self._check_stop(old_len)

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)


class _PrefixTracker:
    """The longest tail of a growing text that is a proper prefix of `stop` (Knuth-Morris-
    Pratt): `feed` costs amortised O(1) per char, where recomputing the tail from the stop
    string cost O(len(stop)^2) per step (20 s for 32 tokens with a 200,000-char stop)."""

    __slots__ = ("_stop", "_fail", "num_matched")

    def __init__(self, stop: str) -> None:
        self._stop = stop
        # _fail[i]: the longest proper prefix of stop[: i + 1] that is also its suffix.
        fail = [0] * len(stop)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            fail[i] = k
        self._fail = fail
        self.num_matched = 0  # chars of the text's tail that match a prefix of `stop`

    def feed(self, text: str) -> None:
        stop, fail, k = self._stop, self._fail, self.num_matched
        for char in text:
            if k == len(stop):  # a whole match: keep its longest proper border
                k = fail[k - 1]
            while k and char != stop[k]:
                k = fail[k - 1]
            if char == stop[k]:
                k += 1
        # A whole match ends the request (_check_stop); the hold is of proper prefixes only.
        self.num_matched = fail[k - 1] if k == len(stop) else k


def _backend(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer, or None."""
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(
        tokenizer, "_tokenizer", None
    )
    return backend if isinstance(backend, Tokenizer) else None


def _primer(
    tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool
) -> list[int]:
    """The shortest prompt suffix (>= 4 tokens) that decodes without U+FFFD, or [] if none."""
    prompt = list(prompt_token_ids)
    shortest = min(len(prompt), _MIN_PRIMER_TOKENS)
    for length in range(shortest, min(len(prompt), _MAX_PRIMER_TOKENS) + 1):
        suffix = prompt[len(prompt) - length :]
        text = tokenizer.decode(suffix, skip_special_tokens=skip_special_tokens)
        if REPLACEMENT_CHAR not in text:
            return suffix
    return []


def _make_stream(tokenizer: Any, primer: list[int], skip_special_tokens: bool) -> Any:
    if _backend(tokenizer) is not None:
        from tokenizers.decoders import DecodeStream

        return DecodeStream(ids=primer or None, skip_special_tokens=skip_special_tokens)
    return PyDecodeStream(primer, skip_special_tokens=skip_special_tokens)


class PyDecodeStream:
    """`DecodeStream` in Python for tokenizers without a Rust backend: decode the window
    `ids[prefix_offset:]`, emit what extends the already emitted `ids[prefix_offset:read_offset]`
    unless it ends in U+FFFD (an incomplete character), then slide the window."""

    def __init__(self, primer: list[int], *, skip_special_tokens: bool) -> None:
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(primer)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def step(self, tokenizer: Any, token_id: int) -> str | None:
        self._ids.append(token_id)
        window = self._ids[self._prefix_offset :]
        prefix = tokenizer.decode(
            window[: self._read_offset - self._prefix_offset],
            skip_special_tokens=self._skip_special_tokens,
        )
        text = tokenizer.decode(window, skip_special_tokens=self._skip_special_tokens)
        if len(text) <= len(prefix) or text.endswith(REPLACEMENT_CHAR):
            return None
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return text[len(prefix) :]
