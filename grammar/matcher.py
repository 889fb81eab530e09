"""`Grammar` (compiled, shared, immutable) and `GrammarMatcher` (one per request).

The matcher wraps a backend matcher and adds what the engine relies on regardless of
backend: token bookkeeping for rollback, masking of padded ids, the EOS gate, and steering
to a valid end when a token budget runs out (budget.py). When the grammar's report has
post-checked keywords (or the backend is approximate), a stop token is allowed only if
the text so far passes `validate_final`: the model can never end on an output the token
grammar let through but the schema rejects.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .backend import BackendGrammar, BackendMatcher, TokenizerData
from .budget import STEER_WINDOW, BudgetSteer
from .errors import MatcherStateError
from .report import GrammarReport
from .spec import GrammarSpec
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
        return GrammarMatcher(self, self.backend_grammar.new_matcher())


class GrammarMatcher:
    """Per-request grammar state; the engine advances it once per accepted token.

    Invariant: `num_tokens` is the number of tokens accepted and not rolled back.
    """

    def __init__(self, grammar: Grammar, backend: BackendMatcher) -> None:
        self.grammar = grammar
        self._m = backend
        self._tok = grammar.tok
        self._stop_ids = grammar.tok.stop_token_ids
        self._token_ids: list[int] = []
        self._gate_cache: tuple[int, bool] | None = None  # (num_tokens, text passes)
        self._checked: np.ndarray | None = None  # last bitmask whose layout was checked
        self._digit_run = 0  # consecutive digits at the end of the accepted text
        self._steer: BudgetSteer | None = None  # made on the first fill with a budget

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def last_token_id(self) -> int | None:
        return self._token_ids[-1] if self._token_ids else None

    @property
    def num_steered(self) -> int:
        """Mask rows narrowed so the output ends within its token budget (fill_bitmask's
        tokens_left): nonzero means the output was closed early, not by the model."""
        return self._steer.num_steered if self._steer is not None else 0

    def fill_bitmask(
        self, bitmask: np.ndarray, row: int = 0, *, tokens_left: int | None = None
    ) -> None:
        """Write the allowed tokens into `bitmask[row]`; does not change the state.

        tokens_left: how many more tokens the output may have (the stop token included),
        e.g. max_tokens minus the tokens generated. Near that budget's end the row steers
        the output to a valid end instead of letting it be cut (budget.py); each steered
        row counts in `num_steered`. None: no budget.
        Raises ValueError when the bitmask is not int32 `[rows, >= ceil(vocab/32)]`.
        """
        if bitmask is not self._checked:
            _check_bitmask(bitmask, self._tok.vocab_size)
            self._checked = bitmask
        self._m.fill_row(bitmask, row)
        cap = self.grammar.max_digit_run
        if cap and self._digit_run >= cap:
            words = bitmask[row].view(np.uint32)
            n = self._tok.digit_start_words.size
            words[:n] &= ~self._tok.digit_start_words
        if self.grammar.gate_eos and not self._final_ok():
            words = bitmask[row].view(np.uint32)
            for stop in self._stop_ids:
                words[stop >> 5] &= np.uint32(~(1 << (stop & 31)) & 0xFFFFFFFF)
        if tokens_left is not None and tokens_left <= STEER_WINDOW:
            if self._steer is None:
                self._steer = BudgetSteer(bitmask.shape[1])
            self._steer.steer_row(self, bitmask, row, tokens_left)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token. False (state unchanged) if the grammar forbids it."""
        if token_id in self._stop_ids and self.grammar.gate_eos and not self._final_ok():
            return False
        cap = self.grammar.max_digit_run
        if cap and self._digit_run >= cap and self._starts_with_digit(token_id):
            return False
        if not self._m.accept(token_id):
            return False
        self._token_ids.append(token_id)
        self._digit_run = self._run_after(self._digit_run, token_id)
        return True

    def _starts_with_digit(self, token_id: int) -> bool:
        return self._tok.token_bytes[token_id][:1].isdigit()

    def _run_after(self, run: int, token_id: int) -> int:
        if self._tok.digit_only[token_id]:
            return run + len(self._tok.token_bytes[token_id])
        return int(self._tok.digit_tail[token_id])

    def can_terminate(self) -> bool:
        """A stop token is allowed now (the output so far is complete and valid)."""
        if not self._m.is_accepting():
            return False
        return not self.grammar.gate_eos or self._final_ok()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (e.g. rejected speculative drafts)."""
        if not 0 <= num_tokens <= len(self._token_ids):
            raise MatcherStateError(
                f"cannot roll back {num_tokens} tokens: only {len(self._token_ids)} accepted"
            )
        if num_tokens:
            self._m.rollback(num_tokens)
            self._gate_cache = None
            if self._steer is not None:
                self._steer.forget()
            del self._token_ids[len(self._token_ids) - num_tokens :]
            self._digit_run = 0
            for t in self._token_ids[-64:]:  # enough history unless runs exceed 64 tokens
                self._digit_run = self._run_after(self._digit_run, t)

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next (free drafts for jump-forward); state unchanged."""
        return self._m.forced_tokens()

    def text(self) -> str:
        """The accepted output so far, decoded (stop tokens excluded)."""
        data = b"".join(
            self._tok.token_bytes[t] for t in self._token_ids if t not in self._stop_ids
        )
        return data.decode("utf-8", errors="replace")

    def validate_final(self, text: str | None = None) -> list[str]:
        """Problems with the finished output (`text`, default: the accepted tokens).

        Empty list = valid. Covers every keyword the report lists as post-checked.
        """
        return self.grammar.validator.errors(self.text() if text is None else text)

    def _final_ok(self) -> bool:
        n = len(self._token_ids)
        if self._gate_cache is None or self._gate_cache[0] != n:
            ok = self._m.is_accepting() and not self.validate_final()
            self._gate_cache = (n, ok)
        return self._gate_cache[1]


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
