"""Looking ahead for speculative decoding: one bitmask row per draft position, drafts cut at
the first token the grammar refuses, and a matcher that ends every step exactly where
feeding the accepted tokens alone would leave it, steering included."""

from __future__ import annotations

import numpy as np

from agentrt.grammar import GrammarSpec, allocate_bitmask

from .helpers import SYNTH_VOCAB

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "string", "maxLength": 400}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}


def compile_matcher(compiler):
    return compiler.compile(GrammarSpec.from_json_schema(SCHEMA)).matcher()


def row_of(matcher, tokens_left=None) -> np.ndarray:
    mask = allocate_bitmask(1, SYNTH_VOCAB)
    matcher.fill_bitmask(mask, 0, tokens_left=tokens_left)
    return mask[0].copy()


def allowed(row: np.ndarray, token_id: int) -> bool:
    return bool((int(row[token_id >> 5]) >> (token_id & 31)) & 1)


def test_draft_rows_equal_rows_after_feeding_the_drafts(synth_compiler, synth_tok):
    head = synth_tok.encode('{"a": "he', add_special_tokens=False)
    draft = synth_tok.encode('llo", "b": 1', add_special_tokens=False)
    matcher = compile_matcher(synth_compiler)
    assert all(matcher.accept_token(t) for t in head)
    before = row_of(matcher)
    mask = allocate_bitmask(1 + len(draft), SYNTH_VOCAB)
    assert matcher.fill_draft_bitmasks(mask, 0, draft) == 1 + len(draft)
    assert matcher.num_tokens == len(head)  # rolled back
    assert np.array_equal(row_of(matcher), before)
    for j in range(1 + len(draft)):
        fresh = compile_matcher(synth_compiler)
        assert all(fresh.accept_token(t) for t in head + draft[:j])
        assert np.array_equal(mask[j], row_of(fresh)), j


def test_a_refused_draft_cuts_there(synth_compiler, synth_tok):
    head = synth_tok.encode('{"a": "x", "b": ', add_special_tokens=False)
    draft = synth_tok.encode("12a3", add_special_tokens=False)  # 'a' is not a digit
    matcher = compile_matcher(synth_compiler)
    assert all(matcher.accept_token(t) for t in head)
    cut = draft.index(synth_tok.encode("a", add_special_tokens=False)[0])
    assert matcher.num_valid_prefix(draft) == cut
    mask = allocate_bitmask(1 + len(draft), SYNTH_VOCAB)
    assert matcher.fill_draft_bitmasks(mask, 0, draft) == 1 + cut
    assert not allowed(mask[cut], draft[cut])  # its own row refuses it
    untouched = allocate_bitmask(len(draft) - cut, SYNTH_VOCAB)
    assert np.array_equal(mask[cut + 1 :], untouched)  # rows past the refusal: left alone
    assert matcher.num_tokens == len(head)


def test_drafting_within_the_steering_free_rows_steers_as_drafting_off(synth_compiler, synth_tok):
    """A 'model' that wants to write a 300-character string under a 260-token budget: the
    steering must close it. Decoding with drafts (rows from fill_draft_bitmasks, drafts
    only as far as steering_free_tokens allows, verified against the same model) produces
    the same tokens and the same steered count as decoding one token at a time."""
    wanted = synth_tok.encode('{"a": "' + "x" * 300 + '", "b": 7}', add_special_tokens=False)
    eos = 0
    budget = 260

    def choose(row: np.ndarray, position: int) -> int:
        """The model: the wanted token when allowed, else the lowest allowed one."""
        if position < len(wanted) and allowed(row, wanted[position]):
            return wanted[position]
        if position >= len(wanted) and allowed(row, eos):
            return eos
        return next(t for t in range(SYNTH_VOCAB) if allowed(row, t))

    one_by_one = compile_matcher(synth_compiler)
    plain: list[int] = []
    while not plain or plain[-1] != eos:
        plain.append(choose(row_of(one_by_one, budget - len(plain)), len(plain)))
        assert one_by_one.accept_token(plain[-1])
    assert one_by_one.num_steered > 0 and len(plain) <= budget

    drafting = compile_matcher(synth_compiler)
    out: list[int] = []
    num_drafted = 0
    while not out or out[-1] != eos:
        left = budget - len(out)
        k = min(4, drafting.steering_free_tokens(left) - 1)
        draft = wanted[len(out) : len(out) + max(0, k)]
        draft = draft[: drafting.num_valid_prefix(draft)]
        mask = allocate_bitmask(1 + len(draft), SYNTH_VOCAB)
        drafting.fill_draft_bitmasks(mask, 0, draft, tokens_left=left)
        accepted = 0
        while (
            accepted < len(draft) and choose(mask[accepted], len(out) + accepted) == draft[accepted]
        ):
            accepted += 1
        step = draft[:accepted] + [choose(mask[accepted], len(out) + accepted)]
        num_drafted += len(draft)
        for token_id in step:
            assert drafting.accept_token(token_id)
        out += step
    assert num_drafted > 100  # most of the string was drafted
    assert out == plain
    assert drafting.num_steered == one_by_one.num_steered


def test_forced_tokens_join_a_draft_which_goes_on_after_them(synth_compiler, synth_tok):
    """With jump-forward, forced tokens are appended unsampled: they join a draft after the
    token that makes the grammar force them (flagged forced). A draft that spells them the
    same way goes on; one that spells them otherwise (or has nothing left) goes on with
    `more`, drafted anew after them; without `more` it ends with them."""
    head = synth_tok.encode('{"a": "x"', add_special_tokens=False)
    draft = synth_tok.encode(', "zzz', add_special_tokens=False)
    matcher = compile_matcher(synth_compiler)
    assert all(matcher.accept_token(t) for t in head)
    reference = compile_matcher(synth_compiler)
    assert all(reference.accept_token(t) for t in head)
    cut = next(
        i + 1
        for i, t in enumerate(draft)
        if reference.accept_token(t) and reference.forced_tokens()
    )
    forced = reference.forced_tokens()
    assert forced  # the next key is forced after the comma
    flags = [False] * cut + [True] * len(forced)

    got, got_flags = matcher.draft_with_forced(draft, 20)
    assert got == draft[:cut] + forced and got_flags == flags
    capped, capped_flags = matcher.draft_with_forced(draft, cut + 1)
    assert capped == draft[:cut] + forced[:1] and capped_flags == flags[: cut + 1]

    value = synth_tok.encode("12}", add_special_tokens=False)
    asked = []

    def more(drafted: list[int]) -> list[int]:
        asked.append(list(drafted))
        return value + value  # the grammar refuses the second copy

    got, got_flags = matcher.draft_with_forced(draft, 20, more)
    assert asked == [draft[:cut] + forced]
    assert got == draft[:cut] + forced + value
    assert got_flags == flags + [False] * len(value)
    same = draft[:cut] + forced + value
    assert matcher.draft_with_forced(same, 20, more) == (got, got_flags)
    assert len(asked) == 1  # spelt as forced: the draft went on without `more`
    assert matcher.num_tokens == len(head)
