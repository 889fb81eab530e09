"""Prompt lookup by text: a value copied from the prompt into a JSON string is drafted from
its first characters, though its first tokens never occur in the prompt."""

from __future__ import annotations

import pytest

from agentrt.engine.config import SpeculativeConfig
from agentrt.engine.loader.tokenizer import load_tokenizer
from agentrt.engine.spec_decode.base import DraftContext
from agentrt.engine.spec_decode.ngram import NgramProposer
from agentrt.engine.spec_decode.suffix import SuffixProposer
from agentrt.engine.spec_decode.text_lookup import TextLookup

DOCUMENT = (
    "Invoice from Northwind Ltd\nContact: Kenji Haddad\nE-mail: kenji.haddad@northwind.com\n"
    "Total due (incl. VAT): 1234.50 EUR\n"
    "Address: 134 Mill Lane, Porto, Portugal  Phone: +351 22 555\n"
)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return load_tokenizer(smollm2_dir)


def context(
    tokenizer, output: str, req_id: str = "r", structured: bool = True, drafted: str = ""
) -> DraftContext:
    prompt_ids = tokenizer.encode(DOCUMENT, add_special_tokens=False)
    output_ids = tokenizer.encode(output, add_special_tokens=False)
    return DraftContext(
        req_id,
        prompt_ids + output_ids,
        len(prompt_ids),
        cache_key=None,
        structured=structured,
        draft_ids=tokenizer.encode(drafted, add_special_tokens=False),
    )


def test_the_tokens_of_a_value_in_a_json_string_are_not_the_documents(tokenizer):
    """Why the text lookup exists: `"Ken` is not a token sequence of the document."""
    doc = tokenizer.encode(DOCUMENT, add_special_tokens=False)
    value_start = tokenizer.encode('{"name": "Ken', add_special_tokens=False)[-1]
    assert value_start not in doc


def test_drafts_the_rest_of_the_value_its_closing_quote_and_the_comma(tokenizer):
    """The value ends with its line; `",` follows as one token, as the model writes it."""
    lookup = TextLookup(tokenizer)
    draft = lookup.propose(context(tokenizer, '{"name": "Ken'), 8)
    assert tokenizer.decode(draft) == 'ji Haddad",'
    assert draft[-1] == tokenizer.encode('",', add_special_tokens=False)[0]


@pytest.mark.parametrize(
    ("output", "value"),
    [
        ('{"street": "134 Mill', " Lane"),  # ", " ends it
        ('{"email": "kenji.', "haddad@northwind.com"),  # the line ends it
        ('{"country": "Portug', "al"),  # two spaces end it
    ],
)
def test_a_structured_value_ends_at_a_separator_of_the_document(tokenizer, output, value):
    lookup = TextLookup(tokenizer)
    assert tokenizer.decode(lookup.propose(context(tokenizer, output), 16)) == value + '",'


def test_free_text_copies_to_the_end_of_the_line(tokenizer):
    lookup = TextLookup(tokenizer)
    draft = lookup.propose(context(tokenizer, "Ship to 134 Mill", structured=False), 32)
    assert tokenizer.decode(draft) == " Lane, Porto, Portugal  Phone: +351 22 555\n"


@pytest.mark.parametrize(
    ("output", "value"), [('{"name": "K', "enji Haddad"), ('["1', "34 Mill Lane")]
)
def test_a_value_of_one_or_two_characters_is_found_where_a_word_starts(tokenizer, output, value):
    """`"K` has no three characters to match: a word of the document that starts with the
    value's characters is its most likely source (`Kenji`, not the `k` inside a word)."""
    lookup = TextLookup(tokenizer)
    assert tokenizer.decode(lookup.propose(context(tokenizer, output), 8)) == value + '",'
    assert lookup.propose(context(tokenizer, output, structured=False), 8) == []
    assert lookup.propose(context(tokenizer, '{"name": "Zq'), 8) == []


def test_drafts_after_the_tokens_drafted_so_far(tokenizer):
    """`draft_ids` continue the output: the lookup drafts what follows them."""
    lookup = TextLookup(tokenizer)
    draft = lookup.propose(
        context(tokenizer, '{"name": "Kenji Haddad", "email": "k', drafted="enji"), 16
    )
    assert tokenizer.decode(draft) == '.haddad@northwind.com",'


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
    other = DraftContext(
        "r", other_prompt + output, len(other_prompt), cache_key=None, structured=True
    )
    assert tokenizer.decode(lookup.propose(other, 8)) == 'neth Brown",'
    lookup.drop("r")
    assert not lookup._prompts


@pytest.mark.parametrize("make", [NgramProposer, SuffixProposer])
def test_proposers_use_it_where_tokens_match_less_than_two(tokenizer, make):
    config = SpeculativeConfig(method=make.method)
    with_text, tokens_only = make(config, tokenizer), make(config)
    ctx = context(tokenizer, '{"name": "Ken')
    assert tokenizer.decode(with_text.propose([ctx], [8])[0]) == 'ji Haddad",'
    assert tokens_only.propose([ctx], [8])[0] != with_text.propose([ctx], [8])[0]
    # A longer token match is kept in free text: the output repeats the document's tokens.
    ctx = context(tokenizer, "Contact: Kenji", structured=False)
    token_draft = tokens_only.propose([ctx], [4])[0]
    assert with_text.propose([ctx], [4])[0] == token_draft
    # A structured output that copies the document: the text lookup ends the value.
    ctx = context(tokenizer, '{"address": "134 Mill Lane, Porto')
    assert tokenizer.decode(tokens_only.propose([ctx], [8])[0]).startswith(", Portugal")
    assert tokenizer.decode(with_text.propose([ctx], [8])[0]) == '",'
    # A value about to start after its key: the document's label for it comes first.
    ctx = context(tokenizer, '{"name": "Kenji Haddad", "email": "')
    assert tokenizer.decode(with_text.propose([ctx], [16])[0]) == 'kenji.haddad@northwind.com",'
    with_text.request_finished(ctx, completed=False)
    assert not with_text._text._prompts


@pytest.mark.parametrize(
    ("output", "draft"),
    [
        ('{"email": "', 'kenji.haddad@northwind.com",'),  # the label is `E-mail:`
        ('{"e_mail":', ' "kenji.haddad@northwind.com",'),  # the quote is drafted too
        ('{"phone": ', '"+351 22 555",'),
        ('{"total":', ' 1234.50 EUR",'),  # a number: no quote (the grammar cuts ` EUR`)
        ('{"contact": "', 'Kenji Haddad",'),
    ],
)
def test_a_value_about_to_start_copies_what_follows_its_label(tokenizer, output, draft):
    lookup = TextLookup(tokenizer)
    got = lookup.propose_labeled(context(tokenizer, output), 16)
    assert tokenizer.decode(got) == draft


def test_no_labeled_draft_without_a_bare_label_or_outside_structured_outputs(tokenizer):
    lookup = TextLookup(tokenizer)
    assert lookup.propose_labeled(context(tokenizer, '{"city": "'), 16) == []
    assert lookup.propose_labeled(context(tokenizer, '{"email": "', structured=False), 16) == []
    assert lookup.propose_labeled(context(tokenizer, '{"email": "k'), 16) == []  # started
    # A quoted key in the prompt is an instruction about the output, not a label.
    prompt = tokenizer.encode('Reply with "email": the address.\n', add_special_tokens=False)
    output = tokenizer.encode('{"email": "', add_special_tokens=False)
    quoted = DraftContext("q", prompt + output, len(prompt), cache_key=None, structured=True)
    assert lookup.propose_labeled(quoted, 16) == []
