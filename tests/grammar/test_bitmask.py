from __future__ import annotations

import numpy as np
import pytest

from agentrt.grammar import allocate_bitmask, allowed_token_ids, bitmask_words


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
    assert allowed_token_ids(bm, 1, 40) == [0, 31, 32]  # ids past vocab_size are not read
