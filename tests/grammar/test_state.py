"""`GrammarState`: the digit-run cap and the EOS gate stay exact across rollbacks."""

from __future__ import annotations

from agentrt.grammar import GrammarCompiler, GrammarSpec, RunLimits

from .helpers import SYNTH_VOCAB, accept_all, allowed_now


def test_the_digit_cap_counts_exactly_after_a_rollback(synth_tok) -> None:
    # The run used to be recounted from the last 64 tokens after a rollback, so a cap above
    # 64 let a longer run through.
    compiler = GrammarCompiler(
        synth_tok, vocab_size=SYNTH_VOCAB, run_limits=RunLimits(max_digit_run=100)
    )
    state = compiler.compile(GrammarSpec.from_json_schema({"type": "string"})).new_state()
    one = synth_tok.convert_tokens_to_ids("1")
    prefix = synth_tok.encode('"', add_special_tokens=False)
    assert accept_all(state, [*prefix, *[one] * 99]) == len(prefix) + 99
    state.rollback(1)
    assert state.accept_token(one) and state.accept_token(one)  # the 99th and 100th digit
    assert not state.accept_token(one)
    assert state.accept_token(synth_tok.convert_tokens_to_ids("a"))
    assert state.accept_token(one)  # a new run


def test_the_eos_verdict_is_not_reused_for_other_text_of_the_same_length(
    auto_compiler, synth_tok
) -> None:
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    matcher = auto_compiler.compile(GrammarSpec.from_json_schema(schema)).matcher()
    assert accept_all(matcher, synth_tok.encode("[1, 1]", add_special_tokens=False)) == 6
    assert not matcher.can_terminate() and 0 not in allowed_now(matcher)  # uniqueItems
    matcher.rollback(2)
    assert accept_all(matcher, synth_tok.encode("2]", add_special_tokens=False)) == 2
    assert matcher.num_tokens == 6 and matcher.can_terminate() and 0 in allowed_now(matcher)


def test_the_eos_gate_spends_bounded_time_on_a_schema_whose_check_explodes(
    auto_compiler, synth_tok
) -> None:
    # Each level of this array is checked twice by jsonschema (anyOf of two refs to itself):
    # the gate used to check every step where the grammar could end, at 2^depth cost each.
    import time

    from agentrt.grammar.state import MAX_GATE_SECONDS

    from .test_validate import SELF_ANY_OF

    grammar = auto_compiler.compile(GrammarSpec.from_json_schema(SELF_ANY_OF))
    matcher = grammar.matcher()
    depth = 24
    start = time.monotonic()
    opened = accept_all(matcher, synth_tok.encode("[" * depth, add_special_tokens=False))
    closing = synth_tok.encode("]", add_special_tokens=False)
    for _ in range(opened):
        assert accept_all(matcher, closing) == len(closing)
        matcher.can_terminate()
        allowed_now(matcher)
    assert time.monotonic() - start < MAX_GATE_SECONDS + 2.0
    assert matcher.can_terminate()  # closed: the grammar decides once the check is bounded
