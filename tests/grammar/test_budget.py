"""Steering to a valid end within a token budget (budget.py, fill_bitmask's tokens_left)."""

from __future__ import annotations

import json

import jsonschema
import numpy as np

from agentrt.grammar import GrammarSpec, allocate_bitmask, allowed_token_ids
from agentrt.grammar.budget import FORCE_SLACK, BudgetSteer, completion

from .helpers import SYNTH_VOCAB, accept_all

SCHEMA = {
    "type": "object",
    "properties": {"s": {"type": "string"}, "n": {"type": "array", "items": {"type": "integer"}},
                   "t": {"type": "string", "pattern": "^[a-c]+/[0-9]+$"}},
    "required": ["s", "n", "t"],
}  # fmt: skip


def looping_model(synth_tok, matcher, budget: int) -> tuple[str, bool]:
    """A model that never wants to stop: it writes `a` (or `1`, or `,`) whenever it may.
    Returns (output, ended with a stop token within the budget)."""
    prefs = [synth_tok.convert_tokens_to_ids(t) for t in ("a", "1", ",")]
    bitmask = allocate_bitmask(1, SYNTH_VOCAB)
    for used in range(budget):
        matcher.fill_bitmask(bitmask, 0, tokens_left=budget - used)
        allowed = allowed_token_ids(bitmask, 0, SYNTH_VOCAB)
        token = next((t for t in prefs if t in allowed), allowed[0])
        assert matcher.accept_token(token)
        if token == 0:
            return matcher.text(), True
    return matcher.text(), False


def test_a_looping_model_still_ends_valid_within_the_budget(synth_compiler, synth_tok) -> None:
    spec = GrammarSpec.from_json_schema(SCHEMA)
    for budget in (40, 90, 150):
        matcher = synth_compiler.compile(spec).matcher()
        text, ended = looping_model(synth_tok, matcher, budget)
        assert ended, text
        jsonschema.validate(json.loads(text), SCHEMA)
        assert matcher.num_steered > 0
        assert matcher.num_tokens <= budget  # the stop token included


def test_without_a_budget_nothing_is_steered(auto_compiler, synth_tok) -> None:
    grammar = auto_compiler.compile(GrammarSpec.from_json_schema(SCHEMA))
    matcher, state = grammar.matcher(), grammar.new_state()
    prefix = synth_tok.encode('{"s": "aaa', add_special_tokens=False)
    assert accept_all(matcher, prefix) == len(prefix) == accept_all(state, prefix)
    plain, budgeted = allocate_bitmask(1, SYNTH_VOCAB), allocate_bitmask(1, SYNTH_VOCAB)
    matcher.fill_bitmask(plain, 0)
    matcher.fill_bitmask(budgeted, 0, tokens_left=1000)  # far from the end: same row
    assert np.array_equal(plain, budgeted) and matcher.num_steered == 0
    path = completion(state, 100, allocate_bitmask(1, SYNTH_VOCAB))
    assert synth_tok.decode(path) == '", "n": [], "t": "a/0"}<eos>'
    assert state.num_tokens == len(prefix)  # the search left the state as it was
    matcher.fill_bitmask(budgeted, 0, tokens_left=len(path) + FORCE_SLACK)
    assert allowed_token_ids(budgeted, 0, SYNTH_VOCAB) == [path[0]] and matcher.num_steered == 1
    matcher.fill_bitmask(budgeted, 0)
    assert np.array_equal(plain, budgeted)


def test_tokens_that_open_something_are_refused_before_the_end(auto_compiler, synth_tok) -> None:
    matcher = auto_compiler.compile(GrammarSpec.from_json_schema(SCHEMA)).matcher()
    accept_all(matcher, synth_tok.encode('{"s": "a b', add_special_tokens=False))
    bitmask = allocate_bitmask(1, SYNTH_VOCAB)
    matcher.fill_bitmask(bitmask, 0, tokens_left=30)  # completion ~17 tokens: no forcing yet
    allowed = {synth_tok.decode([t]) for t in allowed_token_ids(bitmask, 0, SYNTH_VOCAB)}
    assert {"a", '"', " "} <= allowed and not {",", "[", "{"} & allowed


