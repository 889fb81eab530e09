"""Prompt lookup by text: a value copied from the prompt into a JSON string is drafted from
its first characters, though its first tokens never occur in the prompt."""

from __future__ import annotations

import pytest

from agentrt.engine.config import SpeculativeConfig
from agentrt.engine.model.checkpoint import load_tokenizer
from agentrt.engine.spec_decode.base import DraftContext
from agentrt.engine.spec_decode.ngram import NgramProposer
from agentrt.engine.spec_decode.suffix import SuffixProposer
from agentrt.engine.spec_decode.text_lookup import TextLookup

DOCUMENT = "Invoice from Northwind Ltd\nContact: Kenji Haddad\nE-mail: kenji.haddad@northwind.com\n"


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return load_tokenizer(smollm2_dir)


def context(tokenizer, output: str, req_id: str = "r") -> DraftContext:
    prompt_ids = tokenizer.encode(DOCUMENT, add_special_tokens=False)
    output_ids = tokenizer.encode(output, add_special_tokens=False)
    return DraftContext(req_id, prompt_ids + output_ids, len(prompt_ids), cache_key=None)


def test_the_tokens_of_a_value_in_a_json_string_are_not_the_documents(tokenizer):
    """Why the text lookup exists: `"Ken` is not a token sequence of the document."""
    doc = tokenizer.encode(DOCUMENT, add_special_tokens=False)
    value_start = tokenizer.encode('{"name": "Ken', add_special_tokens=False)[-1]
    assert value_start not in doc


def test_drafts_the_rest_of_the_value_and_the_closing_quote(tokenizer):
    lookup = TextLookup(tokenizer)
    draft = lookup.propose(context(tokenizer, '{"name": "Ken'), 8)
    assert tokenizer.decode(draft) == 'ji Haddad"'  # the line ends: so does the string


def test_a_draft_cut_by_max_tokens_drops_a_partial_last_token(tokenizer):
    lookup = TextLookup(tokenizer)
    draft = lookup.propose(context(tokenizer, '{"email": "kenji.'), 2)
    assert len(draft) <= 2
    assert "haddad@northwind.com".startswith(tokenizer.decode(draft))


def test_no_draft_without_a_match_of_three_characters(tokenizer):
    lookup = TextLookup(tokenizer)
    assert lookup.propose(context(tokenizer, '{"name": "Zq'), 8) == []
    assert lookup.propose(context(tokenizer, "Zq"), 0) == []


def test_the_prompt_text_is_forgotten_and_a_reused_id_is_read_anew(tokenizer):
    lookup = TextLookup(tokenizer)
    lookup.propose(context(tokenizer, '{"name": "Ken'), 4)
    other_prompt = tokenizer.encode("Contact: Kenneth Brown\n", add_special_tokens=False)
    output = tokenizer.encode('{"name": "Ken', add_special_tokens=False)
    other = DraftContext("r", other_prompt + output, len(other_prompt), cache_key=None)
    assert tokenizer.decode(lookup.propose(other, 8)) == 'neth Brown"'
    lookup.drop("r")
    assert not lookup._prompts


@pytest.mark.parametrize("make", [NgramProposer, SuffixProposer])
def test_proposers_use_it_where_tokens_match_less_than_two(tokenizer, make):
    config = SpeculativeConfig(method=make.method)
    with_text, tokens_only = make(config, tokenizer), make(config)
    ctx = context(tokenizer, '{"name": "Ken')
    assert tokenizer.decode(with_text.propose([ctx], [8])[0]) == 'ji Haddad"'
    assert tokens_only.propose([ctx], [8])[0] != with_text.propose([ctx], [8])[0]
    # A longer token match is kept: the output repeats the document's own tokens.
    ctx = context(tokenizer, "Contact: Kenji")
    token_draft = tokens_only.propose([ctx], [4])[0]
    assert with_text.propose([ctx], [4])[0] == token_draft
    with_text.request_finished(ctx, completed=False)
    assert not with_text._text._prompts
