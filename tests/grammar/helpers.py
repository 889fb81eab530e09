"""Helpers for the grammar tests: a tiny synthetic tokenizer and a token-by-token driver."""

from __future__ import annotations

from typing import Any

from agentrt.grammar import allocate_bitmask, allowed_token_ids

SYNTH_VOCAB = 320  # logits width for the synthetic tokenizer (padded past its 266 tokens)


def make_synthetic_tokenizer() -> Any:
    """Byte-level BPE: <eos>=0, the 256 byte symbols, and a few merges ({" ": true null)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {"<eos>": 0}
    for ch in sorted(ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    merges = []
    for a, b in [("{", '"'), ('"', ":"), ("t", "r"), ("tr", "u"), ("tru", "e"), ("n", "u"),
                 ("nu", "l"), ("nul", "l"), ('"', ",")]:  # fmt: skip
        merges.append((a, b))
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def accept_all(matcher: Any, token_ids: list[int]) -> int:
    """Accept tokens in order until one is refused; returns how many were accepted."""
    for i, t in enumerate(token_ids):
        if not matcher.accept_token(t):
            return i
    return len(token_ids)


def allowed_now(matcher: Any) -> list[int]:
    """The token ids the matcher allows next (one fresh mask row)."""
    vocab = matcher.grammar.tok.vocab_size
    bitmask = allocate_bitmask(1, vocab)
    matcher.fill_bitmask(bitmask, 0)
    return allowed_token_ids(bitmask, 0, vocab)


def drive(matcher: Any, tok: Any, text: str) -> tuple[bool, bool]:
    """Feed `text` token by token, checking each token against the mask first.

    Returns (every token was allowed and accepted, the matcher can terminate afterwards).
    """
    vocab = matcher.grammar.tok.vocab_size
    bitmask = allocate_bitmask(1, vocab)
    for t in tok.encode(text, add_special_tokens=False):
        matcher.fill_bitmask(bitmask, 0)
        allowed = (int(bitmask[0, t >> 5]) >> (t & 31)) & 1
        if not allowed or not matcher.accept_token(t):
            return False, False
    return True, matcher.can_terminate()


# Two OpenAI-style tool definitions shared by the spec and real-tokenizer tests.
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"]}}},
]  # fmt: skip
