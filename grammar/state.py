"""`GrammarState`: one request's position in its grammar, with the gates every backend gets.

It wraps a backend matcher and adds what the engine relies on regardless of backend: token
bookkeeping for rollback, the digit-run cap (RunLimits.max_digit_run) and the EOS gate.
When the grammar's report has post-checked keywords (or the backend is approximate), a stop
token is allowed only if the text so far passes `validate_final`: the model can never end
on an output the token grammar let through but the schema rejects.

The gate runs the check at every step where the grammar could end, on the engine thread, so
its cost is bounded per request: each check has its own deadline (validate.py), and once a
request's checks have taken `MAX_GATE_SECONDS` in all, or one could not finish within its
bounds, the gate follows the grammar alone for the rest of the request (the final check
still runs once, and reports what it could not check).

It knows nothing of steering. `GrammarMatcher` owns a state and a `BudgetSteer`; the
steering's completion search accepts and rolls back tokens on the state alone, so nothing
the search does can reach the steering (budget.py imports this module, never matcher.py).
"""

from __future__ import annotations

import time

import numpy as np

from .backend import BackendMatcher, TokenizerData
from .errors import MatcherStateError
from .validate import FinalValidator

# Engine-thread time one request's EOS gate may spend in final checks, all steps together.
MAX_GATE_SECONDS = 0.5


class GrammarState:
    """Invariant: `num_tokens` is the number of tokens accepted and not rolled back, and
    `_digit_runs[i]` is the run of digits ending the text after token i."""

    def __init__(
        self,
        backend: BackendMatcher,
        tok: TokenizerData,
        validator: FinalValidator,
        *,
        gate_eos: bool,
        max_digit_run: int,
    ) -> None:
        self.tok = tok
        self._m = backend
        self._validator = validator
        self._gate_eos = gate_eos
        self._max_digit_run = max_digit_run  # 0 = no cap
        self._token_ids: list[int] = []
        self._digit_runs: list[int] = []
        self._gate_cache: tuple[int, bool] | None = None  # (num_tokens, text passes)
        self._gate_seconds = 0.0  # spent in the gate's final checks so far
        self._gate_bounded = False  # a check hit a bound, or the gate spent its time

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def last_token_id(self) -> int | None:
        return self._token_ids[-1] if self._token_ids else None

    def fill_row(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed tokens into `bitmask[row]` (a layout the caller checked).
        Changes no state but the EOS gate's cached verdict for the current text."""
        self._m.fill_row(bitmask, row)
        if self._digit_capped():
            words = bitmask[row].view(np.uint32)
            n = self.tok.digit_start_words.size
            words[:n] &= ~self.tok.digit_start_words
        if self._gate_eos and not self._final_ok():
            words = bitmask[row].view(np.uint32)
            for stop in self.tok.stop_token_ids:
                words[stop >> 5] &= np.uint32(~(1 << (stop & 31)) & 0xFFFFFFFF)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token. False (state unchanged) if the grammar forbids it."""
        if token_id in self.tok.stop_token_ids and self._gate_eos and not self._final_ok():
            return False
        if self._digit_capped() and self.tok.token_bytes[token_id][:1].isdigit():
            return False
        if not self._m.accept(token_id):
            return False
        self._token_ids.append(token_id)
        self._digit_runs.append(self._run_after(token_id))
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        if not 0 <= num_tokens <= len(self._token_ids):
            raise MatcherStateError(
                f"cannot roll back {num_tokens} tokens: only {len(self._token_ids)} accepted"
            )
        if num_tokens:
            self._m.rollback(num_tokens)
            self._gate_cache = None  # keyed by length: the same length may be other text
            del self._token_ids[-num_tokens:]
            del self._digit_runs[-num_tokens:]

    def can_terminate(self) -> bool:
        """A stop token is allowed now (the output so far is complete and valid)."""
        if not self._m.is_accepting():
            return False
        return not self._gate_eos or self._final_ok()

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next (free drafts for jump-forward); state unchanged."""
        return self._m.forced_tokens()

    def text(self) -> str:
        """The accepted output so far, decoded (stop tokens excluded)."""
        stops = self.tok.stop_token_ids
        data = b"".join(self.tok.token_bytes[t] for t in self._token_ids if t not in stops)
        return data.decode("utf-8", errors="replace")

    def validate_final(self, text: str | None = None) -> list[str]:
        """Problems with the finished output (`text`: the accepted tokens' text as the caller
        decoded it; default: decoded here).

        Empty list = valid. Covers every keyword the report lists as post-checked; what the
        grammar enforced exactly is proven by this state reaching its end, not re-matched.
        """
        text = self.text() if text is None else text
        return self._validator.errors(text, complete=self._complete())

    def _complete(self) -> bool:
        """The grammar accepts the output: it is at an end, or took a stop token there."""
        ended = bool(self._token_ids) and self._token_ids[-1] in self.tok.stop_token_ids
        return ended or self._m.is_accepting()

    def _digit_capped(self) -> bool:
        cap = self._max_digit_run
        return bool(cap) and bool(self._digit_runs) and self._digit_runs[-1] >= cap

    def _run_after(self, token_id: int) -> int:
        if self.tok.digit_only[token_id]:
            run = self._digit_runs[-1] if self._digit_runs else 0
            return run + len(self.tok.token_bytes[token_id])
        return int(self.tok.digit_tail[token_id])

    def _final_ok(self) -> bool:
        n = len(self._token_ids)
        if self._gate_cache is None or self._gate_cache[0] != n:
            ok = self._m.is_accepting() and self._gate_check()
            self._gate_cache = (n, ok)
        return self._gate_cache[1]

    def _gate_check(self) -> bool:
        """The final check's verdict for the gate, within the request's gate time."""
        if self._gate_bounded:
            return True  # the grammar alone decides; the final check reports the rest
        start = time.monotonic()
        verdict = self._validator.check(self.text(), complete=self._complete())
        self._gate_seconds += time.monotonic() - start
        if not verdict.checked or self._gate_seconds > MAX_GATE_SECONDS:
            self._gate_bounded = True
        return not verdict.checked or not verdict.errors
