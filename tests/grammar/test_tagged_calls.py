"""Tagged tool calls with the real Qwen2.5 tokenizer, where `<tool_call>` (151657) and
`</tool_call>` (151658) are single tokens: the grammar names those tokens, for every
tool_choice, and plain text under "auto" is free but for the call's own opening."""

from __future__ import annotations

import numpy as np
import pytest

from agentrt.engine.loader.tokenizer import load_tokenizer
from agentrt.grammar import GenerationBounds, GrammarCompiler, GrammarSpec, allocate_bitmask
from agentrt.grammar.tools import CallTags, tagged_calls_lark, tool_call_spec_text

OPEN_ID, CLOSE_ID, EOS_ID = 151657, 151658, 151645
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_rate",
            "parameters": {
                "type": "object",
                "properties": {"currency": {"enum": ["EUR", "USD"]}},
                "required": ["currency"],
            },
        },
    },
]
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
RATE = '<tool_call>\n{"name": "get_rate", "arguments": {"currency": "EUR"}}\n</tool_call>'
SPECIAL = CallTags(open_special=True, close_special=True)


@pytest.fixture(scope="module")
def qwen_tok(qwen_tokenizer_dir):
    return load_tokenizer(qwen_tokenizer_dir)


@pytest.fixture(scope="module")
def qwen_compiler(qwen_tok) -> GrammarCompiler:
    return GrammarCompiler(qwen_tok, timeout_s=120)  # a loaded machine: no false timeouts


def _grammar(compiler, tool_choice, *, parallel=True, tags=SPECIAL):
    tools, choice = tool_call_spec_text(TOOLS, tool_choice)
    text = tagged_calls_lark(tools, choice, parallel=parallel, tags=tags)
    return compiler.compile(GrammarSpec.from_ebnf(text))


def _first_allowed(grammar) -> np.ndarray:
    bitmask = allocate_bitmask(1, grammar.tok.vocab_size)
    grammar.matcher().fill_bitmask(bitmask, 0)
    bits = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")
    return np.flatnonzero(bits)


def _accepts(grammar, tok, text: str) -> bool:
    matcher = grammar.matcher()
    ids = tok.encode(text, add_special_tokens=False) + [EOS_ID]
    return all(matcher.accept_token(t) for t in ids)


def test_the_tags_are_single_tokens(qwen_tok):
    ids = qwen_tok.encode(WEATHER, add_special_tokens=False)
    assert ids[0] == OPEN_ID and ids[-1] == CLOSE_ID
    # They are not "special" to the decoder: the text read back holds them.
    assert qwen_tok.decode(ids, skip_special_tokens=True) == WEATHER


NAMED = {"type": "function", "function": {"name": "get_rate"}}


@pytest.mark.parametrize("tool_choice", ["auto", "required", NAMED])
def test_the_first_mask_admits_the_call_token(qwen_compiler, qwen_tok, tool_choice):
    grammar = _grammar(qwen_compiler, tool_choice)
    allowed = _first_allowed(grammar)
    assert OPEN_ID in allowed
    if tool_choice == "auto":  # text or a call: text may start with `<` (token 27) too
        assert qwen_tok.convert_tokens_to_ids("<") in allowed and EOS_ID in allowed
        assert len(allowed) > 100_000
    else:
        assert allowed.tolist() == [OPEN_ID]


def test_scripted_calls_in_special_tokens(qwen_compiler, qwen_tok):
    auto, required = _grammar(qwen_compiler, "auto"), _grammar(qwen_compiler, "required")
    named = _grammar(qwen_compiler, NAMED)
    for grammar in (auto, required):
        assert _accepts(grammar, qwen_tok, WEATHER)
        assert _accepts(grammar, qwen_tok, WEATHER + "\n" + RATE)  # parallel calls
    assert _accepts(named, qwen_tok, RATE)
    assert not _accepts(named, qwen_tok, WEATHER) and not _accepts(
        named, qwen_tok, RATE + "\n" + RATE
    )
    single = _grammar(qwen_compiler, "required", parallel=False)
    assert _accepts(single, qwen_tok, RATE) and not _accepts(single, qwen_tok, RATE + "\n" + RATE)
    bad_args = '<tool_call>\n{"name": "get_rate", "arguments": {"currency": "GBP"}}\n</tool_call>'
    assert not _accepts(required, qwen_tok, bad_args)


def test_auto_text_is_free_but_for_the_opening(qwen_compiler, qwen_tok):
    auto = _grammar(qwen_compiler, "auto")
    for text in ("It is sunny.", "<b>bold</b> text", "{not a call}", "[1, 2]", ""):
        assert _accepts(auto, qwen_tok, text), text
    assert not _accepts(_grammar(qwen_compiler, "required"), qwen_tok, "It is sunny.")
    # The tag spelled out in ordinary tokens is no text (a reply that starts like a call
    # is a call): `<`, `tool`, `_call`, `>` is refused at its last token.
    spelled = [qwen_tok.convert_tokens_to_ids(t) for t in ("<", "tool", "_call", ">")]
    matcher = auto.matcher()
    assert [matcher.accept_token(t) for t in spelled] == [True, True, True, False]


