"""xgrammar backend: fast pushdown-automaton grammars with precomputed token masks.

xgrammar compiles almost any schema but silently ignores some keywords and approximates
others, so the router uses it when llguidance refuses a schema, and such grammars are
always post-checked (see router.py). strict_mode=False keeps JSON Schema's meaning of a
missing `additionalProperties` (extra keys allowed).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from .backend import TokenizerData
from .errors import GrammarCompileError
from .limits import RunLimits


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tok: TokenizerData) -> None:
        import xgrammar as xg

        self._xg = xg
        self._tok = tok
        self._info = xg.TokenizerInfo.from_huggingface(
            tok.hf_tokenizer, vocab_size=tok.vocab_size, stop_token_ids=list(tok.stop_token_ids)
        )
        # Caching is done by GrammarCompiler (keyed by spec); one thread keeps the engine's
        # CPU share predictable.
        self._compiler = xg.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)

    def compile_json(self, schema: dict[str, Any] | bool | str, runs: RunLimits) -> XGrammarGrammar:
        text = schema if isinstance(schema, str) else json.dumps(schema)
        if runs.json_whitespace == "compact":
            ws: dict[str, Any] = {"any_whitespace": False, "separators": (", ", ": ")}
        else:
            ws = {"any_whitespace": True, "max_whitespace_cnt": runs.max_whitespace}
        return self._run(lambda: self._compiler.compile_json_schema(text, strict_mode=False, **ws))

    def compile_regex(self, pattern: str) -> XGrammarGrammar:
        return self._run(lambda: self._compiler.compile_regex(pattern))

    def compile_grammar(self, text: str, syntax: str) -> XGrammarGrammar:
        if syntax != "gbnf":
            raise GrammarCompileError(
                "xgrammar reads GBNF/EBNF grammars, not Lark; use the llguidance backend "
                "or GrammarSpec.from_ebnf(..., syntax='gbnf')",
                reason="unsupported",
            )
        return self._run(lambda: self._compiler.compile_grammar(text))

    def _run(self, fn: Any) -> XGrammarGrammar:
        try:
            compiled = fn()
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarCompileError(f"xgrammar: {exc}", reason="unsupported") from None
        return XGrammarGrammar(compiled, self._tok)


class XGrammarGrammar:
    def __init__(self, compiled: Any, tok: TokenizerData) -> None:
        import xgrammar as xg

        self._xg = xg
        self._compiled = compiled
        self._tok = tok
        self.memory_bytes = int(compiled.memory_size_bytes)

    def new_matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(self._xg.GrammarMatcher(self._compiled), self._tok)


class XGrammarMatcher:
    def __init__(self, m: Any, tok: TokenizerData) -> None:
        self._m = m
        self._vocab = tok.tokenizer_vocab_size
        self._stop = frozenset(tok.stop_token_ids)

    def fill_row(self, bitmask: np.ndarray, row: int) -> None:
        if self._m.is_terminated():
            bitmask[row] = 0
            return
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        if not 0 <= token_id < self._vocab:
            return False
        return bool(self._m.accept_token(token_id))

    def is_accepting(self) -> bool:
        return not self._m.is_terminated() and bool(self._m.is_completed())

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def forced_tokens(self) -> list[int]:
        if self._m.is_terminated():
            return []
        return [t for t in self._m.find_jump_forward_tokens() if t not in self._stop]
