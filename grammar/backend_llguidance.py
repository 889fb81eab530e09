"""llguidance backend: exact JSON-schema grammars (an Earley parser over a lazy lexer).

llguidance refuses what it cannot enforce instead of approximating it, which is why the
router prefers it. Its matchers never raise on bad input: they enter an error state, so
`accept` checks a token before consuming it.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from .backend import TokenizerData
from .errors import BackendUnavailableError, GrammarCompileError
from .limits import RunLimits


def _import() -> Any:
    try:
        import llguidance
        import llguidance.hf
    except ImportError:
        raise BackendUnavailableError("llguidance", "llguidance") from None
    return llguidance


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, tok: TokenizerData) -> None:
        llg = _import()
        self._llg = llg
        self._tok = tok
        self._lltok = llg.hf.from_tokenizer(
            tok.hf_tokenizer,
            n_vocab=tok.tokenizer_vocab_size,
            eos_token=list(tok.stop_token_ids),
            slices=llg.LLTokenizer.json_slices(),
        )
        self._words = (tok.tokenizer_vocab_size + 31) // 32

    def grammar_for_json(self, schema: dict[str, Any] | bool | str, runs: RunLimits) -> str:
        if runs.json_whitespace == "compact":
            options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        else:
            options = {
                "whitespace_flexible": True,
                "whitespace_pattern": f"[\\x20\\x0A\\x0D\\x09]{{0,{runs.max_whitespace}}}",
                "item_separator": ",",
                "key_separator": ":",
            }
        try:
            text = schema if isinstance(schema, str) else json.dumps(schema)
            return self._llg.LLMatcher.grammar_from_json_schema(text, defaults=options)
        except ValueError as exc:
            raise GrammarCompileError(f"llguidance: {exc}") from None

    def compile_json(
        self, schema: dict[str, Any] | bool | str, runs: RunLimits
    ) -> LLGuidanceGrammar:
        return self._build(self.grammar_for_json(schema, runs))

    def compile_regex(self, pattern: str) -> LLGuidanceGrammar:
        return self._build(self._llg.LLMatcher.grammar_from_regex(pattern))

    def compile_grammar(self, text: str, syntax: str) -> LLGuidanceGrammar:
        if syntax == "gbnf":
            text = self._llg.gbnf_to_lark(text)
        return self._build(self._llg.LLMatcher.grammar_from_lark(text))

    def _build(self, grammar: str) -> LLGuidanceGrammar:
        # Constructing the first matcher is the real compilation (lexer, parser tables).
        template = self._llg.LLMatcher(self._lltok, grammar, log_level=0)
        if template.is_error():
            raise GrammarCompileError(f"llguidance: {template.get_error()}", reason="unsupported")
        return LLGuidanceGrammar(template, self._tok, self._words, len(grammar) * 8 + 65_536)


class LLGuidanceGrammar:
    def __init__(self, template: Any, tok: TokenizerData, words: int, memory: int) -> None:
        self._template = template
        self._tok = tok
        self._words = words
        self.memory_bytes = memory

    def new_matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._template.deep_copy(), self._tok, self._words)


class LLGuidanceMatcher:
    def __init__(self, m: Any, tok: TokenizerData, words: int) -> None:
        self._m = m
        self._stop = frozenset(tok.stop_token_ids)
        self._vocab = tok.tokenizer_vocab_size
        self._words = words
        self._terminated = False
        self._bitmask: np.ndarray | None = None
        self._ptr = 0

    def fill_row(self, bitmask: np.ndarray, row: int) -> None:
        if self._terminated:
            bitmask[row] = 0
            return
        if bitmask is not self._bitmask:  # the engine reuses one buffer: cache its address
            self._bitmask, self._ptr = bitmask, bitmask.ctypes.data
        row_bytes = bitmask.shape[1] * 4
        self._m.unsafe_compute_mask_ptr(self._ptr + row * row_bytes, self._words * 4)
        if row_bytes > self._words * 4:
            bitmask[row, self._words :] = 0  # padded logits columns are never allowed
        if self._vocab % 32:
            bitmask[row, self._words - 1] &= np.int32((1 << (self._vocab % 32)) - 1)

    def accept(self, token_id: int) -> bool:
        if self._terminated or not 0 <= token_id < self._vocab:
            return False
        if token_id in self._stop:
            if not self._m.is_accepting():
                return False
            # The stop token is not fed to llguidance: it does not count it as a token once
            # the grammar is already complete, which would make rollback(n) miscount.
            self._terminated = True
            return True
        if self._m.validate_tokens([token_id]) != 1:
            return False
        return bool(self._m.consume_token(token_id))

    def is_accepting(self) -> bool:
        return not self._terminated and bool(self._m.is_accepting())

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self._terminated:
            self._terminated = False
            num_tokens -= 1  # the stop token never reached llguidance
        if num_tokens:
            self._m.rollback(num_tokens)

    def forced_tokens(self) -> list[int]:
        if self._terminated:
            return []
        return [t for t in self._m.compute_ff_tokens() if t not in self._stop]
