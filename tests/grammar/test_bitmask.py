from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from agentrt.grammar import allocate_bitmask, allowed_token_ids, apply_bitmask, bitmask_words


def test_layout_is_xgrammar_compatible() -> None:
    import xgrammar as xg

    for vocab in (1, 31, 32, 33, 49_152, 49_280):
        assert allocate_bitmask(4, vocab).shape == tuple(xg.get_bitmask_shape(4, vocab))
        assert bitmask_words(vocab) == (vocab + 31) // 32
    bm = allocate_bitmask(1, 70)
    assert bm.dtype == np.int32 and bm.flags.c_contiguous and (bm == -1).all()
    with pytest.raises(ValueError, match=">= 1"):
        allocate_bitmask(0, 10)


def test_bit_i_of_word_i_div_32_means_token_i() -> None:
    bm = np.zeros((2, 3), dtype=np.int32)
    for t in (0, 31, 32, 65):
        bm[1, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    assert allowed_token_ids(bm, 1, 70) == [0, 31, 32, 65]
    assert allowed_token_ids(bm, 0, 70) == []
    logits = np.zeros((2, 80), dtype=np.float32)  # wider than the mask: extra ids masked
    apply_bitmask(logits, bm)
    assert np.isneginf(logits[0]).all()
    assert np.flatnonzero(np.isfinite(logits[1])).tolist() == [0, 31, 32, 65]


def test_grammar_package_imports_nothing_local() -> None:
    root = Path(__file__).resolve().parents[2] / "grammar"
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                assert not node.module.startswith(("agentrt", "engine", "kernels")), path
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith(("agentrt", "engine", "kernels")), path
