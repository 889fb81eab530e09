"""Backends: where a Session's turns run. `LocalBackend` drives a local `AsyncEngine` (its core
on a thread or in engine processes);
a remote backend speaks the OpenAI API. Both stream text deltas and end with a `Completion`,
so Session, Agent and extraction code is the same for either."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol

from agentrt.engine.client.async_engine import AsyncEngine
from agentrt.engine.client.outputs import RequestOutput
from agentrt.engine.errors import ErrorCode, InvalidRequestError
from agentrt.engine.sampling_params import SamplingParams
from agentrt.formats import OutputFormat
from agentrt.reasoning import (
    REASONING_OPTIONS,
    ReasoningRequest,
    ReasoningText,
    constrain,
    count_reasoning_tokens,
    plan_request,
    resolve_spec,
    split,
    template_kwargs,
)
from agentrt.reply_tokens import REASONING, ReplySplitter, reply_markers
from agentrt.tool_calls import (
    ReplyCalls,
    read_call_blocks,
    read_tool_calls,
    render_messages,
    tool_call_style,
)

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


def reasoning_mode(options: dict[str, Any]) -> Any:
    """`reasoning` (True, False, "auto"), from `reasoning_effort` when it is not given."""
    mode = options.get("reasoning", "auto")
    effort = options.get("reasoning_effort")
    if mode == "auto" and effort is not None:
        return effort not in ("none", "minimal")
    return mode


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
        mode = reasoning_mode(options)
        max_reasoning = options.get("max_reasoning_tokens")
        parser = options.get("reasoning_parser")
        tokenizer = self.engine.tokenizer
        tools = None
        if fmt.kind == "tools":
            tools = list(fmt.tools)
            fmt = dataclasses.replace(fmt, tool_style=tool_call_style(tokenizer))
        rendered, template_tools = render_messages(
            messages, tools, tokenizer, parallel=fmt.parallel_tool_calls
        )
        think = resolve_spec(tokenizer, mode, parser)
        prompt_text = tokenizer.apply_chat_template(
            rendered,
            tools=template_tools,
            tokenize=False,
            add_generation_prompt=True,
            **template_kwargs(tokenizer, mode),
        )
        plan = plan_request(tokenizer, think, prompt_text, mode, max_reasoning)
        params = SamplingParams(
            **check_sampling(sampling), structured_outputs=constrain(fmt.structured_outputs(), plan)
        )
        prompt_ids = tokenizer.encode(prompt_text, add_special_tokens=False)
        markers = reply_markers(tokenizer, plan.spec, fmt.tool_style if tools else None)
        if markers is not None:  # the markers are tokens: read the reply from its ids
            reader = ReplySplitter(
                tokenizer,
                markers,
                opened=plan.opened,
                prompt_token_ids=prompt_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
            replies = self._stream_tokens(prompt_ids, params, reader, fmt if tools else None)
        else:
            replies = self._stream_text(prompt_ids, params, plan, fmt if tools else None)
        async with aclosing(replies):
            async for item in replies:
                yield item

    async def _stream_tokens(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        reader: ReplySplitter,
        tools: OutputFormat | None,
    ) -> AsyncIterator[str | Completion]:
        async with self.engine.add_request(prompt_ids, params) as stream:
            async for delta in stream:
                pieces = reader.feed(delta.token_ids)
                if delta.output is not None:
                    pieces += reader.finish()
                for piece in pieces:
                    yield ReasoningText(piece.text) if piece.kind == REASONING else piece.text
                if delta.output is not None:
                    yield split_completion(delta.output, reader, tools)

    async def _stream_text(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        plan: ReasoningRequest,
        tools: OutputFormat | None,
    ) -> AsyncIterator[str | Completion]:
        """The reply read from its text: the reasoning split at its markers' text, tool
        calls parsed from the answer."""
        tokenizer = self.engine.tokenizer
        splitter = plan.stream()
        async with self.engine.add_request(prompt_ids, params) as stream:
            async for delta in stream:
                if delta.text and splitter is None:
                    yield delta.text
                elif delta.text:
                    reasoning, answer = splitter.feed(delta.text)
                    if reasoning:
                        yield ReasoningText(reasoning)
                    if answer:
                        yield answer
                if delta.output is not None:
                    if splitter is not None:
                        reasoning, answer = splitter.finish()
                        if reasoning:
                            yield ReasoningText(reasoning)
                        if answer:
                            yield answer
                    completion = to_completion(delta.output, plan, tokenizer)
                    if tools is not None:
                        content, calls = read_tool_calls(
                            completion.text,
                            tools.tool_style,
                            max_calls=tools.max_parallel_tool_calls,
                        )
                        completion.content = completion.text if calls is None else content
                        _end_calls(completion, calls)
                    yield completion

    async def stats(self):
        return await self.engine.stats()


def to_completion(
    output: RequestOutput, plan: ReasoningRequest | None = None, tokenizer: Any = None
) -> Completion:
    completion = output.outputs[0]
    usage = Usage(len(output.prompt_token_ids), output.num_cached_tokens, len(completion.token_ids))
    text, reasoning = completion.text, None
    if plan is not None and plan.spec is not None:
        reasoning, text = split(completion.text, plan)
        usage.reasoning_tokens = count_reasoning_tokens(tokenizer, completion.token_ids, plan)
    return Completion(
        text,
        completion.finish_reason,
        usage,
        error=output.error,
        error_code=output.error_code,
        structured_errors=completion.structured_errors,
        num_steered_tokens=completion.num_steered_tokens,
        reasoning=reasoning,
        raw_text=completion.text,
    )


def split_completion(
    output: RequestOutput, reader: ReplySplitter, tools: OutputFormat | None
) -> Completion:
    """`to_completion` of a reply read from its token ids: the answer, reasoning and calls
    are the reader's, and `raw_text` (what the history re-sends) is the reply with its
    markers spelled, also where the detokenizer skipped them as special."""
    completion = to_completion(output)
    completion.text, completion.raw_text = reader.text, reader.raw_text
    completion.reasoning = reader.reasoning
    completion.usage.reasoning_tokens = reader.num_reasoning_tokens
    if tools is not None:
        completion.content, completion.calls = reader.content, list(reader.calls)
        calls = read_call_blocks(
            reader.calls, cut=reader.in_call, max_calls=tools.max_parallel_tool_calls
        )
        if _end_calls(completion, calls):
            completion.calls = completion.calls[: len(calls.calls)]
    return completion


def _end_calls(completion: Completion, calls: ReplyCalls | None) -> bool:
    """A reply whose calls ended early (an exact repeat, the cap: `ReplyCalls`) has its
    calls, whatever it wrote after them: it finished ("stop"), also where max_tokens cut
    what followed. Returns whether it did."""
    if calls is None or calls.end is None or not calls.calls or calls.invalid:
        return False
    if completion.finish_reason == "length":
        completion.finish_reason = "stop"
    return True
