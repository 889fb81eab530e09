"""kernels/cpu_sampling.py: argmax and top-k in one pass a row, against torch.argmax and a
stable descending sort (`top_k_ref`), on random rows with ties, -inf and NaN."""

from __future__ import annotations

import pytest
import torch

from agentrt.kernels.cpu_sampling import default_cpu_sampling, top_k_ref
from agentrt.kernels.errors import KernelInputError


def rows_with_ties(seed: int, num_rows: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=gen) * 3
    logits[0] = torch.randint(0, 7, (vocab,), generator=gen).float()  # ties everywhere
    logits[1, vocab // 3 :: 97] = logits[1].max() + 1  # tied maxima, the first not at 0
    logits[2, : vocab // 2] = -torch.inf  # a masked half (a grammar's)
    return logits


@pytest.mark.parametrize("vocab", [1, 17, 1000, 151_936])
def test_argmax_is_torch_argmax(vocab):
    cs = default_cpu_sampling()
    logits = rows_with_ties(vocab, 3, vocab) if vocab > 2 else torch.randn(3, vocab)
    assert torch.equal(cs.argmax(logits), logits.argmax(dim=-1))
    wide = torch.randn(3, vocab + 5)[:, :vocab]  # rows strided apart
    assert torch.equal(cs.argmax(wide), wide.argmax(dim=-1))


def test_argmax_of_nan_and_all_masked_rows_is_torch_argmax():
    logits = torch.randn(3, 300)
    logits[0, [40, 250]] = torch.nan
    logits[1] = -torch.inf
    logits[2, 299] = torch.inf
    assert torch.equal(default_cpu_sampling().argmax(logits), logits.argmax(dim=-1))


@pytest.mark.parametrize("k", [1, 2, 40, 256, 999, 1000])
def test_top_k_is_the_stable_sorts_head_with_the_ties_counted(k):
    cs = default_cpu_sampling()
    logits = rows_with_ties(k, 4, 1000)
    for got, want in zip(cs.top_k(logits, k), top_k_ref(logits, k), strict=True):
        assert torch.equal(got, want)


def test_top_k_over_a_large_vocabulary_and_a_nan_row():
    logits = rows_with_ties(5, 4, 151_936)
    logits[3, 77] = torch.nan
    values, ids, num_ge = default_cpu_sampling().top_k(logits, 50)
    want = top_k_ref(logits[:3], 50)
    assert torch.equal(values[:3], want[0]) and torch.equal(ids[:3], want[1])
    assert torch.equal(num_ge[:3], want[2]) and num_ge[3] == -1


def test_bad_inputs_are_refused():
    cs = default_cpu_sampling()
    for bad in (torch.randn(2, 8).double(), torch.randn(8), torch.randn(8, 2).T, torch.empty(2, 0)):
        with pytest.raises(KernelInputError):
            cs.argmax(bad)
    with pytest.raises(KernelInputError, match="k = 9"):
        cs.top_k(torch.randn(2, 8), 9)


def test_softmax_draw_is_the_inverse_cdf_of_the_softmax():
    cs = default_cpu_sampling()
    if not cs.has_softmax:
        pytest.skip("softmax_draw runs on AVX-512 builds")
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 4096, generator=gen) * 4
    logits[1, ::2] = -torch.inf  # a grammar's mask
    logits[2, :4000] = -torch.inf  # a few tokens left
    temperature = torch.tensor([1.0, 0.7, 2.0, 0.3])
    probs = (logits / temperature.unsqueeze(1)).softmax(dim=-1)  # [4, V]
    whole = (
        (logits / temperature.unsqueeze(1))
        .sub((logits / temperature.unsqueeze(1)).amax(-1, keepdim=True))
        .exp()
        .sum(-1)
    )
    mismatches = 0
    for _ in range(300):
        uniform = torch.rand(4, generator=gen)
        totals, tokens = cs.softmax_draw(logits, temperature, uniform)
        torch.testing.assert_close(totals, whole, rtol=1e-5, atol=0)
        cdf = probs.cumsum(-1)
        want = torch.searchsorted(cdf, uniform.unsqueeze(1) * cdf[:, -1:], right=True).squeeze(1)
        assert (probs.gather(1, tokens.unsqueeze(1)) > 0).all()  # never a masked token
        mismatches += int((tokens != want).sum())
    assert mismatches <= 2  # fp32 rounding at a boundary between two tokens
    # the top end: u just under 1 takes a token with weight at the end of the support
    almost = torch.full((4,), 1 - 2**-24)
    tokens = cs.softmax_draw(logits, temperature, almost)[1]
    assert (probs.gather(1, tokens.unsqueeze(1)) > 0).all()
    after = probs.sum(-1) - probs.cumsum(-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    assert (after <= 1e-5).all()  # at most rounding's worth of mass past it


def test_softmax_draw_marks_a_nan_row():
    cs = default_cpu_sampling()
    if not cs.has_softmax:
        pytest.skip("softmax_draw runs on AVX-512 builds")
    logits = torch.randn(2, 64)
    logits[1, 9] = torch.nan
    totals, tokens = cs.softmax_draw(logits, torch.ones(2), torch.full((2,), 0.5))
    assert tokens[1] == -1 and totals[1].isnan() and tokens[0] >= 0
    with pytest.raises(KernelInputError, match="multiple of 16"):
        cs.softmax_draw(torch.randn(2, 60), torch.ones(2), None)
