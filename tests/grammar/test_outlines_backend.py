"""The optional outlines-core backend (regex / choice / simple JSON) on the synthetic vocab."""

from __future__ import annotations

import pytest

from agentrt.grammar import (
    GrammarCompileError,
    GrammarCompiler,
    GrammarSpec,
    allocate_bitmask,
    allowed_token_ids,
)

from .helpers import SYNTH_VOCAB, accept_all, allowed_now, drive

pytest.importorskip("outlines_core")


@pytest.fixture(scope="module")
def compiler(synth_tok) -> GrammarCompiler:
    return GrammarCompiler(synth_tok, vocab_size=SYNTH_VOCAB, backend="outlines")


def test_regex_choice_and_padding(compiler, synth_tok) -> None:
    g = compiler.compile(GrammarSpec.from_regex(r"[a-c]{2}\d"))
    assert g.backend == "outlines"
    assert drive(g.matcher(), synth_tok, "ab7") == (True, True)
    assert drive(g.matcher(), synth_tok, "ax7")[0] is False
    c = compiler.compile(GrammarSpec.from_choice(["a.b", "c+d"]))
    assert drive(c.matcher(), synth_tok, "a.b") == (True, True)
    assert drive(c.matcher(), synth_tok, "axb")[0] is False
    m = c.matcher()
    bitmask = allocate_bitmask(1, SYNTH_VOCAB)
    m.fill_bitmask(bitmask, 0)
    assert max(allowed_token_ids(bitmask, 0, SYNTH_VOCAB)) < len(synth_tok)


def test_json_rollback_and_forced(compiler, synth_tok) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    g = compiler.compile(GrammarSpec.from_json_schema(schema))
    assert g.gate_eos  # outlines' schema regexes are approximate: final check stays on
    m = g.matcher()
    # Two tokens ("{" and the merge '{"') can start the output: nothing is forced yet.
    assert m.forced_tokens() == []
    ids = synth_tok.encode('{"ok": true}', add_special_tokens=False)
    assert accept_all(m, ids) == len(ids) and m.can_terminate()
    m.rollback(2)
    assert not m.can_terminate()
    assert accept_all(m, ids[-2:]) == 2 and m.can_terminate()
    assert m.accept_token(0) and allowed_now(m) == []  # nothing follows the stop token


def test_grammars_are_refused_with_a_hint(compiler) -> None:
    with pytest.raises(GrammarCompileError, match="llguidance"):
        compiler.compile(GrammarSpec.from_ebnf('start: "a"'))
