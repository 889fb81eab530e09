"""`Grammar` (compiled, shared, immutable) and `GrammarMatcher` (one per request).

The matcher is what the engine holds per request. It owns two parts and calls them, never
the reverse: a `GrammarState` (state.py: the backend matcher, token bookkeeping for
rollback, the digit-run cap and the EOS gate) and, once a token budget is given, a
`BudgetSteer` (budget.py: steering to a valid end when the budget runs out). It adds the
bitmask layout check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .backend import BackendGrammar, TokenizerData
from .budget import STEER_WINDOW, BudgetSteer
from .report import GrammarReport
from .spec import GrammarSpec
from .state import GrammarState
from .validate import FinalValidator


@dataclass(frozen=True, slots=True)
class Grammar:
    """A compiled spec for one tokenizer. Thread-safe to share; `matcher()` per request."""

    spec: GrammarSpec
    report: GrammarReport
    backend_grammar: BackendGrammar
    validator: FinalValidator
    gate_eos: bool
    tok: TokenizerData
    compile_seconds: float
    max_digit_run: int = 0  # 0 = no cap (see RunLimits.max_digit_run)

    @property
    def backend(self) -> str:
        return self.report.backend

    @property
    def memory_bytes(self) -> int:
        return self.backend_grammar.memory_bytes + len(self.spec.text) * 4

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self)

    def new_state(self) -> GrammarState:
        """A fresh grammar state (no steering): what each matcher holds."""
        return GrammarState(
            self.backend_grammar.new_matcher(),
            self.tok,
            self.validator,
            gate_eos=self.gate_eos,
            max_digit_run=self.max_digit_run,
        )


class GrammarMatcher:
    """Per-request grammar state; the engine advances it once per accepted token.

    Invariant: `num_tokens` is the number of tokens accepted and not rolled back.
    """

    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar
        self._state = grammar.new_state()
        self._checked: np.ndarray | None = None  # last bitmask whose layout was checked
        self._steer: BudgetSteer | None = None  # made on the first fill with a budget

    @property
    def num_tokens(self) -> int:
        return self._state.num_tokens

    @property
    def num_steered(self) -> int:
        """Mask rows narrowed so the output ends within its token budget (fill_bitmask's
        tokens_left): nonzero means the output was closed early, not by the model."""
        return self._steer.num_steered if self._steer is not None else 0

    def fill_bitmask(
        self, bitmask: np.ndarray, row: int = 0, *, tokens_left: int | None = None
    ) -> None:
        """Write the allowed tokens into `bitmask[row]`.

        Writes every word of `bitmask[row]` and no other row. Leaves the grammar state as
        it was: the accepted tokens, `num_tokens`, the backend matcher and the digit run
        (a steering search accepts tokens and rolls them back). What it does change:
        - with `tokens_left`, the steering state: the cached completion, when to search
          next, whether opening tokens are refused, and `num_steered` (+1 per narrowed row);
        - caches only: the last bitmask whose layout was checked, the EOS gate's verdict
          on the current text, and a backend's pointer to the bitmask.

        tokens_left: how many more tokens the output may have (the stop token included),
        e.g. max_tokens minus the tokens generated. Near that budget's end the row steers
        the output to a valid end instead of letting it be cut (budget.py). None: no budget.
        Raises ValueError when the bitmask is not int32 `[rows, >= ceil(vocab/32)]`.
        """
        if bitmask is not self._checked:
            _check_bitmask(bitmask, self.grammar.tok.vocab_size)
            self._checked = bitmask
        self._state.fill_row(bitmask, row)
        if tokens_left is not None and tokens_left <= STEER_WINDOW:
            if self._steer is None:
                self._steer = BudgetSteer(self.grammar.tok)
            self._steer.steer_row(self._state, bitmask, row, tokens_left)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token. False (state unchanged) if the grammar forbids it."""
        return self._state.accept_token(token_id)

    # -- speculative decoding: looking ahead without moving ---------------------------------

    def num_valid_prefix(self, token_ids: list[int]) -> int:
        """How many leading tokens of `token_ids` the grammar accepts in a row (a draft is
        cut there). Leaves the grammar state and the steering exactly as they were."""
        num = 0
        for token_id in token_ids:
            if not self._state.accept_token(token_id):
                break
            num += 1
        self._state.rollback(num)
        return num

    def draft_with_forced(
        self,
        token_ids: list[int],
        max_tokens: int,
        more: Callable[[list[int]], list[int]] | None = None,
    ) -> tuple[list[int], list[bool]]:
        """A draft as jump-forward would see it, `max_tokens` tokens at most: the draft's
        tokens while the grammar accepts them and, after each one past which the grammar
        forces tokens, those forced tokens (jump-forward would append them unsampled). The
        draft's own tokens that spell the same forced tokens are passed over; where the draft
        has none left there or spells them otherwise, `more(tokens so far)` drafts what
        follows (walked the same way; without `more` the draft ends there).
        Returns the draft and, per token, whether it is forced. State and steering unchanged."""
        return walk_draft(self._state, token_ids, max_tokens, more)

    # -- lookahead without the steering (a reasoning request's answer part) -----------------

    def check_layout(self, bitmask: np.ndarray) -> None:
        """Raise ValueError unless `bitmask` is int32 `[rows, >= ceil(vocab/32)]`."""
        if bitmask is not self._checked:
            _check_bitmask(bitmask, self.grammar.tok.vocab_size)
            self._checked = bitmask

    def fill_row_unsteered(self, bitmask: np.ndarray, row: int) -> None:
        """The grammar's row alone (a draft row: see `fill_draft_bitmasks`)."""
        self.check_layout(bitmask)
        self._state.fill_row(bitmask, row)

    def accept_lookahead(self, token_id: int) -> bool:
        """`accept_token` for a walk that `rollback_lookahead` undoes: the steering is left
        as it is (a rollback would make it search again)."""
        return self._state.accept_token(token_id)

    def rollback_lookahead(self, num_tokens: int) -> None:
        self._state.rollback(num_tokens)

    def steering_free_tokens(self, tokens_left: int) -> int:
        """How many more tokens the steering would pass by unchanged: a row filled with
        `tokens_left - j` for j below this number is not narrowed, and fills no state (no
        search). Drafts stay within it, so their rows need no steering and verifying them
        leaves the steering where drafting off would (grammar/budget.py)."""
        if self._steer is None:  # made at the first row within the window
            return max(0, tokens_left - STEER_WINDOW)
        return self._steer.num_untouched_rows(tokens_left)

    def fill_draft_bitmasks(
        self, bitmask: np.ndarray, row: int, draft: list[int], *, tokens_left: int | None = None
    ) -> int:
        """Rows `row .. row + len(draft)` for verifying `draft`: row `row + j` holds what
        may follow the first j drafts (fill, accept the draft, fill the next, then roll
        back). The first row is `fill_bitmask(bitmask, row, tokens_left=tokens_left)`; the
        others are not steered: the caller drafts only within `steering_free_tokens`.
        Stops at a draft the grammar refuses (the rows after it are left untouched) and
        returns the number of rows filled. Leaves the grammar state and the steering as
        they were."""
        self.fill_bitmask(bitmask, row, tokens_left=tokens_left)
        num = 0
        for token_id in draft:
            if not self._state.accept_token(token_id):
                break
            num += 1
            self._state.fill_row(bitmask, row + num)
        self._state.rollback(num)
        return 1 + num

    def can_terminate(self) -> bool:
        """A stop token is allowed now (the output so far is complete and valid)."""
        return self._state.can_terminate()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (e.g. rejected speculative drafts);
        the steering starts over from the state rolled back to."""
        self._state.rollback(num_tokens)
        if num_tokens and self._steer is not None:
            self._steer.forget()

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next (free drafts for jump-forward); state unchanged."""
        return self._state.forced_tokens()

    def text(self) -> str:
        """The accepted output so far, decoded (stop tokens excluded)."""
        return self._state.text()

    def validate_final(self, text: str | None = None) -> list[str]:
        """Problems with the finished output (`text`, default: the accepted tokens).

        Empty list = valid. Covers every keyword the report lists as post-checked.
        """
        return self._state.validate_final(text)


