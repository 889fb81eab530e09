"""Prompt work a request controls, off the event loop and within a time limit.

Rendering the chat template and tokenizing a prompt take time that grows with what the
client sent (8 MiB of messages, a template loop over them). On the event loop that time
stalls every other request, /health included; so `off_loop` runs it on a worker thread
(at most `MAX_PROMPT_THREADS` at once) and stops it at `MAX_PROMPT_SECONDS`.

The stop is a trace function on that thread (`sys.settrace` applies to the calling thread
only): it checks the deadline at every Python call, and at every line of a Jinja template
(a template's loop may call nothing), and raises `PromptTimeoutError` past it. Native code
(the Rust tokenizer) cannot be stopped midway, so text too long to fit the context at any
tokenization is refused before it is tokenized (`check_text_length`).
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import anyio

from agentrt.engine.errors import ContextLengthError
from agentrt.server.errors import bad_request

T = TypeVar("T")

MAX_PROMPT_SECONDS = 10.0
MAX_PROMPT_THREADS = 4


class PromptTimeoutError(BaseException):
    """Rendering or tokenizing a prompt ran past its time limit. A BaseException, so that
    the `except Exception` around a template call does not take it for a template error."""


def new_limiter() -> anyio.CapacityLimiter:
    """The threads prompt work may use at once (one per server, made on its event loop)."""
    return anyio.CapacityLimiter(MAX_PROMPT_THREADS)


async def off_loop(
    limiter: anyio.CapacityLimiter,
    fn: Callable[..., T],
    *args: Any,
    timeout_s: float | None = None,
) -> T:
    """`fn(*args)` on a worker thread, stopped after `timeout_s` (default MAX_PROMPT_SECONDS;
    a 400 for the request)."""
    timeout_s = MAX_PROMPT_SECONDS if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    try:
        return await anyio.to_thread.run_sync(
            functools.partial(_run_until, deadline, fn, *args), limiter=limiter
        )
    except PromptTimeoutError:
        raise bad_request(
            f"the prompt took longer than {timeout_s:g} s to render and tokenize; send "
            "shorter messages.",
            param="messages",
        ) from None


def check_text_length(text: str, max_model_len: int, max_token_chars: int) -> None:
    """Refuse, before tokenizing it, text longer than any `max_model_len` tokens can be: each
    token spells at most `max_token_chars` chars (twice that, for normalizers that shorten
    text). Tokenizing 8 MiB takes seconds, and the answer would be the same."""
    limit = 2 * max_model_len * max(1, max_token_chars)
    if len(text) > limit:
        raise ContextLengthError(
            f"the prompt has {len(text)} characters, more than {max_model_len} tokens of this "
            f"model can hold (at most {limit}); shorten it.",
            field="prompt",
        )


def max_token_chars(tokenizer: Any) -> int:
    """The longest token of `tokenizer`'s vocabulary, in chars of its vocabulary strings
    (byte-level tokens spell each byte as one char, so this bounds the decoded text too)."""
    vocab = tokenizer.get_vocab()
    return max((len(token) for token in vocab), default=1)


def _run_until(deadline: float, fn: Callable[..., T], *args: Any) -> T:
    def on_line(frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise PromptTimeoutError
        return on_line

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise PromptTimeoutError
        # Jinja compiles templates to Python code named after the template ("<template>").
        return on_line if frame.f_code.co_filename.startswith("<") else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        return fn(*args)
    finally:
        sys.settrace(previous)
