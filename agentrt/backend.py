"""Backends: where a Session's turns run. `LocalBackend` drives a local `AsyncEngine` (its core
on a thread or in engine processes);
a remote backend speaks the OpenAI API. Both stream text deltas and end with a `Completion`,
so Session, Agent and extraction code is the same for either."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from agentrt.engine.client.async_engine import AsyncEngine
from agentrt.engine.client.outputs import RequestOutput
from agentrt.engine.errors import ErrorCode, InvalidRequestError
from agentrt.engine.sampling_params import SamplingParams
from agentrt.formats import OutputFormat
from agentrt.reasoning import (
    REASONING_OPTIONS,
    ReasoningText,
)
from agentrt.reply import Reply
from agentrt.tool_calls import ReplyCalls
from agentrt.tool_formats import tool_call_style
from agentrt.turn import ChatConstraint, prepare_turn, reasoning_mode

# The SDK decodes greedily unless told otherwise: structured replies from small models are
# most reliable that way, and runs are reproducible.
DEFAULT_SAMPLING: dict[str, Any] = {"temperature": 0.0, "max_tokens": 512}
SAMPLING_OPTIONS = frozenset(
    f.name for f in dataclasses.fields(SamplingParams) if f.name not in ("n", "structured_outputs")
)


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    completion_tokens: int = 0
    reasoning_tokens: int = 0  # of the completion tokens, those of the reasoning block

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.prompt_tokens + other.prompt_tokens,
            self.cached_tokens + other.cached_tokens,
            self.completion_tokens + other.completion_tokens,
            self.reasoning_tokens + other.reasoning_tokens,
        )


@dataclass(slots=True)
class Completion:
    """A finished reply: text, why it ended ("stop", "length", "error", "abort"), usage, the
    engine's problems with it (`error` and `error_code` when it ended with "error";
    `structured_errors` from the final check of a constrained output, empty = valid), and
    how many final tokens the grammar steered to close it before max_tokens. A reply that
    reasoned has its `reasoning` apart: `text` is the answer, `raw_text` all it wrote."""

    text: str
    finish_reason: str | None
    usage: Usage
    error: str | None = None
    error_code: ErrorCode | None = None
    structured_errors: list[str] | None = None
    num_steered_tokens: int = 0
    reasoning: str | None = None
    raw_text: str | None = None
    # A tools reply: the text apart from its calls (a sentence before a call; the whole text
    # when it made none), and the calls' JSON texts where they were read from token ids or
    # received as calls (None: parse them from `text`).
    content: str | None = None
    calls: list[str] | None = None


class Backend(Protocol):
    def stream(
        self, messages: list[dict], fmt: OutputFormat, sampling: dict[str, Any]
    ) -> AsyncIterator[str | Completion]:
        """Text deltas of one reply (those of its reasoning as `ReasoningText`), then its
        `Completion` (always last)."""

    async def stats(self) -> Any: ...


# OpenAI's `reasoning_effort`: "none" and "minimal" turn a reasoning model's thinking off, any
# other effort on (where `reasoning=` is not given); a model without reasoning ignores it.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def reasoning_options(sampling: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`sampling` without the reasoning options, and those options (`reasoning`,
    `max_reasoning_tokens`, `reasoning_parser`, `reasoning_effort`); raises
    InvalidRequestError for an unknown effort."""
    names = (*REASONING_OPTIONS, "reasoning_effort")
    options = {name: sampling[name] for name in names if name in sampling}
    effort = options.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise InvalidRequestError(
            f"reasoning_effort={effort!r} is invalid: expected one of {list(REASONING_EFFORTS)}.",
            field="reasoning_effort",
        )
    return {k: v for k, v in sampling.items() if k not in names}, options


def check_sampling(sampling: dict[str, Any]) -> dict[str, Any]:
    """SDK defaults overlaid with the caller's options; unknown names are rejected."""
    unknown = sorted(set(sampling) - SAMPLING_OPTIONS)
    if unknown:
        raise InvalidRequestError(
            f"unknown sampling options {unknown}: expected some of {sorted(SAMPLING_OPTIONS)}.",
            field=unknown[0],
        )
    return {**DEFAULT_SAMPLING, **sampling}


class LocalBackend:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def stream(
        self, messages: list[dict], fmt: OutputFormat, sampling: dict[str, Any]
    ) -> AsyncIterator[str | Completion]:
        """`sampling` may also hold the reasoning options (agentrt.reasoning): `reasoning`
        (True, False, "auto"), `max_reasoning_tokens`, `reasoning_parser`, and OpenAI's
        `reasoning_effort` ("none" / "minimal": off; any other: on)."""
        sampling, options = reasoning_options(sampling)
        tokenizer = self.engine.tokenizer
        tools = fmt.kind == "tools"
        if tools:
            fmt = dataclasses.replace(fmt, tool_style=tool_call_style(tokenizer))
        turn = prepare_turn(
            tokenizer,
            messages,
            ChatConstraint.of(fmt),
            mode=reasoning_mode(options.get("reasoning", "auto"), options.get("reasoning_effort")),
            max_reasoning_tokens=options.get("max_reasoning_tokens"),
            reasoning_parser=options.get("reasoning_parser"),
        )
        params = turn.sampling_params(**check_sampling(sampling))
        prompt_ids = turn.prompt_ids
        reader = turn.reader(tokenizer, params)
        async with self.engine.add_request(prompt_ids, params) as stream:
            async for delta in stream:
                read = reader.feed(delta.text, delta.token_ids)
                if delta.output is not None:
                    read += reader.finish()
                if read.reasoning:
                    yield ReasoningText(read.reasoning)
                if read.answer:
                    yield read.answer
                if delta.output is not None:
                    yield reply_completion(delta.output, reader.reply(), tools)

    async def stats(self):
        return await self.engine.stats()


def reply_completion(output: RequestOutput, reply: Reply, tools: bool) -> Completion:
    """The `Completion` of a finished reply (`read_reply`): the answer, reasoning and calls
    are the reader's, and `raw_text` (what the history re-sends) is the reply with its
    markers spelled, also where the detokenizer skipped them as special."""
    completion = output.outputs[0]
    usage = Usage(len(output.prompt_token_ids), output.num_cached_tokens, len(completion.token_ids))
    usage.reasoning_tokens = reply.num_reasoning_tokens
    result = Completion(
        reply.text,
        completion.finish_reason,
        usage,
        error=output.error,
        error_code=output.error_code,
        structured_errors=completion.structured_errors,
        num_steered_tokens=completion.num_steered_tokens,
        reasoning=reply.reasoning,
        raw_text=reply.raw_text,
    )
    if tools:
        result.content, result.calls = reply.content, reply.call_blocks
        if _end_calls(result, reply.calls) and result.calls is not None:
            result.calls = result.calls[: len(reply.calls.calls)]
    return result


def _end_calls(completion: Completion, calls: ReplyCalls | None) -> bool:
    """A reply whose calls ended early (an exact repeat, the cap: `ReplyCalls`) has its
    calls, whatever it wrote after them: it finished ("stop"), also where max_tokens cut
    what followed. Returns whether it did."""
    if calls is None or calls.end is None or not calls.calls:
        return False
    if completion.finish_reason == "length":
        completion.finish_reason = "stop"
    return True