def walk_draft(
    state,
    token_ids: list[int],
    max_tokens: int,
    more: Callable[[list[int]], list[int]] | None,
) -> tuple[list[int], list[bool]]:
    """`GrammarMatcher.draft_with_forced` on anything that accepts, rolls back and tells
    its forced tokens (a `GrammarState`, a reasoning matcher's lookahead); `state` ends
    where it started."""
    draft: list[int] = []
    forced: list[bool] = []
    pending = list(token_ids)
    try:
        while pending and len(draft) < max_tokens:
            token_id = pending.pop(0)
            if not state.accept_token(token_id):
                break
            draft.append(token_id)
            forced.append(False)
            jump = state.forced_tokens()[: max_tokens - len(draft)]
            for token_id in jump:
                if not state.accept_token(token_id):
                    break
                draft.append(token_id)
                forced.append(True)
            if jump:
                if pending[: len(jump)] == jump:
                    del pending[: len(jump)]
                else:
                    pending = []
                if not pending and more is not None and len(draft) < max_tokens:
                    pending = list(more(draft))
    finally:
        state.rollback(len(draft))
    return draft, forced


def _check_bitmask(bitmask: np.ndarray, vocab_size: int) -> None:
    if (
        not isinstance(bitmask, np.ndarray)
        or bitmask.dtype != np.int32
        or bitmask.ndim != 2
        or not bitmask.flags.c_contiguous
    ):
        raise ValueError("bitmask must be a C-contiguous np.int32 [rows, words] array")
    if bitmask.shape[1] * 32 < vocab_size:
        raise ValueError(
            f"bitmask has {bitmask.shape[1]} words per row, fewer than "
            f"ceil({vocab_size}/32) for this tokenizer's vocab_size"
        )
