"""The protocol every grammar backend implements, and the token vocabulary they share.

A backend turns a (normalized, relaxed) schema, regex or grammar into a `BackendGrammar`;
each request gets its own `BackendMatcher` from it. Backends import their library lazily, so
importing `agentrt.grammar` never needs llguidance or outlines-core.

Bitmask invariant (xgrammar layout): int32 words, bit `i % 32` of word `i // 32` set means
token `i` is allowed. `fill_row` writes exactly one row and sets no bit for ids at or above
the tokenizer vocabulary (padded logits columns).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .bitmask import pack_bits
from .limits import RunLimits


@dataclass(frozen=True, slots=True)
class TokenizerData:
    """Everything a backend needs to know about the tokenizer, computed once per compiler.

    hf_tokenizer: the HF tokenizer; vocab_size: logits width (>= tokenizer vocab);
    tokenizer_vocab_size: ids below it are real tokens; stop_token_ids: ids that end output;
    token_bytes: decoded bytes of every id below vocab_size (b"" for padding ids).
    """

    hf_tokenizer: Any
    vocab_size: int
    tokenizer_vocab_size: int
    stop_token_ids: tuple[int, ...]
    token_bytes: tuple[bytes, ...]
    fingerprint: str
    digit_start_words: np.ndarray  # uint32 [ceil(vocab_size/32)]: token starts with a digit
    digit_only: np.ndarray  # bool [vocab_size]: token is all digits
    digit_tail: np.ndarray  # int32 [vocab_size]: digits at the end of the token
    finish_rank: np.ndarray  # int32 token ids, preferred first by completions (budget.py)
    opener_words: np.ndarray  # uint32 [ceil(vocab_size/32)]: token holds `{`, `[` or `,`
    closing_openers: dict[bytes, int]  # opener tokens that start by closing (`",`), by bytes


def digit_tables(token_bytes: tuple[bytes, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-token digit facts used to cap digit runs (see RunLimits.max_digit_run)."""
    n = len(token_bytes)
    starts = np.zeros(n, dtype=bool)
    only = np.zeros(n, dtype=bool)
    tail = np.zeros(n, dtype=np.int32)
    for i, data in enumerate(token_bytes):
        if data[:1].isdigit():
            starts[i] = True
        stripped = data.rstrip(b"0123456789")
        tail[i] = len(data) - len(stripped)
        only[i] = bool(data) and not stripped
    return pack_bits(starts), only, tail


class BackendMatcher(Protocol):
    def fill_row(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed-token mask into `bitmask[row]` (state is unchanged)."""

    def accept(self, token_id: int) -> bool:
        """Advance by one token; on False the token was not allowed and state is unchanged."""

    def is_accepting(self) -> bool:
        """The text so far is a complete output (a stop token would be allowed)."""

    def rollback(self, num_tokens: int) -> None: ...

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next (jump-forward); state is unchanged."""


class BackendGrammar(Protocol):
    memory_bytes: int

    def new_matcher(self) -> BackendMatcher: ...


class GrammarBackend(Protocol):
    name: str

    def compile_json(self, schema: dict[str, Any] | bool | str, runs: RunLimits) -> BackendGrammar:
        """`schema` is a schema or its JSON text; raise GrammarCompileError on failure."""

    def compile_regex(self, pattern: str) -> BackendGrammar: ...

    def compile_grammar(self, text: str, syntax: str) -> BackendGrammar:
        """syntax: "lark" or "gbnf"."""