def test_free_text_is_never_steered(auto_compiler) -> None:
    matcher = auto_compiler.compile(GrammarSpec.any_text()).matcher()
    plain, budgeted = allocate_bitmask(1, SYNTH_VOCAB), allocate_bitmask(1, SYNTH_VOCAB)
    matcher.fill_bitmask(plain, 0)
    matcher.fill_bitmask(budgeted, 0, tokens_left=1)
    assert np.array_equal(plain, budgeted) and matcher.num_steered == 0


def test_the_search_never_resets_the_steering(auto_compiler, synth_tok, monkeypatch) -> None:
    # Regression: the completion search accepted and rolled back tokens on the matcher
    # itself, whose rollback reset the steering (its cached completion, next search and
    # refused openers) in the middle of the search. The search now walks the matcher's
    # GrammarState, which cannot reach the steering: only the caller's rollback resets it.
    resets: list[BudgetSteer] = []
    forget = BudgetSteer.forget
    monkeypatch.setattr(BudgetSteer, "forget", lambda self: (resets.append(self), forget(self)))
    matcher = auto_compiler.compile(GrammarSpec.from_json_schema(SCHEMA)).matcher()
    text, ended = looping_model(synth_tok, matcher, 60)
    assert ended and matcher.num_steered > 0, text
    assert resets == []  # dozens of searches, each rolled back, and no reset
    matcher.rollback(2)
    assert len(resets) == 1  # the state moved back: the steering starts over


def test_the_steering_schedule_survives_a_search(auto_compiler, synth_tok, monkeypatch) -> None:
    # The same, seen from the steering: after a search on the matcher's own state (as the
    # steering runs one) openers stay refused and no search is run before the one scheduled.
    matcher = auto_compiler.compile(GrammarSpec.from_json_schema(SCHEMA)).matcher()
    accept_all(matcher, synth_tok.encode('{"s": "a b', add_special_tokens=False))
    searches: list[int] = []
    search = "agentrt.grammar.budget.completion"
    monkeypatch.setattr(search, lambda st, *a: searches.append(1) or completion(st, *a))
    bitmask = allocate_bitmask(1, SYNTH_VOCAB)
    matcher.fill_bitmask(bitmask, 0, tokens_left=30)  # a search: refuse openers from now on
    assert len(searches) == 1 and matcher.num_steered == 1
    path = completion(matcher._state, 100, allocate_bitmask(1, SYNTH_VOCAB))  # walks, rolls back
    assert len(path) > 10
    matcher.fill_bitmask(bitmask, 0, tokens_left=29)  # the next search is scheduled later
    allowed = {synth_tok.decode([t]) for t in allowed_token_ids(bitmask, 0, SYNTH_VOCAB)}
    assert len(searches) == 1 and matcher.num_steered == 2 and not {",", "[", "{"} & allowed


def _refusing_row(real_compiler, smollm2_tok, schema: dict, prefix: str) -> set[str]:
    """The tokens allowed after `prefix` with a budget inside the zone where openers are
    refused (and the completion is not yet forced)."""
    matcher = real_compiler.compile(GrammarSpec.from_json_schema(schema)).matcher()
    ids = smollm2_tok.encode(prefix, add_special_tokens=False)
    assert accept_all(matcher, ids) == len(ids)
    vocab = real_compiler.vocab_size
    state = matcher._state
    path = completion(state, 256, allocate_bitmask(1, vocab))
    bitmask = allocate_bitmask(1, vocab)
    matcher.fill_bitmask(bitmask, 0, tokens_left=len(path) + FORCE_SLACK + 1)
    assert matcher.num_steered == 1
    return {smollm2_tok.decode([t]) for t in allowed_token_ids(bitmask, 0, vocab)}


def test_a_value_may_still_end_with_the_token_that_goes_on_to_a_required_member(
    real_compiler, smollm2_tok
) -> None:
    """Regression: refusing every token holding `,` refused `",`, the token a model ends a
    string value with; the demo's extraction then ran each string to its length cap."""
    two_required = {
        "type": "object",
        "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
        "required": ["a", "b"],
    }
    allowed = _refusing_row(real_compiler, smollm2_tok, two_required, '{"a": "xy')
    assert '",' in allowed and '"' in allowed
    assert not {",", ", ", "[", "{"} & allowed  # a comma inside the value opens nothing new
    # With `b` optional the completion closes the object: `",` would open a member.
    one_required = {**two_required, "required": ["a"]}
    allowed = _refusing_row(real_compiler, smollm2_tok, one_required, '{"a": "xy')
    assert '"' in allowed and '",' not in allowed
