"""The sampler's candidates path (`sample_candidates`: softmax, top-p, min-p and the draw
over each row's top-k candidates, or over the candidates holding a top-p row's nucleus)
against a full-sort reference over the whole row, for the same uniforms, on random logits
with ties."""

from __future__ import annotations

import math

import pytest
import torch

from agentrt.engine.sampling_params import SamplingParams
from agentrt.engine.worker.sampler import (
    TOP_K_CANDIDATES,
    Sampler,
    draw_inverse_cdf,
    sample_candidates,
    sample_untruncated,
)
from agentrt.engine.worker.sampling_metadata import SamplingMetadata


def build(params: list[SamplingParams], vocab_size: int) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params, [[]] * n, [[]] * n, [None] * n, [()] * n, vocab_size, "cpu"
    )


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row `[V]`: temperature, top-k (ties with the k-th kept), top-p over a full stable
    descending sort, min-p; unnormalised, truncated tokens at 0."""
    probs = (logits / p.temperature).softmax(dim=-1)
    values, order = probs.sort(descending=True, stable=True)
    if p.top_k_enabled and p.top_k < len(probs):
        probs = probs.masked_fill(probs < values[p.top_k - 1], 0.0)
        values, order = probs.sort(descending=True, stable=True)
    if p.top_p < 1.0:
        target = p.top_p * probs.sum()
        keep = values.cumsum(0) - values < target
        keep[0] = True
        probs = probs.masked_fill(~torch.zeros_like(keep).scatter_(0, order, keep), 0.0)
    if p.min_p:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs


def random_logits(seed: int, rows: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 2
    logits[0] = torch.randint(0, 40, (vocab,), generator=gen).float() / 8  # many ties
    logits[1, ::3] = -math.inf  # a grammar's mask
    return logits


PARAMS = [
    SamplingParams(temperature=0.7, top_k=20),
    SamplingParams(temperature=1.0, top_k=40, top_p=0.9),
    SamplingParams(temperature=1.3, top_k=1),
    SamplingParams(temperature=0.5, top_k=TOP_K_CANDIDATES, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=1.0, top_k=7, min_p=0.2),
    SamplingParams(temperature=0.3, top_p=0.9),  # top-p alone: a nucleus of a few tokens
    SamplingParams(temperature=0.6, top_p=0.5, min_p=0.1),
]


@pytest.mark.parametrize("params", PARAMS, ids=range(len(PARAMS)))
def test_candidates_draw_what_the_full_sort_reference_draws(params):
    vocab, rows, draws = 3000, 4, 200
    logits = random_logits(params.top_k, rows, vocab)
    if not params.top_k_enabled:  # peaked rows: each nucleus within the candidates
        logits *= 4
    metadata = build([params] * rows, vocab)
    gen = torch.Generator().manual_seed(7)
    probs = torch.stack([reference_probs(logits[r], params) for r in range(rows)])  # [R, V]
    mismatches = 0
    for _ in range(draws):
        uniform = torch.rand(rows, 1, generator=gen)
        got = sample_candidates(logits.clone(), metadata, None, uniform)
        assert got is not None
        want = draw_inverse_cdf(probs, uniform)
        assert (probs.gather(1, got.unsqueeze(1)) > 0).all()  # only kept tokens
        mismatches += int((got != want).sum())
    # fp32 rounding may move a uniform sitting on a boundary between two tokens
    assert mismatches <= 2


def test_a_tie_with_the_kth_beyond_the_candidates_takes_the_full_path():
    vocab = 3000
    logits = torch.randn(2, vocab)
    logits[0, 100:1400] = 5.0  # 1300 tokens tied at the top: k = 5 keeps them all
    metadata = build([SamplingParams(temperature=1.0, top_k=5)] * 2, vocab)
    assert sample_candidates(logits.clone(), metadata, None, torch.rand(2, 1)) is None
    torch.manual_seed(0)
    many = build([SamplingParams(temperature=1.0, top_k=5)] * 4000, vocab)
    tokens = Sampler()(logits[:1].repeat(4000, 1), many).sampled_token_ids
    assert set(tokens.tolist()) <= set(range(100, 1400))  # tied tokens only
    assert len(set(tokens.tolist())) > 1200  # all of them (4000 draws of 1300)


def test_rows_that_do_not_truncate_or_exceed_the_cap_take_the_full_path():
    vocab = 1000
    logits = torch.randn(2, vocab)
    for params in (
        [SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.0)],
        [SamplingParams(temperature=1.0, top_k=TOP_K_CANDIDATES + 1)] * 2,
        [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0)],
    ):
        metadata = build(params, vocab)
        assert sample_candidates(logits, metadata, None, torch.rand(2, 1)) is None


def test_a_top_p_row_whose_nucleus_is_wider_than_the_candidates_takes_the_full_path():
    """Its neighbours still sample among their candidates; it draws what the reference
    draws for its uniform."""
    vocab = 3000
    logits = torch.randn(3, vocab)
    logits[1] *= 40  # a nucleus of a few tokens; rows 0 and 2: ~2000 tokens at T = 5
    params = [SamplingParams(temperature=5.0, top_p=0.9)] * 3
    metadata = build(params, vocab)
    gen = torch.Generator().manual_seed(9)
    probs = torch.stack([reference_probs(logits[r], params[r]) for r in range(3)])
    assert int((probs[0] > 0).sum()) > 1000 and int((probs[1] > 0).sum()) < 50
    mismatches = 0
    for _ in range(100):
        uniform = torch.rand(3, 1, generator=gen)
        got = sample_candidates(logits.clone(), metadata, None, uniform)
        mismatches += int((got != draw_inverse_cdf(probs, uniform)).sum())
    assert mismatches <= 2


def test_seeded_rows_draw_the_same_through_either_path():
    """A seeded request's tokens: the candidates path and the full path (forced by a row
    without top-k in the batch) give the same draws for the same seeds."""
    vocab = 5000
    logits = random_logits(3, 3, vocab)
    params = [SamplingParams(temperature=0.8, top_k=30, top_p=0.95, seed=s) for s in (1, 2, 3)]

    def run(extra: list[SamplingParams]) -> list[int]:
        batch = params + extra
        gens = [
            torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in batch
        ]
        metadata = SamplingMetadata.build(
            batch, [[]] * len(batch), [[]] * len(batch), gens, [()] * len(batch), vocab, "cpu"
        )
        rows = torch.cat([logits, torch.randn(len(extra), vocab)])
        return Sampler()(rows, metadata).sampled_token_ids[:3].tolist()

    fast = run([])
    full = run([SamplingParams(temperature=1.0)])  # this row does not truncate: full path
    assert fast == full


def test_untruncated_rows_draw_what_the_full_softmax_draws():
    """Temperature alone (the engine's default sampling): one kernel over the row, the
    probabilities never written, on AVX-512 builds."""
    vocab, rows = 4096, 3
    logits = random_logits(11, rows, vocab)
    params = [SamplingParams(temperature=t) for t in (1.0, 0.7, 1.5)]
    metadata = build(params, vocab)
    probs = torch.stack([reference_probs(logits[r], params[r]) for r in range(rows)])
    gen = torch.Generator().manual_seed(5)
    if sample_untruncated(logits, metadata, None, torch.rand(rows, 1)) is None:
        pytest.skip("the kernel runs on AVX-512 builds")
    mismatches = 0
    for _ in range(200):
        uniform = torch.rand(rows, 1, generator=gen)
        got = sample_untruncated(logits, metadata, None, uniform)
        assert (probs.gather(1, got.unsqueeze(1)) > 0).all()
        mismatches += int((got != draw_inverse_cdf(probs, uniform)).sum())
    assert mismatches <= 2
    truncated = build([SamplingParams(temperature=1.0, min_p=0.1)] * rows, vocab)
    assert sample_untruncated(logits, truncated, None, torch.rand(rows, 1)) is None
