"""model/rope.py: a CPU rope table is filled as positions are reached (`RotaryEmbedding.cover`),
with the rows the whole table computed at once has, and its unreached rows take no memory.
Partial rotary (Phi-4-mini: the first 96 of each head's 128 dims turn) on the torch path and
the fused C glue's rope_qkv, against transformers' Phi-3 rope."""

from __future__ import annotations

import pytest
import torch

from agentrt.engine import envs
from agentrt.engine.model.rope import FILL_ROWS, RotaryEmbedding, rope_table
from agentrt.kernels import load_cpu_ops

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


# Phi-4-mini's attention: 24 heads, 8 KV heads of 128 dims, the first 96 turning (LONGROPE's
# 48 factors, one per frequency of those).
HEADS, KV_HEADS, HEAD_DIM, ROTARY_DIM = 24, 8, 128, 96


def _hf_rotated(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
    """transformers' Phi-3 rope of q (T, H, D) and k (T, KVH, D) at `positions`, a
    partial_rotary_factor of 0.75 and LONGROPE (its long factors once a position passes the
    original context, as HF switches for the whole sequence)."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    config = Phi3Config(
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=20000,
        original_max_position_embeddings=LONGROPE["original_max_position_embeddings"],
        rope_parameters={**LONGROPE, "rope_theta": 1e4, "partial_rotary_factor": 0.75},
    )
    cos, sin = Phi3RotaryEmbedding(config)(q, positions[None])  # (1, T, R) each
    assert cos.shape[-1] == ROTARY_DIM
    q, k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return q[0].transpose(0, 1), k[0].transpose(0, 1)  # (T, H, D), (T, KVH, D)


# Positions within LONGROPE's original context (5000), then past it.
@pytest.mark.parametrize("positions", [[0, 1, 77, 4999], [5000, 6123, 19999]])
def test_partial_rotary_turns_the_first_dims_as_transformers(positions):
    """The torch path (RotaryEmbedding with rotary_dim, apply_rotary) and the fused C glue
    (rope_qkv on a (P, 96) table) turn the first 96 dims as transformers' Phi-3 rope does;
    the last 32 pass through as they are."""
    positions = torch.tensor(positions)
    g = torch.Generator().manual_seed(len(positions))
    qkv = torch.randn(len(positions), (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g).bfloat16()
    q, k, v = qkv.float().view(len(positions), -1, HEAD_DIM).split((HEADS, KV_HEADS, KV_HEADS), 1)
    want_q, want_k = _hf_rotated(q, k, positions)
    exact = dict(rtol=1e-6, atol=1e-6)

    rotary = RotaryEmbedding(HEAD_DIM, 20000, 1e4, LONGROPE, rotary_dim=ROTARY_DIM)
    rotate = rotary.for_step(positions, torch.float32)
    assert rotary.cos_sin_cache.shape == (20000, ROTARY_DIM)
    got_q, got_k = rotate(q, k)
    torch.testing.assert_close(got_q, want_q, **exact)
    torch.testing.assert_close(got_k, want_k, **exact)
    assert torch.equal(got_q[..., ROTARY_DIM:], q[..., ROTARY_DIM:])  # passed through

    ops = load_cpu_ops(envs.cache_dir() / "kernels")
    cache = torch.zeros(4, 2, 16, KV_HEADS, HEAD_DIM)  # 4 blocks of 16 rows
    key_rows = torch.arange(len(positions)) * 2  # block 0's rows 0, 2, 4, ...
    query = ops.rope_qkv(qkv, cache, key_rows, positions, rotary.cos_sin_cache, HEADS)
    torch.testing.assert_close(query, want_q, **exact)
    torch.testing.assert_close(cache[0, 0, key_rows], want_k, **exact)
    assert torch.equal(cache[0, 1, key_rows], v)  # the value, at the key's row + block size
    assert torch.equal(query[..., ROTARY_DIM:], q[..., ROTARY_DIM:])
