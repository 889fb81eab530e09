"""Reasoning before the structured output: `<think> ... </think>`, then the schema.

A reasoning model (Qwen3, DeepSeek-R1 distills) writes free text between two markers before
it answers. Constraining the reply from its first token would make it skip that reasoning;
instead a reasoning request's grammar has two parts, run one after the other:

  1. the reasoning: the start marker (unless the chat template already opened it), free
     text that cannot contain the end marker, then the end marker. `max_reasoning_tokens`
     bounds the text: once that many reasoning tokens are written, the end marker's tokens
     are the only ones allowed (forced, so jump-forward appends them);
  2. the answer: the request's own grammar (a schema, tool calls, any text), exactly as
     without reasoning: its bounds, budget steering and final check see the answer only.

A marker that is one token of the tokenizer (Qwen3's `<think>` 151667 / `</think>` 151668)
is named as that token (llguidance's `<think>` syntax); otherwise it is text. Either way the
reasoning text never holds the end marker's text, so splitting the decoded output at its
first end marker (agentrt.reply's reader) gives exactly the two parts.

This module holds the markers (`ReasoningSpec`, found from the template or named by a
parser), the spec's reasoning field (`with_reasoning`) and the reasoning part's Lark
grammar; the per-request matcher is grammar/reasoning_matcher.py.

When the template leaves the choice to the model (Qwen3 with thinking on opens nothing) and
the start marker is one token, the first row allows that token or the answer's first
tokens ("auto"). The plan is the spec's typed `reasoning` field (`spec.ReasoningPlan`), so it
crosses processes and keys the cache like any other spec.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from .errors import GrammarSpecError
from .spec import GrammarSpec, ReasoningPlan


@dataclass(frozen=True, slots=True)
class ReasoningSpec:
    """A model family's reasoning markers (vLLM's `--reasoning-parser` names)."""

    name: str
    start: str = "<think>"
    end: str = "</think>"


REASONING_PARSERS: dict[str, ReasoningSpec] = {
    "qwen3": ReasoningSpec("qwen3"),
    "deepseek_r1": ReasoningSpec("deepseek_r1"),
}


def reasoning_parser(name: str) -> ReasoningSpec:
    """The spec of a parser name; raises GrammarSpecError naming the known ones."""
    if name not in REASONING_PARSERS:
        raise GrammarSpecError(
            f"reasoning_parser={name!r} is unknown: expected one of {sorted(REASONING_PARSERS)}"
        )
    return REASONING_PARSERS[name]


def detect_reasoning(tokenizer: Any) -> ReasoningSpec | None:
    """The reasoning spec of a tokenizer and its chat template: Qwen3 (a template that takes
    `enable_thinking`), DeepSeek-R1 (its `<｜Assistant｜>` template), or any template that
    writes `<think>` / `</think>` with both markers single tokens; None otherwise."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str) or "</think>" not in template:
        return None
    if "enable_thinking" in template:
        return REASONING_PARSERS["qwen3"]
    if "｜Assistant｜" in template:
        return REASONING_PARSERS["deepseek_r1"]
    markers = ("<think>", "</think>")
    if all(single_token_id(tokenizer, m) is not None for m in markers):
        return ReasoningSpec("think")
    return None


def template_opens_reasoning(prompt_text: str, spec: ReasoningSpec) -> bool:
    """Whether the rendered prompt ends inside an open reasoning block (DeepSeek-R1's
    template ends with `<think>\\n`; Qwen3's with thinking off closes an empty one)."""
    return prompt_text.rfind(spec.start) > prompt_text.rfind(spec.end)


# ---- the spec's reasoning plan -------------------------------------------------------------


def with_reasoning(
    spec: GrammarSpec,
    reasoning: ReasoningSpec,
    *,
    opened: bool,
    optional: bool = False,
    max_reasoning_tokens: int | None = None,
) -> GrammarSpec:
    """`spec` preceded by a reasoning block. `opened`: the prompt already opened it;
    `optional`: the model may skip it (needs a single-token start marker)."""
    if max_reasoning_tokens is not None and max_reasoning_tokens < 0:
        raise GrammarSpecError(f"max_reasoning_tokens must be >= 0, got {max_reasoning_tokens}")
    plan = ReasoningPlan(
        reasoning.start,
        reasoning.end,
        opened=opened,
        optional=optional and not opened,
        max_tokens=max_reasoning_tokens,
    )
    return replace(spec, reasoning=plan)


def think_lark(plan: ReasoningPlan, start_special: bool, end_special: bool) -> str:
    """The Lark grammar (llguidance) of the reasoning part: the start marker when the model
    must write it, text without the end marker, the end marker."""
    start = "" if plan.opened else (plan.start if start_special else _quote(plan.start)) + " "
    if end_special:
        end = re.escape(plan.end).replace("/", "\\/")
        return f"start: {start}THINK {plan.end}\nTHINK: /(?s:.*)/ & ~/(?s:.*){end}(?s:.*)/\n"
    # A lazy lexeme ends at the first end marker, so the text cannot hold one.
    return f"start: {start}think\nthink[suffix={_quote(plan.end)}]: /(?s:.*)/\n"


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def single_token_id(tokenizer: Any, text: str) -> int | None:
    """The id of `text` when the (HF) tokenizer has it as one added token (a special or
    control token such as `<tool_call>` or `</think>`), else None."""
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    token_id = added.get(text)
    if token_id is None or tokenizer.encode(text, add_special_tokens=False) != [token_id]:
        return None
    return token_id
