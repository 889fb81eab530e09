"""The matcher of a reasoning request (grammar/reasoning.py): the reasoning part's
`GrammarState`, then the answer's `GrammarMatcher`, behind the `GrammarMatcher` interface the
engine drives (rows, accept, rollback, jump-forward, drafts). The reasoning budget forces
the end marker's tokens once that many reasoning tokens were written; where the model may
open the block itself, the first row allows the start marker or the answer's first tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .matcher import walk_draft
from .spec import GrammarSpec, ReasoningPlan


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
