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

When the template leaves the choice to the model (Qwen3 with thinking on opens nothing) and
the start marker is one token, the first row allows that token or the answer's first
tokens ("auto"). The spec is carried by `GrammarSpec.with_reasoning` options, so it crosses
processes and keys the cache like any other spec.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import GrammarSpecError
from .spec import GrammarSpec

OPTION_PREFIX = "reasoning_"


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


# ---- the spec's options ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReasoningPlan:
    """How one request reasons: the markers; `opened` by the template; `start` "forced"
    (the model must open it), "optional" (it may: a single-token start) or "none" (opened);
    `max_tokens` of reasoning text (None: only max_tokens bounds it)."""

    start: str
    end: str
    opened: bool
    optional: bool
    max_tokens: int | None


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
    options = {k: v for k, v in spec.options if not k.startswith(OPTION_PREFIX)}
    options.update(
        {
            "reasoning_start": reasoning.start,
            "reasoning_end": reasoning.end,
            "reasoning_opened": "1" if opened else "0",
            "reasoning_optional": "1" if optional and not opened else "0",
            "reasoning_max_tokens": ""
            if max_reasoning_tokens is None
            else str(max_reasoning_tokens),
        }
    )
    return GrammarSpec(spec.kind, spec.text, tuple(sorted(options.items())))


def plan_of(spec: GrammarSpec) -> ReasoningPlan | None:
    options = spec.option_dict
    if "reasoning_end" not in options:
        return None
    max_tokens = options["reasoning_max_tokens"]
    return ReasoningPlan(
        options["reasoning_start"],
        options["reasoning_end"],
        options["reasoning_opened"] == "1",
        options["reasoning_optional"] == "1",
        int(max_tokens) if max_tokens else None,
    )


def without_reasoning(spec: GrammarSpec) -> GrammarSpec:
    """The answer's spec (the options that are not the reasoning's)."""
    options = tuple((k, v) for k, v in spec.options if not k.startswith(OPTION_PREFIX))
    return GrammarSpec(spec.kind, spec.text, options)


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


# ---- the per-request matcher -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReasoningGrammar:
    """A reasoning spec compiled: the reasoning part (`think`, a `Grammar`) and the answer's
    (`answer`, a `Grammar`), with the end marker's token ids (one id for a single token;
    else the tokenizer's own tokenization of its text, forced one by one at the budget)
    and the start marker's id when the model may open the block itself."""

    spec: GrammarSpec
    think: Any  # Grammar
    answer: Any  # Grammar
    plan: ReasoningPlan
    end_ids: tuple[int, ...]
    start_id: int | None
    num_start_tokens: int  # tokens of the start marker the reasoning part writes (0 if opened)

    @property
    def report(self) -> Any:
        return self.answer.report

    @property
    def backend(self) -> str:
        return self.answer.backend

    @property
    def memory_bytes(self) -> int:
        return self.think.memory_bytes + self.answer.memory_bytes

    def matcher(self) -> ReasoningMatcher:
        return ReasoningMatcher(self)


_THINK, _ANSWER = "t", "a"