def test_tags_spelled_as_text_for_a_tokenizer_without_them(qwen_compiler, qwen_tok):
    """Without the special tokens (CallTags default), the tag is text that ordinary tokens
    spell. (Here the mask also shows the special token, which the matcher then refuses: a
    dead end, which is why a tokenizer that has the token gets the token syntax.)"""
    grammar = _grammar(qwen_compiler, "required", tags=CallTags())
    assert not grammar.matcher().accept_token(OPEN_ID)
    spelled = [qwen_tok.convert_tokens_to_ids(t) for t in ("<", "tool", "_call", ">")]
    matcher = grammar.matcher()
    assert all(matcher.accept_token(t) for t in spelled)


def test_unpadded_tags_with_a_slash_inside(qwen_compiler, qwen_tok):
    """Phi-4-mini's calls: `<|tool_call|>{...}<|/tool_call|>` back to back, no newline around
    the JSON (`pad=""`); the same calls padded are refused."""
    tags = CallTags("<|tool_call|>", "<|/tool_call|>", pad="")
    grammar = _grammar(qwen_compiler, "required", tags=tags)

    def phi(call: str, pad: str = "") -> str:
        body = call.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")
        return f"<|tool_call|>{pad}{body}{pad}<|/tool_call|>"

    for text, ok in ((phi(WEATHER) + phi(RATE), True), (phi(WEATHER, "\n"), False)):
        matcher = grammar.matcher()
        ids = qwen_tok.encode(text, add_special_tokens=False)
        accepted = all(matcher.accept_token(t) for t in ids)
        assert (accepted and matcher.can_terminate()) is ok


def test_a_short_reply_far_from_max_tokens_is_not_steered(qwen_compiler, qwen_tok):
    """Regression (issue 27): a 13-token reply with max_tokens=40 had 4 rows steered (its
    openers refused while it wrote the name) and was reported as cut short. Counted in
    Qwen's own tokens, the completion never comes near the tokens left; a tight budget
    still steers."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    spec = GrammarSpec.from_json_schema(schema).with_bounds(GenerationBounds())
    grammar = qwen_compiler.compile(spec)
    ids = qwen_tok.encode('{"name": "John Smith", "age": 42}', add_special_tokens=False)
    ids.append(EOS_ID)
    bitmask = allocate_bitmask(1, qwen_compiler.vocab_size)
    for max_tokens, steered in ((40, False), (len(ids) + 2, True)):
        matcher = grammar.matcher()
        for i, token_id in enumerate(ids):
            matcher.fill_bitmask(bitmask, 0, tokens_left=max_tokens - i)
            if not matcher.accept_token(token_id):
                break  # steered away from the reply's own next token
        assert (matcher.num_steered > 0) is steered, max_tokens


def _spelled_ids(tok, text: str) -> list[int]:
    """`text` in ordinary tokens only: each tag token spelled out (`<`, `tool_call>`)."""
    ids = []
    for token_id in tok.encode(text, add_special_tokens=False):
        if token_id in (OPEN_ID, CLOSE_ID):
            head = "<" if token_id == OPEN_ID else "</"
            ids += tok.encode(head, add_special_tokens=False)
            ids += tok.encode("tool_call>", add_special_tokens=False)
        else:
            ids.append(token_id)
    return ids + [EOS_ID]


def _accepts_ids(grammar, ids: list[int]) -> bool:
    matcher = grammar.matcher()
    return all(matcher.accept_token(t) for t in ids)


@pytest.mark.parametrize("tags", [SPECIAL, CallTags()], ids=["special", "spelled"])
def test_auto_admits_text_then_calls(qwen_compiler, qwen_tok, tags):
    """Qwen writes a sentence, then its call: under "auto" text may come before the calls
    (never after them), under "required" not at all."""
    auto = _grammar(qwen_compiler, "auto", tags=tags)
    required = _grammar(qwen_compiler, "required", tags=tags)

    def ids(text):
        if tags.open_special:
            return qwen_tok.encode(text, add_special_tokens=False) + [EOS_ID]
        return _spelled_ids(qwen_tok, text)

    lead = "Let me check.\n"
    for text in (WEATHER, lead + WEATHER, lead + WEATHER + "\n" + RATE, "<b>bold</b>", ""):
        assert _accepts_ids(auto, ids(text)), text
    assert not _accepts_ids(auto, ids(WEATHER + " and then text"))
    assert not _accepts_ids(required, ids(lead + WEATHER))
    single = _grammar(qwen_compiler, "auto", parallel=False, tags=tags)
    assert _accepts_ids(single, ids(lead + RATE))
    assert not _accepts_ids(single, ids(lead + RATE + "\n" + RATE))
    if not tags.open_special:  # the spelled tag opens a call wherever it comes
        assert not _accepts_ids(auto, ids("a <tool_call> b"))
