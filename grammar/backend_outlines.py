"""outlines-core backend: regex (and simple JSON schemas via their regex) as a token DFA.

Optional (`pip install 'agentrt[outlines]'`). The index is a full DFA over the vocabulary,
so it suits regexes and small schemas; the router never picks it on its own, only when a
compiler is created with backend="outlines".
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
        import outlines_core
    except ImportError:
        raise BackendUnavailableError("outlines", "outlines") from None
    return outlines_core


class OutlinesBackend:
    name = "outlines"

    def __init__(self, tok: TokenizerData) -> None:
        self._oc = _import()
        self._tok = tok
        stop = set(tok.stop_token_ids)
        table: dict[bytes, list[int]] = {}
        for i, data in enumerate(tok.token_bytes[: tok.tokenizer_vocab_size]):
            if i not in stop and data:
                table.setdefault(data, []).append(i)
        self._vocab = self._oc.Vocabulary(tok.stop_token_ids[0], table)

    def compile_json(self, schema: dict[str, Any] | bool | str, runs: RunLimits) -> OutlinesGrammar:
        # outlines has one whitespace pattern for every gap, so "compact" allows an optional
        # single space anywhere between tokens (json.dumps output included).
        compact = runs.json_whitespace == "compact"
        ws = "[ ]?" if compact else f"[ \\t\\n\\r]{{0,{runs.max_whitespace}}}"
        try:
            text = schema if isinstance(schema, str) else json.dumps(schema)
            pattern = self._oc.json_schema.build_regex_from_schema(text, ws)
        except (ValueError, TypeError) as exc:
            raise GrammarCompileError(f"outlines: {exc}", reason="unsupported") from None
        return self.compile_regex(pattern)

    def compile_regex(self, pattern: str) -> OutlinesGrammar:
        try:
            index = self._oc.Index(pattern, self._vocab)
        except (ValueError, TypeError) as exc:
            raise GrammarCompileError(f"outlines: {exc}", reason="unsupported") from None
        return OutlinesGrammar(self._oc, index, self._tok)

    def compile_grammar(self, text: str, syntax: str) -> OutlinesGrammar:
        raise GrammarCompileError(
            "outlines-core reads regexes and JSON schemas only; use llguidance for Lark "
            "or xgrammar for GBNF grammars",
            reason="unsupported",
        )


class OutlinesGrammar:
    def __init__(self, oc: Any, index: Any, tok: TokenizerData) -> None:
        self._oc = oc
        self._index = index
        self._tok = tok
        self.memory_bytes = 1 << 20  # the index does not report its size; a flat estimate

    def new_matcher(self) -> OutlinesMatcher:
        return OutlinesMatcher(self._oc.Guide(self._index, max_rollback=1 << 16), self._tok)


class OutlinesMatcher:
    def __init__(self, guide: Any, tok: TokenizerData) -> None:
        self._g = guide
        self._stop = frozenset(tok.stop_token_ids)
        self._vocab = tok.tokenizer_vocab_size
        self._words = (tok.tokenizer_vocab_size + 31) // 32
        self._terminated = False

    def fill_row(self, bitmask: np.ndarray, row: int) -> None:
        view = bitmask[row]
        view[:] = 0
        if self._terminated:
            return
        self._g.write_mask_into(view.ctypes.data, self._words, 4)
        if self._vocab % 32:
            view[self._words - 1] &= np.int32((1 << (self._vocab % 32)) - 1)

    def accept(self, token_id: int) -> bool:
        if self._terminated or not 0 <= token_id < self._vocab:
            return False
        if token_id in self._stop:
            if not self._g.is_finished():
                return False
            self._terminated = True
            return True
        if not self._g.accepts_tokens([token_id]):
            return False
        self._g.advance(token_id, False)
        return True

    def is_accepting(self) -> bool:
        return not self._terminated and bool(self._g.is_finished())

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self._terminated:
            self._terminated = False
            num_tokens -= 1  # the stop token did not move the DFA
        if num_tokens:
            self._g.rollback_state(num_tokens)

    def forced_tokens(self) -> list[int]:
        allowed = [] if self._terminated else self._g.get_tokens()
        return allowed if len(allowed) == 1 and allowed[0] not in self._stop else []
