"""agentrt.grammar: specs -> compiled grammars -> per-request matchers -> token bitmasks.

    compiler = GrammarCompiler(hf_tokenizer, vocab_size=None)
    grammar = compiler.compile(GrammarSpec.from_json_schema(schema))
    matcher = grammar.matcher()
    bitmask = allocate_bitmask(rows, compiler.vocab_size)
    matcher.fill_bitmask(bitmask, row); matcher.accept_token(tok); matcher.rollback(n)

Imports nothing from other agentrt packages.
"""

from __future__ import annotations

from .bitmask import allocate_bitmask, allowed_token_ids, bitmask_words
from .compiler import GrammarCompiler
from .errors import (
    BackendUnavailableError,
    GrammarCompileError,
    GrammarCompileTimeout,
    GrammarError,
    GrammarSpecError,
    MatcherStateError,
    SchemaLimitError,
)
from .limits import GenerationBounds, RunLimits, SchemaLimits
from .matcher import Grammar, GrammarMatcher
from .report import GrammarReport, KeywordStatus
from .spec import GrammarSpec

__all__ = [
    "BackendUnavailableError",
    "GenerationBounds",
    "Grammar",
    "GrammarCompileError",
    "GrammarCompileTimeout",
    "GrammarCompiler",
    "GrammarError",
    "GrammarMatcher",
    "GrammarReport",
    "GrammarSpec",
    "GrammarSpecError",
    "KeywordStatus",
    "MatcherStateError",
    "RunLimits",
    "SchemaLimitError",
    "SchemaLimits",
    "allocate_bitmask",
    "allowed_token_ids",
    "bitmask_words",
]
