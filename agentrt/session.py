"""Session: a conversation (system prompt + history) whose turns return parsed, validated
objects. Every turn re-sends the whole history; the engine's prefix cache serves it, so turn
N only computes what turn N-1 added."""

from __future__ import annotations

import copy
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import pydantic

from agentrt.backend import Backend, Completion, Usage
from agentrt.errors import (
    ErrorCode,
    GenerationError,
    OutputValidationError,
    TruncatedOutputError,
    error_for,
)
from agentrt.formats import OutputFormat, resolve_format
from agentrt.partial import completed_members
from agentrt.reasoning import ReasoningText

logger = logging.getLogger("agentrt")


@dataclass(slots=True)
class Result:
    """One finished turn: the parsed `value`, the raw `text`, why it ended, and its usage
    (with retries, the usage of every attempt). `num_steered_tokens > 0`: the reply was
    about to hit max_tokens and the grammar closed it early — valid, but possibly cut short
    (a string or list ended early); raise max_tokens for the full answer. A reasoning
    model's `reasoning` comes apart from the answer (`text`); `usage.reasoning_tokens`
    counts its tokens."""

    value: Any
    text: str
    finish_reason: str | None
    usage: Usage
    num_steered_tokens: int = 0
    reasoning: str | None = None


class Session:
    """`rt.session(system=..., **sampling_defaults)`. `generate` returns the value; the last
    `Result` is `session.last`, the running token totals `session.usage`."""

    def __init__(
        self,
        backend: Backend,
        *,
        system: str | None = None,
        messages: list[dict] | None = None,
        **sampling: Any,
    ) -> None:
        self.backend = backend
        self.system = system
        self.messages: list[dict] = list(messages or [])  # the history after the system prompt
        self.sampling = sampling
        self.last: Result | None = None
        self.usage = Usage()

    @property
    def history(self) -> list[dict]:
        """Everything sent on the next turn, system prompt first."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.messages

    def fork(self) -> Session:
        """A branch of this conversation: same history (and so the same cached prefix),
        independent from here on."""
        return Session(
            self.backend,
            system=self.system,
            messages=copy.deepcopy(self.messages),
            **self.sampling,
        )

    async def generate(
        self, prompt: str, schema: Any = None, *, retries: int = 0, **sampling: Any
    ) -> Any:
        """Send `prompt` as the user's turn and return the reply: text without a schema, else
        the parsed value (a Pydantic model instance, a dict for a JSON schema, the string for
        `Regex` / `Choice`). The turn joins the history only on success.

        A reasoning model (Qwen3, DeepSeek-R1) thinks first and the schema constrains what
        follows: `reasoning=True | False | "auto"` (default "auto": as its chat template
        does; passed to templates that take `enable_thinking`), `max_reasoning_tokens=N`
        (then the end of the reasoning is forced), `reasoning_parser="qwen3"` for markers the
        template does not show. The reasoning is `session.last.reasoning`.

        Raises `SchemaError`, `TruncatedOutputError`, `OutputValidationError` (a constraint
        only post-validation checks; `retries=N` re-asks up to N times with the errors),
        `GenerationError` and the engine's errors."""
        fmt = resolve_format(schema)
        turn = [{"role": "user", "content": prompt}]
        usage = Usage()
        for attempt in range(retries + 1):
            completion = await collect_completion(
                self.backend.stream(self.history + turn, fmt, self._s(sampling))
            )
            usage = usage + completion.usage
            try:
                value = check_completion(completion, fmt, usage)
                break
            except OutputValidationError as exc:
                if attempt == retries:
                    exc.usage = usage
                    raise
                turn = turn + [
                    {"role": "assistant", "content": completion.text},
                    {"role": "user", "content": _retry_message(exc)},
                ]
        self._commit(prompt, completion, value, usage)
        return value

    async def stream(self, prompt: str, schema: Any = None, **sampling: Any) -> AsyncIterator[Any]:
        """Without a schema (or with `Regex` / `Choice`): text deltas. With a JSON schema:
        successive partial values as members complete (a Pydantic model built from the
        fields completed so far, or a dict / list), ending with the validated value. A
        reasoning model's reasoning comes first, as `agentrt.ReasoningText` deltas (a `str`)."""
        fmt = resolve_format(schema)
        messages = self.history + [{"role": "user", "content": prompt}]
        text, num_members, completion = "", 0, None
        adapters: dict[str, pydantic.TypeAdapter] = {}  # per field, built once per stream
        # aclosing: a consumer that stops early closes the backend stream, which aborts the
        # request in the engine instead of leaving it to the garbage collector.
        async with aclosing(self.backend.stream(messages, fmt, self._s(sampling))) as items:
            async for item in items:
                if isinstance(item, Completion):
                    completion = item
                    break
                if fmt.kind != "json" or isinstance(item, ReasoningText):
                    yield item
                    continue
                text += item
                members = completed_members(text)
                if members is not None and len(members) > num_members:
                    num_members = len(members)
                    yield _partial(fmt, members, adapters)
        if completion is None:
            raise GenerationError("the stream ended without a completion")
        value = check_completion(completion, fmt, completion.usage)
        self._commit(prompt, completion, value, completion.usage)
        if fmt.kind == "json":
            yield value

    def _s(self, sampling: dict[str, Any]) -> dict[str, Any]:
        return {**self.sampling, **sampling}

    def _commit(self, prompt: str, completion: Completion, value: Any, usage: Usage) -> None:
        self.messages.append({"role": "user", "content": prompt})
        # The history holds what the model wrote, its reasoning block included: a template
        # that renders past turns as given (ChatML) then reproduces the tokens whose KV is
        # cached, and the next turn hits its whole prefix. (Qwen3's own template drops
        # reasoning from turns before the last user message: its history costs a recompute
        # from the first reply on, whatever is stored here.)
        self.messages.append(
            {"role": "assistant", "content": completion.raw_text or completion.text}
        )
        self.last = Result(
            value,
            completion.text,
            completion.finish_reason,
            usage,
            completion.num_steered_tokens,
            completion.reasoning,
        )
        if completion.num_steered_tokens:
            logger.warning(
                "the reply ran out of room before max_tokens: %d of its %d tokens were "
                "steered to close it validly, so it may be cut short (raise max_tokens for "
                "the full answer).",
                completion.num_steered_tokens,
                completion.usage.completion_tokens,
            )
        self.usage = self.usage + usage


