"""Reasoning models in the SDK and the server: which requests reason, the chat template's
switch, and the constraint that starts after the reasoning (agentrt.reply reads the reply).

`reasoning=True | False | "auto"` (SDK) and `chat_template_kwargs={"enable_thinking": ...}`
(server) decide; the model family's markers come from the tokenizer and template
(`agentrt.grammar.reasoning.detect_reasoning`) or from `reasoning_parser=`:

- True: the reply reasons first. A template that takes `enable_thinking` gets True; a block
  the template did not open is opened by the grammar (forced start marker).
- False: no reasoning. A template that takes `enable_thinking` gets False (Qwen3 then closes
  an empty block itself); a template that always opens the block (DeepSeek-R1) gets it
  closed at once (`max_reasoning_tokens=0`).
- "auto" (default): as the template does by default; where the model may open the block
  itself (a single-token start marker), its first row allows that or the answer.

A constrained reply gets `with_reasoning(spec)`: the reasoning, then the constraint. A free
reply reasons without a grammar unless it needs one (a reasoning budget, a forced start).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentrt.engine.errors import InvalidRequestError
from agentrt.engine.sampling_params import StructuredOutputsParams, to_grammar_spec
from agentrt.grammar import GrammarSpec, GrammarSpecError
from agentrt.grammar.reasoning import (
    ReasoningSpec,
    detect_reasoning,
    reasoning_parser,
    single_token_id,
    template_opens_reasoning,
    with_reasoning,
)

REASONING_OPTIONS = ("reasoning", "max_reasoning_tokens", "reasoning_parser")


class ReasoningText(str):
    """A streamed delta of the reasoning (not of the answer): `isinstance(d, ReasoningText)`."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class ReasoningRequest:
    """One request's reasoning: the markers (None: it does not reason), whether the prompt
    opened the block, and the budget."""

    spec: ReasoningSpec | None
    opened: bool = False
    forced: bool = False
    max_tokens: int | None = None


def resolve_spec(tokenizer: Any, mode: Any, parser: str | None) -> ReasoningSpec | None:
    """The markers for `mode` ("auto", True, False) and an optional parser name; raises
    InvalidRequestError when reasoning is asked of a model that has none."""
    if mode not in (True, False, "auto"):
        raise InvalidRequestError(
            f"reasoning={mode!r} is invalid: expected True, False or 'auto'.", field="reasoning"
        )
    try:
        spec = reasoning_parser(parser) if parser else detect_reasoning(tokenizer)
    except GrammarSpecError as exc:
        raise InvalidRequestError(str(exc), field="reasoning_parser") from None
    if spec is None and mode is True:
        raise InvalidRequestError(
            "reasoning=True, but this model's chat template shows no reasoning markers: pass "
            "reasoning_parser='qwen3' (or 'deepseek_r1') to name them.",
            field="reasoning",
        )
    return spec


def template_kwargs(tokenizer: Any, mode: Any, given: dict[str, Any] | None = None) -> dict:
    """Chat template variables: `given` (the server's chat_template_kwargs), and
    `enable_thinking` for templates that take it, unless given."""
    kwargs = dict(given or {})
    template = getattr(tokenizer, "chat_template", None) or ""
    if mode != "auto" and "enable_thinking" in template:
        kwargs.setdefault("enable_thinking", bool(mode))
    return kwargs


def plan_request(
    tokenizer: Any,
    spec: ReasoningSpec | None,
    prompt_text: str,
    mode: Any,
    max_reasoning_tokens: int | None,
) -> ReasoningRequest:
    """How the reply reasons, given the rendered prompt."""
    if max_reasoning_tokens is not None and max_reasoning_tokens < 0:
        raise InvalidRequestError(
            f"max_reasoning_tokens={max_reasoning_tokens} is invalid: expected >= 0.",
            field="max_reasoning_tokens",
        )
    if spec is None:
        return ReasoningRequest(None)
    opened = template_opens_reasoning(prompt_text, spec)
    if opened:
        budget = 0 if mode is False else max_reasoning_tokens
        return ReasoningRequest(spec, opened=True, max_tokens=budget)
    if mode is False:
        return ReasoningRequest(None)
    if mode is True:
        return ReasoningRequest(spec, forced=True, max_tokens=max_reasoning_tokens)
    if single_token_id(tokenizer, spec.start) is None:
        return ReasoningRequest(None)  # the model cannot open it in one token: no reasoning
    return ReasoningRequest(spec, max_tokens=max_reasoning_tokens)


def constrain(
    structured: StructuredOutputsParams | None, request: ReasoningRequest
) -> StructuredOutputsParams | None:
    """The engine constraint: reasoning first, then `structured` (or any text)."""
    if request.spec is None:
        return structured
    if structured is None and request.max_tokens is None and not request.forced:
        return None  # free text that may reason: parsed, not constrained
    answer = to_grammar_spec(structured) if structured is not None else GrammarSpec.any_text()
    spec = with_reasoning(
        answer,
        request.spec,
        opened=request.opened,
        optional=not request.forced and not request.opened,
        max_reasoning_tokens=request.max_tokens,
    )
    return StructuredOutputsParams(spec=spec)


def count_reasoning_tokens(tokenizer: Any, token_ids: list[int], request: ReasoningRequest) -> int:
    """Output tokens up to the end marker, included (all of them while it is open; none when
    the reply did not reason)."""
    if request.spec is None or not token_ids:
        return 0
    end_id = single_token_id(tokenizer, request.spec.end)
    if end_id is not None and end_id in token_ids:
        return token_ids.index(end_id) + 1
    if end_id is not None or request.spec.end not in tokenizer.decode(token_ids):
        started = request.opened or tokenizer.decode(token_ids[:8]).lstrip().startswith(
            request.spec.start
        )
        return len(token_ids) if started else 0
    low, high = 1, len(token_ids)  # the shortest prefix that holds the marker
    while low < high:
        mid = (low + high) // 2
        if request.spec.end in tokenizer.decode(token_ids[:mid]):
            high = mid
        else:
            low = mid + 1
    return low
