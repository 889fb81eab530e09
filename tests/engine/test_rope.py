"""model/rope.py: a CPU rope table is filled as positions are reached (`RotaryEmbedding.cover`),
with the rows the whole table computed at once has, and its unreached rows take no memory."""

from __future__ import annotations

import pytest
import torch

from agentrt.engine.model.rope import FILL_ROWS, RotaryEmbedding, rope_table

LLAMA3 = dict(
    rope_type="llama3",
    factor=32.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)
# The original context off the fill's row boundaries: a chunk holds short and long rows.
LONGROPE = dict(
    rope_type="longrope",
    short_factor=[1 + 0.03 * i for i in range(48)],
    long_factor=[1.1**i for i in range(48)],
    original_max_position_embeddings=5000,
    attention_factor=1.19,
)


@pytest.mark.parametrize(
    ("head_dim", "max_positions", "theta", "scaling"),
    [(256, 3 * FILL_ROWS, 1e6, None), (64, 3 * FILL_ROWS, 5e5, LLAMA3), (96, 10000, 1e4, LONGROPE)],
)
def test_cover_fills_the_rows_of_the_whole_table(head_dim, max_positions, theta, scaling):
    whole = rope_table(head_dim, max_positions, theta, scaling)
    rotary = RotaryEmbedding(head_dim, max_positions, theta, scaling)
    assert rotary.num_filled == 0
    rotary.cover(torch.tensor([3, 10, 7]))
    assert rotary.num_filled == FILL_ROWS  # one chunk: the rows after it not computed
    assert torch.equal(rotary.cos_sin_cache[:FILL_ROWS], whole[:FILL_ROWS])
    rotary.cover(torch.tensor([FILL_ROWS - 1]))
    assert rotary.num_filled == FILL_ROWS
    rotary.cover(torch.tensor([0, max_positions - 1]))  # past chunks: up to the table's end
    assert rotary.num_filled == max_positions
    assert torch.equal(rotary.cos_sin_cache, whole)
    # for_step covers its positions too (the layer-by-layer path).
    fresh = RotaryEmbedding(head_dim, max_positions, theta, scaling)
    fresh.for_step(torch.tensor([FILL_ROWS + 1]), torch.float32)
    assert fresh.num_filled == 2 * FILL_ROWS
    assert torch.equal(fresh.cos_sin_cache[: 2 * FILL_ROWS], whole[: 2 * FILL_ROWS])


def test_unreached_rows_take_no_memory():
    def resident_bytes() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    before = resident_bytes()
    rotary = RotaryEmbedding(256, 65536, 1e6, None)  # 64 MiB of table
    rotary.cover(torch.tensor([100]))  # its first FILL_ROWS (4 MiB) written
    assert rotary.cos_sin_cache.numel() * 4 == 64 << 20
    assert resident_bytes() - before < 16 << 20