async def collect_completion(stream: AsyncIterator[str | Completion]) -> Completion:
    async with aclosing(stream):
        async for item in stream:
            if isinstance(item, Completion):
                return item
    raise GenerationError("the stream ended without a completion")


def check_completion(completion: Completion, fmt: OutputFormat, usage: Usage) -> Any:
    """The parsed value of a finished reply, or the typed error that says why there is none.
    A reply that ended with "error" raises the exception of its `error_code` (ERROR_KINDS);
    a finished one fails when the final check (`structured_errors`) found problems, else
    `fmt.parse` converts it (see agentrt.formats for which check lives where)."""
    reason, text = completion.finish_reason, completion.text
    if reason == "error":
        code = completion.error_code or ErrorCode.INTERNAL
        message = completion.error or "the request failed in the engine"
        if code == ErrorCode.STRUCTURED_OUTPUT_FAILED:
            raise OutputValidationError(
                message, text=text, errors=completion.structured_errors or [message], usage=usage
            )
        raise error_for(code, message)
    if reason == "abort":
        raise GenerationError("the request was aborted")
    if reason == "length" and not fmt.is_plain_text(text, completion.calls):
        raise TruncatedOutputError(
            f"the output hit max_tokens after {usage.completion_tokens} tokens before the "
            f"{fmt.kind} was complete; raise max_tokens.",
            text=text,
            usage=usage,
        )
    if completion.structured_errors:
        raise OutputValidationError(
            "the output fails checks the grammar does not enforce: "
            + "; ".join(completion.structured_errors),
            text=text,
            errors=completion.structured_errors,
            usage=usage,
        )
    try:
        return fmt.parse(text, completion.calls)
    except OutputValidationError as exc:
        exc.usage = usage
        raise


def _retry_message(exc: OutputValidationError) -> str:
    return f"Your reply was invalid: {exc}. Reply again with the corrected output only."


def _partial(
    fmt: OutputFormat, members: dict | list, adapters: dict[str, pydantic.TypeAdapter]
) -> Any:
    """A partial value: for a Pydantic model, an instance built (unvalidated as a whole)
    from the completed fields, each validated on its own (`adapters` caches a field's
    TypeAdapter across the partials of one stream)."""
    model = fmt.python_type
    if not (isinstance(members, dict) and isinstance(model, type)):
        return members
    if not issubclass(model, pydantic.BaseModel):
        return members
    fields = {}
    for name, info in model.model_fields.items():
        key = info.alias or name
        if key in members:
            if name not in adapters:
                adapters[name] = pydantic.TypeAdapter(info.annotation)
            try:
                fields[name] = adapters[name].validate_python(members[key])
            except pydantic.ValidationError:
                fields[name] = members[key]
    return model.model_construct(**fields)
