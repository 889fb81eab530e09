"""windowed_attention.py: sliding-window attention over the paged cache (Gemma's
local layers) and soft-capped scores (Gemma 2), against a direct computation; it never
reads a block wholly before the window (what lets the KV manager free such blocks)."""

from __future__ import annotations

import pytest
import torch

from agentrt.engine.records import ScheduledChunk
from agentrt.engine.worker.model_runner import attention_metadata, prepare_input
from agentrt.engine.worker.windowed_attention import windowed_attention

BLOCK, HEADS, KV_HEADS, DIM = 4, 4, 2, 8
SCALE = DIM**-0.5


def _meta(chunks):
    meta = attention_metadata(prepare_input(chunks, BLOCK, torch.device("cpu")), BLOCK)
    return meta


def _reference(q, keys, values, positions, window, softcap):
    """q (T, H, D) at `positions` over every key so far (L, KVH, D), in fp64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    k = keys.double().repeat_interleave(HEADS // KV_HEADS, dim=1)  # (L, H, D)
    v = values.double().repeat_interleave(HEADS // KV_HEADS, dim=1)
    for t, p in enumerate(positions):
        lo = 0 if window is None else max(0, p - window + 1)
        scores = torch.einsum("hd,lhd->hl", q[t].double(), k[lo : p + 1]) * SCALE
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        out[t] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v[lo : p + 1])
    return out


@pytest.mark.parametrize(("window", "softcap"), [(6, None), (6, 5.0), (None, 5.0)])
def test_prefill_then_decode_equal_a_direct_computation(window, softcap):
    gen = torch.Generator().manual_seed(0)
    cache = torch.zeros(8, 2, BLOCK, KV_HEADS, DIM)
    blocks = [5, 1, 6, 2, 7, 3]  # scattered
    keys = torch.randn(22, KV_HEADS, DIM, generator=gen)
    values = torch.randn(22, KV_HEADS, DIM, generator=gen)
    queries = torch.randn(22, HEADS, DIM, generator=gen) * 3

    # A 20-token prompt in chunks of 13 and 7 (the second after cached context)...
    for start, stop in ((0, 13), (13, 20)):
        chunk = ScheduledChunk("a", list(range(start, stop)), start, blocks, True)
        out = windowed_attention(
            queries[start:stop],
            keys[start:stop],
            values[start:stop],
            cache,
            _meta([chunk]),
            SCALE,
            window,
            softcap,
        )
        want = _reference(queries[start:stop], keys, values, range(start, stop), window, softcap)
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    if window is not None:
        # ... then a decode at position 20 sees keys 15..20: blocks 0-2 (positions 0-11) lie
        # wholly before its window, and poisoning them changes nothing.
        for b in blocks[:3]:
            cache[b] = float("nan")
    chunk = ScheduledChunk("a", [20], 20, blocks, True)
    out = windowed_attention(
        queries[20:21], keys[20:21], values[20:21], cache, _meta([chunk]), SCALE, window, softcap
    )
    want = _reference(queries[20:21], keys, values, [20], window, softcap)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
