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