class ReasoningMatcher:
    """The matcher of a reasoning request: the reasoning part's `GrammarState`, then the
    answer's `GrammarMatcher`, with the `GrammarMatcher` interface the engine drives.

    Invariant: `_parts[i]` says which part accepted token i ("t" reasoning, "a" answer);
    the reasoning part holds the "t" tokens, the answer matcher the "a" ones, in order, and
    no "t" follows an "a". Rows for drafts and lookahead walk both parts the same way."""

    def __init__(self, grammar: ReasoningGrammar) -> None:
        self.grammar = grammar
        self._think = grammar.think.new_state()
        self._answer = grammar.answer.matcher()
        self._parts: list[str] = []
        self._checked: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return len(self._parts)

    @property
    def num_steered(self) -> int:
        return self._answer.num_steered

    @property
    def num_reasoning_tokens(self) -> int:
        """Tokens of the reasoning block so far, its markers included."""
        return self._think.num_tokens

    @property
    def in_answer(self) -> bool:
        if self._parts:
            return self._parts[-1] == _ANSWER or self._think.can_terminate()
        return False

    def _pending(self) -> bool:
        """Nothing written yet and the model may open the reasoning or answer at once."""
        return not self._parts and self.grammar.plan.optional

    def _forced_end(self) -> int | None:
        """The end marker token to force now (the reasoning budget is spent), else None."""
        limit = self.grammar.plan.max_tokens
        if limit is None or self.in_answer or self._pending():
            return None
        written = self._think.num_tokens - self.grammar.num_start_tokens
        k = written - limit
        if k < 0 or k >= len(self.grammar.end_ids):
            return None
        return self.grammar.end_ids[k]

    # -- rows -------------------------------------------------------------------------------

    def fill_bitmask(
        self, bitmask: np.ndarray, row: int = 0, *, tokens_left: int | None = None
    ) -> None:
        """`GrammarMatcher.fill_bitmask`: the reasoning part's row, or the answer's (steered
        with `tokens_left`), or both where the model may open the reasoning or answer."""
        if self.in_answer:
            self._answer.fill_bitmask(bitmask, row, tokens_left=tokens_left)
            return
        self._check(bitmask)
        if self._pending():
            self._answer.fill_bitmask(bitmask, row, tokens_left=tokens_left)
            _set_bit(bitmask, row, self.grammar.start_id)
            return
        self._fill_think(bitmask, row)

    def _fill_think(self, bitmask: np.ndarray, row: int) -> None:
        forced = self._forced_end()
        if forced is not None:
            bitmask[row] = 0
            _set_bit(bitmask, row, forced)
        else:
            self._think.fill_row(bitmask, row)

    def _fill_unsteered(self, bitmask: np.ndarray, row: int) -> None:
        if self.in_answer:
            self._answer.fill_row_unsteered(bitmask, row)
        elif self._pending():
            self._answer.fill_row_unsteered(bitmask, row)
            _set_bit(bitmask, row, self.grammar.start_id)
        else:
            self._fill_think(bitmask, row)

    def _check(self, bitmask: np.ndarray) -> None:
        if bitmask is not self._checked:
            # The answer matcher checks the layout it fills; the reasoning part's rows
            # share it.
            self._answer.check_layout(bitmask)
            self._checked = bitmask

    # -- moving ---------------------------------------------------------------------------

    def accept_token(self, token_id: int) -> bool:
        return self._accept(token_id, lookahead=False)

    def _accept(self, token_id: int, *, lookahead: bool) -> bool:
        if self.in_answer or (self._pending() and token_id != self.grammar.start_id):
            ok = (
                self._answer.accept_lookahead(token_id)
                if lookahead
                else self._answer.accept_token(token_id)
            )
            if ok:
                self._parts.append(_ANSWER)
            return ok
        forced = self._forced_end()
        if forced is not None and token_id != forced:
            return False
        if not self._think.accept_token(token_id):
            return False
        self._parts.append(_THINK)
        return True

    def rollback(self, num_tokens: int) -> None:
        self._rollback(num_tokens, lookahead=False)

    def _rollback(self, num_tokens: int, *, lookahead: bool) -> None:
        if not num_tokens:
            return
        undone = self._parts[-num_tokens:]
        del self._parts[-num_tokens:]
        num_answer = undone.count(_ANSWER)
        if num_answer:
            if lookahead:
                self._answer.rollback_lookahead(num_answer)
            else:
                self._answer.rollback(num_answer)
        if len(undone) - num_answer:
            self._think.rollback(len(undone) - num_answer)

    def forced_tokens(self) -> list[int]:
        if self.in_answer:
            return self._answer.forced_tokens()
        if self._pending():
            return []
        if self._forced_end() is not None:
            written = self._think.num_tokens - self.grammar.num_start_tokens
            tail = list(self.grammar.end_ids[written - self.grammar.plan.max_tokens :])
            # Jump-forward goes on across the end marker: what the answer forces first
            # (`{"name": "`) follows it unsampled.
            num = 0
            for token_id in tail:
                if not self._accept(token_id, lookahead=True):
                    break
                num += 1
            more = self._answer.forced_tokens() if num == len(tail) else []
            self._rollback(num, lookahead=True)
            return tail + more
        return self._think.forced_tokens()

    def can_terminate(self) -> bool:
        if self.in_answer or self._pending():
            return self._answer.can_terminate()
        return False

    # -- speculative decoding ---------------------------------------------------------------

    def num_valid_prefix(self, token_ids: list[int]) -> int:
        num = 0
        for token_id in token_ids:
            if not self._accept(token_id, lookahead=True):
                break
            num += 1
        self._rollback(num, lookahead=True)
        return num

    def draft_with_forced(
        self,
        token_ids: list[int],
        max_tokens: int,
        more: Callable[[list[int]], list[int]] | None = None,
    ) -> tuple[list[int], list[bool]]:
        from .matcher import walk_draft

        return walk_draft(self._walker(), token_ids, max_tokens, more)

    def steering_free_tokens(self, tokens_left: int) -> int:
        return self._answer.steering_free_tokens(tokens_left)

    def fill_draft_bitmasks(
        self, bitmask: np.ndarray, row: int, draft: list[int], *, tokens_left: int | None = None
    ) -> int:
        self.fill_bitmask(bitmask, row, tokens_left=tokens_left)
        num = 0
        for token_id in draft:
            if not self._accept(token_id, lookahead=True):
                break
            num += 1
            self._fill_unsteered(bitmask, row + num)
        self._rollback(num, lookahead=True)
        return 1 + num

    def _walker(self) -> _Lookahead:
        return _Lookahead(self)

    # -- text -----------------------------------------------------------------------------

    def text(self) -> str:
        """The answer so far (the reasoning is not part of what the schema checks)."""
        return self._answer.text()

    def validate_final(self, text: str | None = None) -> list[str]:
        return self._answer.validate_final(text)


class _Lookahead:
    """A ReasoningMatcher walked without touching the answer's steering (drafts)."""

    def __init__(self, matcher: ReasoningMatcher) -> None:
        self._m = matcher

    def accept_token(self, token_id: int) -> bool:
        return self._m._accept(token_id, lookahead=True)

    def rollback(self, num_tokens: int) -> None:
        self._m._rollback(num_tokens, lookahead=True)

    def forced_tokens(self) -> list[int]:
        return self._m.forced_tokens()


def _set_bit(bitmask: np.ndarray, row: int, token_id: int | None) -> None:
    if token_id is not None:
        words = bitmask[row].view(np.uint32)
        words[token_id >> 5] |= np.uint32(1 << (token_id & 31))
