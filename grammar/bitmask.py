"""Token bitmasks in the xgrammar layout.

Layout (a spec, not an implementation detail): `np.int32[rows, ceil(vocab_size / 32)]`;
bit `i % 32` of word `i // 32` set means token `i` is allowed. Matchers fill one row each.
"""

from __future__ import annotations

import numpy as np


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def pack_bits(flags: np.ndarray) -> np.ndarray:
    """A bool vector (one flag per token) as uint32 words in this layout."""
    padded = np.zeros(bitmask_words(flags.size) * 32, dtype=bool)
    padded[: flags.size] = flags
    words = np.packbits(padded.reshape(-1, 32)[:, ::-1], axis=1).view(">u4")
    return words.astype(np.uint32).reshape(-1)


def allocate_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    """A C-contiguous int32 `[rows, ceil(vocab_size/32)]` bitmask with every token allowed."""
    if rows < 1 or vocab_size < 1:
        raise ValueError(f"rows and vocab_size must be >= 1, got {rows} and {vocab_size}")
    return np.full((rows, bitmask_words(vocab_size)), -1, dtype=np.int32)


def allowed_token_ids(bitmask: np.ndarray, row: int, vocab_size: int) -> list[int]:
    """The ids below vocab_size that row `row` allows, ascending."""
    words = bitmask[row].view(np.uint32)  # (W,)
    bits = (words[:, None] >> np.arange(32, dtype=np.uint32)) & 1  # (W, 32)
    return np.flatnonzero(bits.reshape(-1)[:vocab_size]).tolist()
