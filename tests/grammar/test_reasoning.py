"""Reasoning before the schema (grammar/reasoning.py): a `<think>` block, then the answer's
grammar; the reasoning budget forces the end marker; drafts and rollbacks cross the end."""

from __future__ import annotations

import numpy as np
import pytest

from agentrt.grammar import GrammarCompiler, GrammarSpec, allocate_bitmask
from agentrt.grammar.reasoning import (
    REASONING_PARSERS,
    detect_reasoning,
    with_reasoning,
)

QWEN3 = REASONING_PARSERS["qwen3"]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
ANSWER = '{"name": "Ann", "age": 41}'


def _allowed(matcher, vocab_size: int) -> list[int]:
    bitmask = allocate_bitmask(1, vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    bits = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")
    return np.flatnonzero(bits).tolist()


def _feed(matcher, ids: list[int]) -> int:
    for i, token_id in enumerate(ids):
        if not matcher.accept_token(token_id):
            return i
    return len(ids)


def test_text_markers_then_the_schema(real_compiler, smollm2_tok):
    """SmolLM2 has no `<think>` token: the markers are text, the start forced."""
    spec = with_reasoning(GrammarSpec.from_json_schema(SCHEMA), QWEN3, opened=False)
    grammar = real_compiler.compile(spec)
    text = "<think>The user said Ann, 41. Not </thi nk yet.</think>" + ANSWER
    ids = smollm2_tok.encode(text, add_special_tokens=False)
    matcher = grammar.matcher()
    assert _feed(matcher, ids) == len(ids)
    assert matcher.text() == ANSWER and matcher.validate_final() == []
    assert matcher.can_terminate() and matcher.accept_token(smollm2_tok.eos_token_id)
    # The answer starts right after the end marker: no second reasoning block, and no
    # answer before the block is closed.
    matcher = grammar.matcher()
    prefix = smollm2_tok.encode("<think>x</think>", add_special_tokens=False)
    assert _feed(matcher, prefix) == len(prefix)
    assert not matcher.accept_token(smollm2_tok.encode("x", add_special_tokens=False)[0])
    assert not grammar.matcher().accept_token(smollm2_tok.encode("{", add_special_tokens=False)[0])
    # Nothing to think with an opened block: the text goes on from the template's `<think>`.
    opened = real_compiler.compile(
        with_reasoning(GrammarSpec.from_json_schema(SCHEMA), QWEN3, opened=True)
    )
    ids = smollm2_tok.encode("ok</think>" + ANSWER, add_special_tokens=False)
    assert _feed(opened.matcher(), ids) == len(ids)


def test_the_reasoning_budget_forces_the_end_marker(real_compiler, smollm2_tok):
    spec = with_reasoning(
        GrammarSpec.from_json_schema(SCHEMA), QWEN3, opened=True, max_reasoning_tokens=3
    )
    grammar = real_compiler.compile(spec)
    matcher = grammar.matcher()
    words = smollm2_tok.encode(" one two three four", add_special_tokens=False)
    assert _feed(matcher, words[:3]) == 3
    end_ids = list(grammar.end_ids)
    assert _allowed(matcher, real_compiler.vocab_size) == [end_ids[0]]
    assert not matcher.accept_token(words[3])
    forced = matcher.forced_tokens()  # jump-forward appends the whole marker, and goes on
    assert forced[: len(end_ids)] == end_ids  # across it into what the answer forces
    assert smollm2_tok.decode(forced).startswith('</think>{"name')
    assert matcher.num_tokens == 3  # (looked ahead, not moved)
    assert _feed(matcher, end_ids) == len(end_ids)
    assert matcher.in_answer and smollm2_tok.decode([_allowed(matcher, 49152)[0]]) != ""
    ids = smollm2_tok.encode(ANSWER, add_special_tokens=False)
    assert _feed(matcher, ids) == len(ids) and matcher.validate_final() == []


def test_draft_rows_and_rollback_cross_the_end_marker(real_compiler, smollm2_tok):
    spec = with_reasoning(GrammarSpec.from_json_schema(SCHEMA), QWEN3, opened=True)
    grammar = real_compiler.compile(spec)
    ids = smollm2_tok.encode("so</think>" + ANSWER, add_special_tokens=False)
    vocab = real_compiler.vocab_size
    drafting, stepping = grammar.matcher(), grammar.matcher()
    rows = allocate_bitmask(len(ids) + 1, vocab)
    assert drafting.fill_draft_bitmasks(rows, 0, ids, tokens_left=500) == len(ids) + 1
    assert drafting.num_tokens == 0 and drafting.num_valid_prefix(ids) == len(ids)
    for j, token_id in enumerate(ids):
        one = allocate_bitmask(1, vocab)
        stepping.fill_bitmask(one, 0, tokens_left=500 - j)
        assert np.array_equal(one[0], rows[j]), j
        assert stepping.accept_token(token_id)
    stepping.rollback(len(ids) - 1)  # back into the reasoning
    assert not stepping.in_answer and stepping.text() == ""
    assert _feed(stepping, ids[1:]) == len(ids) - 1 and stepping.text() == ANSWER


@pytest.fixture(scope="module")
def think_tok(qwen_tokenizer_dir):
    """Qwen2.5's tokenizer with Qwen3's `<think>` / `</think>` added as single tokens."""
    from agentrt.engine.loader.tokenizer import load_tokenizer

    tok = load_tokenizer(qwen_tokenizer_dir)
    tok.add_tokens(["<think>", "</think>"], special_tokens=False)
    tok.chat_template = "{{ enable_thinking }}<think></think>"
    return tok


def test_single_token_markers_and_an_optional_block(think_tok):
    compiler = GrammarCompiler(think_tok, timeout_s=120)
    start_id, end_id = think_tok.convert_tokens_to_ids(["<think>", "</think>"])
    assert detect_reasoning(think_tok) == QWEN3
    spec = with_reasoning(GrammarSpec.from_json_schema(SCHEMA), QWEN3, opened=False, optional=True)
    grammar = compiler.compile(spec)
    assert grammar.end_ids == (end_id,)
    first = _allowed(grammar.matcher(), compiler.vocab_size)
    brace = think_tok.encode('{"', add_special_tokens=False)[0]
    assert start_id in first and brace in first and end_id not in first
    thought = think_tok.encode("<think>\nHmm, </think>", add_special_tokens=False)
    assert thought[0] == start_id and thought[-1] == end_id
    answer = think_tok.encode(ANSWER, add_special_tokens=False)
    for ids in (thought + answer, answer):  # reasoned, or answered at once
        matcher = grammar.matcher()
        assert _feed(matcher, ids) == len(ids) and matcher.text() == ANSWER
